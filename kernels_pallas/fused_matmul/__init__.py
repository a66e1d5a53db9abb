"""Fused small-batch matmuls: `norm_matmul` (RMS norm, matmul, optional SwiGLU) and `matmul_add`
(matmul plus residual), the four matmuls of a decoder layer with their neighbours.

These functions are the one place that chooses an implementation: the Pallas GPU kernel for decode-sized
row counts on GPUs (at most `MAX_ROWS` rows, shapes the tile divides), the pure-jnp reference otherwise
(prefill buckets, where the matmuls are compute-bound and XLA's own are the ones to use; CPUs; TPUs).
`impl=` overrides the choice and `interpret=True` runs the kernel in interpret mode (tests on CPU).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from . import reference
from .reference import rms_norm, swiglu

__all__ = ["IMPLS", "MAX_ROWS", "matmul_add", "norm_matmul", "rms_norm", "swiglu"]

IMPLS = ("gpu", "reference")
# Token rows up to which GPUs use the kernel: decode steps of up to 32 tokens, where the matmuls are
# weight-bandwidth bound and XLA's separate norm / split-K reduction / SwiGLU kernels cost ~15 us a layer.
MAX_ROWS = 32


def _check(ok: bool, op: str, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{op}: `{name}` {message}")


def _validate(op, x, w, *, norm_w=None, eps=None, swiglu_out=False, residual=None) -> None:
    _check(x.ndim == 2, op, "x", f"must be [M, K], got shape {x.shape}")
    _check(w.ndim == 2 and w.shape[0] == x.shape[1], op, "w",
           f"must be [K={x.shape[1]}, N], got shape {w.shape}")
    _check(jnp.issubdtype(x.dtype, jnp.floating), op, "x", f"must be floating point, got {x.dtype}")
    _check(w.dtype == x.dtype, op, "w", f"dtype {w.dtype} must match x's {x.dtype}")
    if norm_w is not None:
        _check(norm_w.shape == (x.shape[1],), op, "norm_w", f"must be [K={x.shape[1]}], got shape {norm_w.shape}")
        _check(isinstance(eps, numbers.Real) and not isinstance(eps, bool) and eps > 0, op, "eps",
               f"must be a positive float, got {eps!r}")
    if swiglu_out:
        _check(w.shape[1] % 2 == 0, op, "w", f"needs an even number of columns for gate|up, got {w.shape[1]}")
    if residual is not None:
        _check(residual.shape == (x.shape[0], w.shape[1]), op, "residual",
               f"must be [M, N]={(x.shape[0], w.shape[1])}, got shape {residual.shape}")
        _check(residual.dtype == x.dtype, op, "residual", f"dtype {residual.dtype} must match x's {x.dtype}")


def _pick(op, impl, kind, x, n_out, config, norm_w=None):
    """The implementation to run and, for "gpu", its tile."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"{op}: `impl` must be one of {IMPLS} or None, got {impl!r}")
    if impl == "reference":
        return "reference", None
    from . import gpu

    m, k = x.shape
    config = config or gpu.tuned_config(kind, k, n_out)
    ok = gpu.fits(config, m, k, n_out) and (norm_w is None or norm_w.dtype == x.dtype)
    if impl is None:
        on_gpu = jax.default_backend() in ("gpu", "cuda")
        return ("gpu", config) if on_gpu and m <= MAX_ROWS and ok else ("reference", None)
    _check(ok, op, "x", f"shape {x.shape} with {n_out} output columns does not fit the GPU tile {config}")
    return "gpu", config


def norm_matmul(x: jax.Array, norm_w: jax.Array, w: jax.Array, *, eps: float, swiglu_out: bool = False,
                impl: str | None = None, interpret: bool = False, config=None) -> jax.Array:
    """rms_norm(x, norm_w, eps) @ w: `[M, K] -> [M, N]`; `swiglu_out`: SiLU(gate) * up `[M, N/2]` of a
    fused `[K, gate | up]` weight."""
    _validate("norm_matmul", x, w, norm_w=norm_w, eps=eps, swiglu_out=swiglu_out)
    n_out = w.shape[1] // 2 if swiglu_out else w.shape[1]
    impl, config = _pick("norm_matmul", impl, "swiglu" if swiglu_out else "norm", x, n_out, config, norm_w)
    if impl == "reference":
        return reference.norm_matmul(x, norm_w, w, eps=eps, swiglu_out=swiglu_out)
    from .gpu import fused_matmul_gpu

    return fused_matmul_gpu(x, w, norm_w=norm_w, eps=eps, swiglu=swiglu_out, config=config, interpret=interpret)


def matmul_add(x: jax.Array, w: jax.Array, residual: jax.Array, *, impl: str | None = None,
               interpret: bool = False, config=None) -> jax.Array:
    """residual + x @ w: `[M, K] x [K, N] + [M, N] -> [M, N]`."""
    _validate("matmul_add", x, w, residual=residual)
    impl, config = _pick("matmul_add", impl, "add", x, w.shape[1], config)
    if impl == "reference":
        return reference.matmul_add(x, w, residual)
    from .gpu import fused_matmul_gpu

    return fused_matmul_gpu(x, w, residual=residual, config=config, interpret=interpret)
