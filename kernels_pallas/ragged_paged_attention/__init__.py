"""Ragged paged attention: one op for decode, prefill and mixed batches.

`ragged_paged_attention` is the one place that chooses an implementation: the Pallas GPU kernels on
GPUs (the Mosaic GPU kernel in `gpu_mosaic.py` on Hopper where it supports the shapes, else the Triton
kernel in `gpu.py`), the Pallas TPU kernel on TPUs, the pure-jnp reference elsewhere (CPU). `impl=`
overrides the choice and `interpret=True` runs a Pallas kernel in interpret mode (tests on CPU).
`rope_and_write_kv` (Q/K/V split, RoPE, K/V into the cache) chooses the same way. Where JAX no longer has the
Triton lowering (deprecated), the Triton kernels' work falls to XLA's ops (`triton_lowering`).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from . import reference
from .reference import FP8_DTYPES, is_fp8, kv_cache_shape

__all__ = ["FP8_DTYPES", "is_fp8", "kv_cache_shape", "ragged_paged_attention", "rope_and_write_kv", "attention_q_dtype",
           "IMPLS"]

IMPLS = ("gpu", "tpu", "reference")
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _default_impl() -> str:
    backend = jax.default_backend()
    return {"gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}.get(backend, "reference")


def triton_lowering() -> bool:
    """Whether this JAX still has Pallas's Triton lowering, which it has deprecated. Where it is gone, what the
    Triton kernels (`gpu.py`, `gpu_rope_write_kv.py`) did on GPUs falls to XLA's ops; Hopper keeps its Mosaic GPU
    attention, which does not depend on them."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _float_dtype_or_none(x) -> bool:
    """Whether `x` is None or names float32, bfloat16 or float16 (anything else, unreadable names included: False)."""
    if x is None:
        return True
    try:
        return any(jnp.dtype(x) == d for d in _FLOAT_DTYPES)
    except TypeError:
        return False


def _check(ok: bool, name: str, message: str, op: str = "ragged_paged_attention") -> None:
    if not ok:
        raise ValueError(f"{op}: `{name}` {message}")


def validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window,
                    soft_cap) -> None:
    """Static checks (shapes, dtypes, options); raises ValueError naming the offending argument."""
    _check(q.ndim == 3, "q", f"must be [T, Hq, D], got shape {q.shape}")
    _check(kv_cache.ndim == 5 and kv_cache.shape[0] == 2, "kv_cache",
           f"must be [2, Hkv, num_pages, page_size, D], got shape {kv_cache.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, kv_dim = kv_cache.shape
    _check(any(q.dtype == d for d in _FLOAT_DTYPES), "q", f"must be float32/bfloat16/float16, got {q.dtype}")
    _check(kv_cache.dtype == q.dtype or is_fp8(kv_cache.dtype), "kv_cache",
           f"dtype {kv_cache.dtype} must match q's {q.dtype} or be an 8-bit float (float8_e4m3fn, float8_e5m2)")
    _check(kv_dim == head_dim, "kv_cache", f"head_dim {kv_dim} must match q's head_dim {head_dim}")
    _check(num_kv_heads > 0 and num_q_heads % num_kv_heads == 0, "q",
           f"has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads")
    _check(page_indices.ndim == 2, "page_indices", f"must be [S, pages_per_seq], got shape {page_indices.shape}")
    num_seqs_max = page_indices.shape[0]
    _check(kv_lens.shape == (num_seqs_max,), "kv_lens", f"must be [S={num_seqs_max}], got shape {kv_lens.shape}")
    _check(cu_q_lens.shape == (num_seqs_max + 1,), "cu_q_lens",
           f"must be [S + 1={num_seqs_max + 1}], got shape {cu_q_lens.shape}")
    _check(num_seqs.shape == (1,), "num_seqs", f"must be [1], got shape {num_seqs.shape}")
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("num_seqs", num_seqs)):
        _check(x.dtype == jnp.int32, name, f"must be int32, got {x.dtype}")
    _check(num_tokens > 0 and num_seqs_max > 0, "q", "needs at least one token row and one sequence row")
    _check(page_size > 0 and page_size & (page_size - 1) == 0, "kv_cache",
           f"page_size {page_size} must be a power of two")
    # Static Python (or numpy) numbers only: they shape the compiled kernel.
    def real(x):
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    _check(real(sm_scale) and sm_scale > 0, "sm_scale", f"must be a positive float, got {sm_scale!r}")
    _check(sliding_window is None or (isinstance(sliding_window, numbers.Integral) and sliding_window > 0),
           "sliding_window", f"must be None or a positive int, got {sliding_window!r}")
    _check(soft_cap is None or (real(soft_cap) and soft_cap > 0), "soft_cap",
           f"must be None or a positive float, got {soft_cap!r}")


def _mosaic(q, kv_cache, config, interpret) -> bool:
    """GPU: whether the Mosaic GPU kernel runs (else the Triton kernel). A `MosaicConfig` asks for it;
    with the table (config None) it runs on Hopper wherever it supports the shapes."""
    from . import gpu_mosaic

    if isinstance(config, gpu_mosaic.MosaicConfig):
        return True
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = kv_cache.shape
    return (config is None and not interpret and gpu_mosaic.on_hopper()
            and gpu_mosaic.supports(q.dtype, head_dim, num_q_heads // num_kv_heads, page_size,
                                    kv_dtype=kv_cache.dtype))


