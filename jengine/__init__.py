"""jengine: vLLM's serving engine rebuilt on JAX/XLA.

The public names are imported lazily so that host-side modules (scheduler, block manager, ...)
can be imported without pulling in jax.
"""

import os

__version__ = "0.1.0"


def _default_xla_flags() -> None:
    """XLA settings jengine runs best with, unless XLA_FLAGS already names them. Read when the JAX backend
    starts, so they apply when jengine is imported before JAX first touches a device.

    Command buffers (CUDA graphs) off: on the H200 the step's graphs are cut at every Pallas kernel, and
    decode at batch 1 ran 2-4% faster without them (benchmarks/RESULTS.md, profile_step.py).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer=".strip()


_default_xla_flags()

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
