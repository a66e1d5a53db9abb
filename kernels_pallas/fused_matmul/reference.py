"""Pure-jnp reference for the fused small-batch matmuls: exactly the unfused model math.

`rms_norm` lives here (the models import it) so that the reference and the model share one formula.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in f32 as transformers does, result in x's dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def swiglu(y: jax.Array) -> jax.Array:
    """`[M, 2N]` fused gate|up projection -> SiLU(gate) * up `[M, N]`."""
    n = y.shape[-1] // 2
    return jax.nn.silu(y[..., :n]) * y[..., n:]


def norm_matmul(x, norm_w, w, *, eps: float, swiglu_out: bool = False):
    """rms_norm(x) @ w, `[M, K] x [K, N] -> [M, N]`; with `swiglu_out`, SiLU(gate) * up `[M, N/2]`."""
    y = rms_norm(x, norm_w, eps) @ w
    return swiglu(y) if swiglu_out else y


def matmul_add(x, w, residual):
    """residual + x @ w, `[M, K] x [K, N] + [M, N]`."""
    return residual + x @ w
