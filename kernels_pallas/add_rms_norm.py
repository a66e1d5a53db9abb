"""The residual add and the next RMSNorm as one kernel: `y = x + delta` and `rms_norm(y) * weight`.

In the 8B decode step at batch 1 (an 8-token bucket) XLA runs the residual add after each O and down
GEMM as one kernel and the RMSNorm that reads its result as another, each ~1.7 µs of mostly launch
latency on an H200 (benchmarks/RESULTS.md, session 41); here one kernel writes both. Buckets whose GEMMs
go through cuBLAS (`jengine.runner.CUBLAS_GEMM_MIN_TOKENS`) get the add in the GEMM's epilogue, so the
model uses this only for small steps (`use_kernel`).

Pallas, Triton lowering: one program per token row, the whole row in registers (padded to a power of
two and masked). The arithmetic is the model's (`reference`): the add rounded to x's dtype, the mean
of squares in f32, the normalized row rounded before the weight multiplies it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Steps of at most this many token rows use the kernel on GPUs; larger ones keep XLA's fusions (and from
# jengine.runner.CUBLAS_GEMM_MIN_TOKENS on, the add inside cuBLAS's epilogue).
MAX_TOKENS = 32
_MAX_WIDTH = 16384  # widest row held in one program's registers


def reference(x: jax.Array, delta: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """`(x + delta, rms_norm(x + delta) * weight)`, as `models.common.rms_norm` computes the norm."""
    y = x + delta
    yf = y.astype(jnp.float32)
    normed = yf * jax.lax.rsqrt(jnp.mean(yf * yf, axis=-1, keepdims=True) + eps)
    return y, weight * normed.astype(y.dtype)


def use_kernel(x: jax.Array, tp: int) -> bool:
    """Whether the model adds and normalizes `x [T, H]` with the kernel: small steps on one GPU."""
    return (jax.default_backend() == "gpu" and tp == 1 and x.ndim == 2 and x.shape[0] <= MAX_TOKENS
            and x.shape[1] <= _MAX_WIDTH)


def _kernel(x_ref, delta_ref, weight_ref, y_ref, normed_ref, *, width, eps):
    row = pl.program_id(0)
    cols = jnp.arange(_padded(width))  # [W'] the row, padded to a power of two (Triton's tile sizes)
    mask = cols < width
    x = pltriton.load(x_ref.at[row, cols], mask=mask, other=0)
    delta = pltriton.load(delta_ref.at[row, cols], mask=mask, other=0)
    weight = pltriton.load(weight_ref.at[cols], mask=mask, other=0)
    y = (x.astype(jnp.float32) + delta.astype(jnp.float32)).astype(y_ref.dtype)
    yf = jnp.where(mask, y.astype(jnp.float32), 0.0)
    inv = jax.lax.rsqrt(jnp.sum(yf * yf) / width + eps)
    normed = (yf * inv).astype(y_ref.dtype)
    out = (weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(normed_ref.dtype)
    pltriton.store(y_ref.at[row, cols], y, mask=mask)
    pltriton.store(normed_ref.at[row, cols], out, mask=mask)


def _padded(width: int) -> int:
    return 1 << (width - 1).bit_length()


def add_rms_norm(x: jax.Array, delta: jax.Array, weight: jax.Array, eps: float, *,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Same contract as `reference` for `x, delta [T, H]` and `weight [H]` (16- or 32-bit floats)."""
    if x.ndim != 2 or delta.shape != x.shape or weight.shape != x.shape[1:]:
        raise ValueError(f"add_rms_norm: `x` and `delta` must be [T, H] and `weight` [H], got {x.shape}, "
                         f"{delta.shape} and {weight.shape}")
    num_tokens, width = x.shape
    return pl.pallas_call(
        functools.partial(_kernel, width=width, eps=float(eps)),
        grid=(num_tokens,),
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, jnp.result_type(x, weight))),
        compiler_params=pltriton.CompilerParams(num_warps=4 if width <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(x, delta, weight)
