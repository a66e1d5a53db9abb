"""jengine: vLLM's serving engine rebuilt on JAX/XLA.

The public names are imported lazily so that host-side modules (scheduler, block manager, ...)
can be imported without pulling in jax.
"""

import os

__version__ = "0.1.0"

_XLA_DEFAULTS = {
    "--xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL",  # not COLLECTIVES: see below
    "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel": "false",  # XLA's default is true: see below
}
# A default is left out where XLA_FLAGS names it, or the newer flag for the same setting (XLA's setter of the older one
# would then remove an entry that may no longer be there).
_SAME_SETTING = {
    "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel": "--xla_gpu_experimental_use_collective_kernels",
}


def _named(name: str, flags: str) -> bool:
    return name in flags or (name in _SAME_SETTING and _SAME_SETTING[name] in flags)
_ALLOCATOR_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")


def _default_xla_flags() -> None:
    """XLA settings jengine runs best with, each unless XLA_FLAGS already names it. Read when the JAX
    backend starts, so they apply when jengine is imported before JAX first touches a device.

    Measured on H200s with benchmarks/profile_step.py (benchmarks/RESULTS.md, session 3): a step is
    ~500 kernel launches per device, and under tensor parallelism the host's launches, not the GPUs,
    set the pace. CUDA graphs that also capture the Pallas kernels and the collectives cut the host's
    time per step from 3.8 to 1.7 ms at TP 1 (the same step time).

    XLA's one-shot (and two-shot) all-reduce kernels are switched off
    (`--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false`; XLA turns them on for all-reduces of up to
    4 MiB between NVLink-connected Hoppers). They took the 8B TP 4 decode step on H200s from 5.8 to 5.0 ms
    (session 3), but each gives its reduction scratch memory outside JAX's allocator, per all-reduce of every
    program and device: on two H100s (80 GB, 8% of each outside the allocator) the 8B at TP 2 ran the GPUs out
    of memory in warm-up and hung there, with 1 or 4 loaded copies of the forwards and with the allocator at
    85% instead of 92% (RESULTS.md, session 40). Without them the same run starts and steps (batch 1 5.69 ms,
    batch 64 6.78 ms). XLA also keeps those kernels out of its CUDA graphs.

    The collectives (NCCL all-reduces) are left out of the CUDA graphs (no `COLLECTIVES` in the list): XLA
    records a graph that holds a collective again before every run of it (all ~500 commands of a TP forward),
    which made the host's launch the step under tensor parallelism. On two H200s (RESULTS.md, session 41; the
    8B at TP 2) a step took 6.23 ms at batch 1 and 7.82 at batch 64 with them in the graphs, 4.95-5.10 and
    6.89-7.20 without: the forward then runs as ~65 graphs cut at the all-reduces, none recorded again.

    Not a default: `--xla_gpu_command_buffer_update_mode=SKIP_TEMP`. A CUDA graph is re-recorded
    whenever a buffer it uses moved, and the engine's loop moves a step's temporaries: re-recording
    took 1.1-5 ms of host time per batch-64 step (session 16). SKIP_TEMP gives the temporaries fixed
    addresses and cut it to ~0.5 ms, but it switches JAX to XLA's VMM allocator. That allocator reports
    no limit, XLA then plans programs for 80% of the device, and every H200 run whose weights and KV
    cache passed that failed (sessions 16-17). Under it `kv_cache.device_memory` sizes the KV cache
    from the driver, inside that 80%: fewer pages than the ≥ 90% of free memory jengine gives them. Under
    tensor parallelism it is the fastest setting measured, with `COLLECTIVES` back in the graphs: the graph is
    still recorded before every run, but the host's launch took 3.0-3.2 ms a step against 5.4-6.1 (why was not
    traced). The 8B at TP 2 on two H200s: 4.00 ms at batch 1 and 5.39 at batch 64 (session 41), with 18% fewer
    KV pages. The README names it for TP users.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f"{name}={value}" for name, value in _XLA_DEFAULTS.items() if not _named(name, flags)]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def _default_memory_fraction() -> None:
    """Let JAX's allocator take 92% of a GPU instead of its default 75% (unless the user configured the
    allocator), so that `gpu_memory_utilization` of the device (vLLM's meaning, 0.9 by default) fits
    in it. 92% leaves room for what lives outside the allocator (CUDA context, cuBLAS workspaces,
    CUDA graphs, NCCL buffers); it is the setting every H200 benchmark in benchmarks/RESULTS.md ran with."""
    if not any(name in os.environ for name in _ALLOCATOR_VARS):
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.92"


def _jax_backend_started() -> bool:
    """Whether JAX was imported and its backends initialized before jengine (jax is not imported here)."""
    import sys

    bridge = sys.modules.get("jax._src.xla_bridge")
    try:
        return bool(bridge is not None and bridge.backends_are_initialized())
    except Exception:  # a JAX without this private helper: assume started, so nothing changes under it
        return True


def _late_start_warning(backend: str, env=os.environ) -> str | None:
    """What to tell a user whose JAX GPU backend started before jengine was imported: the XLA flags and
    the allocator fraction above are read when the backend starts, so jengine's defaults did not apply
    (unless the user set them). None when there is nothing to say."""
    if backend != "gpu":
        return None
    missing = []
    if any(not _named(name, env.get("XLA_FLAGS", "")) for name in _XLA_DEFAULTS):
        missing.append("its XLA_FLAGS defaults (CUDA graphs over all kernels; slower steps)")
    if not any(name in env for name in _ALLOCATOR_VARS):
        missing.append("XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 (JAX's 75% default leaves a smaller KV cache)")
    if not missing:
        return None
    return ("JAX's GPU backend started before jengine was imported, so jengine could not apply "
            + " or ".join(missing) + ". Import jengine before JAX touches a device, or set them yourself.")


if _jax_backend_started():  # too late to change what the backend was started with: say so instead
    import jax as _jax

    _message = _late_start_warning(_jax.default_backend())
    if _message:
        import logging

        logging.getLogger("jengine").warning(_message)
else:
    _default_xla_flags()
    _default_memory_fraction()

_LAZY = {
    "LLM": "jengine.llm",
    "SamplingParams": "jengine.sampling_params",
    "RequestOutputKind": "jengine.sampling_params",
    "StructuredOutputsParams": "jengine.structured_output",
    "RequestOutput": "jengine.outputs",
    "CompletionOutput": "jengine.outputs",
    "Logprob": "jengine.logprobs",
    "FlatLogprobs": "jengine.logprobs",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jengine' has no attribute {name!r}")