def attention_q_dtype(dtype, kv_cache: jax.Array, num_q_heads: int, impl: str | None = None):
    """The dtype in which `ragged_paged_attention` reads queries of `dtype` as they are: float16 where the Hopper
    kernel multiplies an 8-bit cache's blocks in f16 (bf16 queries would take a conversion pass of their own), else
    `dtype`. `rope_and_write_kv(q_dtype=...)` writes Q in it."""
    _, num_kv_heads, _, page_size, head_dim = kv_cache.shape
    if ((_default_impl() if impl is None else impl) != "gpu" or not is_fp8(kv_cache.dtype)
            or jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16) or num_q_heads % num_kv_heads):
        return dtype
    from . import gpu_mosaic

    if gpu_mosaic.on_hopper() and gpu_mosaic.supports(dtype, head_dim, num_q_heads // num_kv_heads, page_size,
                                                      kv_dtype=kv_cache.dtype):
        return jnp.float16
    return dtype


def rope_and_write_kv(kv_cache: jax.Array, qkv: jax.Array, cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array,
                      *, num_q_heads: int, kv_scales: jax.Array | None = None, q_dtype=None, impl: str | None = None,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """A step's fused projections `qkv` `[T, (Hq + 2 Hkv) D]` (Q, K, V columns) split into heads, Q and K
    rotated by the RoPE tables `cos`/`sin` `[T, D/2]`, K and V written into their cache slots `[T]` (slot -1:
    padding, nothing written). Returns (q `[T, Hq, D]`, in `q_dtype` (saturated) if given, else qkv's; the cache).
    Contract: `reference.rope_and_write_kv`.

    impl None: the Pallas kernel in `gpu_rope_write_kv.py` on GPUs, XLA's ops (the reference) on TPUs and the CPU;
    impl="gpu" asks for the kernel (where it supports the head size)."""
    op = "rope_and_write_kv"
    _check(kv_cache.ndim == 5 and kv_cache.shape[0] == 2, "kv_cache",
           f"must be [2, Hkv, num_pages, page_size, D], got shape {kv_cache.shape}", op)
    _, num_kv_heads, _, _, head_dim = kv_cache.shape
    _check(isinstance(num_q_heads, int) and num_q_heads > 0 and num_q_heads % num_kv_heads == 0, "num_q_heads",
           f"must be a positive multiple of the cache's {num_kv_heads} kv heads, got {num_q_heads!r}", op)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    _check(qkv.ndim == 2 and qkv.shape[1] == width, "qkv",
           f"must be [T, (Hq + 2 Hkv) * D = {width}], got shape {qkv.shape}", op)
    num_tokens = qkv.shape[0]
    for name, table in (("cos", cos), ("sin", sin)):
        _check(table.shape == (num_tokens, head_dim // 2) and table.dtype == jnp.float32, name,
               f"must be float32 [T={num_tokens}, D/2={head_dim // 2}], got {table.dtype} {table.shape}", op)
    _check(slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == jnp.int32, "slot_mapping",
           f"must be int32 [T={num_tokens}], got {slot_mapping.dtype} {slot_mapping.shape}", op)
    _check(kv_scales is None or (kv_scales.shape == (2,) and kv_scales.dtype == jnp.float32), "kv_scales",
           f"must be None or float32 [2], got {getattr(kv_scales, 'dtype', None)} {getattr(kv_scales, 'shape', None)}",
           op)
    _check(_float_dtype_or_none(q_dtype), "q_dtype",
           f"must be None or float32/bfloat16/float16, got {q_dtype!r}", op)
    impl = _default_impl() if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"{op}: `impl` must be one of {IMPLS} or None, got {impl!r}")
    args = (kv_cache, qkv, cos, sin, slot_mapping, num_q_heads, kv_scales, q_dtype)
    if impl == "gpu" and triton_lowering():
        from . import gpu_rope_write_kv

        if gpu_rope_write_kv.supports(head_dim):
            return gpu_rope_write_kv.rope_and_write_kv_gpu(*args, interpret=interpret)
    return reference.rope_and_write_kv(*args)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [2, Hkv, num_pages, page_size, D]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str | None = None,
    interpret: bool = False,
    config=None,
    out_dtype=None,
) -> jax.Array:
    """Causal ragged paged attention (contract: `reference.ragged_paged_attention`). Returns `[T, Hq, D]` in
    `out_dtype` (default q's).

    impl: "gpu", "tpu" or "reference"; None picks by `jax.default_backend()`.
    interpret: run the chosen Pallas kernel in interpret mode (CPU tests).
    config: a tuning override for the chosen kernel (`gpu.GpuConfig` / `gpu_mosaic.MosaicConfig` /
    `tpu.TpuConfig`), else the table.
    """
    validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                    sliding_window=sliding_window, soft_cap=soft_cap)
    _check(_float_dtype_or_none(out_dtype), "out_dtype",
           f"must be None or float32/bfloat16/float16, got {out_dtype!r}")
    out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
    impl = _default_impl() if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"ragged_paged_attention: `impl` must be one of {IMPLS} or None, got {impl!r}")
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    args = (q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "reference":
        out = reference.ragged_paged_attention(*args, **kw, out_dtype=out_dtype)
    elif impl == "gpu":
        from . import gpu_mosaic

        if _mosaic(q, kv_cache, config, interpret):
            return gpu_mosaic.ragged_attention_mosaic(*args, **kw, config=config, out_dtype=out_dtype)
        if not triton_lowering():
            return reference.ragged_paged_attention(*args, **kw, out_dtype=out_dtype)
        from . import gpu

        out = gpu.ragged_paged_attention_gpu(*args, **kw, config=config, interpret=interpret)
    else:
        from .tpu import ragged_paged_attention_tpu

        out = ragged_paged_attention_tpu(*args, **kw, config=config, interpret=interpret)
    return out.astype(out_dtype)
