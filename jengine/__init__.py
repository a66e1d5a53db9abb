"""jengine: vLLM's serving engine rebuilt on JAX/XLA."""

__version__ = "0.1.0"
