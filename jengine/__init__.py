"""jengine: vLLM's serving engine rebuilt on JAX/XLA.

The public names are imported lazily so that host-side modules (scheduler, block manager, ...)
can be imported without pulling in jax.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "jengine.llm",
    "SamplingParams": "jengine.sampling_params",
    "RequestOutput": "jengine.outputs",
    "CompletionOutput": "jengine.outputs",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jengine' has no attribute {name!r}")
