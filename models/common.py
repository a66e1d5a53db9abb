"""Pieces shared by model families: the model input pytree, weight declarations, norms and RoPE."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jengine.config import RopeConfig
from jengine.quantization import fp8_linear, input_scale_name, scale_name


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelInput:
    """A ragged batch of T token slots from S sequence rows (both padded to buckets).

    Padding tokens have slot_mapping -1; padding sequence rows lie beyond `num_seqs`.
    """

    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32, absolute position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32, cache slot the token's K/V is written to (-1: padding)
    cu_q_lens: jax.Array  # [S + 1] int32, start of each sequence's tokens in the batch
    kv_lens: jax.Array  # [S] int32, KV length of each sequence after this step
    page_indices: jax.Array  # [S, pages_per_seq] int32
    num_seqs: jax.Array  # [1] int32


# A layer's scales for an 8-bit KV cache, from a checkpoint that has them (`jengine.loader`): f32 `[2]`, K's and V's.
# The cache then holds k / k_scale and v / v_scale, and attention reads q * k_scale and multiplies its output by
# v_scale, so the scores and outputs are unchanged but for the 8-bit rounding, which the scales keep in range.
KV_CACHE_SCALES = "kv_cache_scales"


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One parameter: its shape, logical axes (for sharding) and where it comes from in an HF checkpoint.

    `sources` are (HF tensor name, HF shape) pairs, concatenated along the output axis when there are
    several (fused QKV, fused gate/up). HF linear weights are stored `[out, in]`; `transpose` makes
    them `[in, out]` so the model computes `x @ w`.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    sources: tuple[tuple[str, tuple[int, ...]], ...]
    transpose: bool = True
    init: str = "normal"  # "normal" | "ones" | "zeros" for dummy weights


def linear(x: jax.Array, params: dict, name: str) -> jax.Array:
    """`x @ params[name]`, or for a quantized weight (`jengine.quantization`) its 8-bit product."""
    w = params[name]
    scale = params.get(scale_name(name))
    if scale is None:
        return x @ w
    return fp8_linear(x, w, scale, params.get(input_scale_name(name)))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in f32 as transformers does, result in x's dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies `[D/2]` and the cos/sin scale for a RoPE variant (computed on the host)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    scale = 1.0
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv_freq, scale = _yarn(rope, head_dim)
    return inv_freq.astype(np.float32), scale


def _yarn(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    base, factor, max_pos = rope.theta, rope.factor, rope.original_max_position_embeddings

    def correction_dim(rotations):
        return head_dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    scale = rope.attention_factor
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, scale
