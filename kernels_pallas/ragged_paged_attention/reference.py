"""Pure-jnp definition of ragged paged attention and of the KV-cache layout.

This module *defines* the op that every kernel in this package must reproduce. It favours being
obviously right over being fast: every query token gathers its sequence's whole page list.

KV cache layout, one array per layer: `[2, num_kv_heads, num_pages, page_size, head_dim]`
(index 0 = K, 1 = V). A page of one head is a contiguous `[page_size, head_dim]` tile, which is what
a GPU program that owns one (sequence, kv-head) pair streams from HBM.

Cache dtype: the model's dtype, or an 8-bit float (`FP8_DTYPES`, vLLM's `kv_cache_dtype="fp8"`) that
halves the cache's bytes. New K/V are written saturated to the 8-bit type's finite range with no
scale (vLLM's default scale of 1.0); attention reads them back in the query's dtype.

Slots: token slot `s` lives in page `s // page_size` at offset `s % page_size`. A slot of -1 marks a
padding token whose K/V must not be written anywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def saturate(x: jax.Array, dtype) -> jax.Array:
    """x in `dtype`, clipped first to that type's finite range where it is narrower than x's: K/V into an 8-bit
    cache (a plain cast would turn values past the range into NaN in e4m3fn, which has no infinity), and bf16
    queries into float16 for the Hopper kernel over an 8-bit cache (into infinities)."""
    top = float(jnp.finfo(dtype).max)
    if top < float(jnp.finfo(x.dtype).max):
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's KV cache array."""
    return (2, num_kv_heads, num_pages, page_size, head_dim)


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new K/V `[T, Hkv, D]` into their slots `[T]`; slot -1 (padding) writes nothing."""
    _, _, num_pages, page_size, _ = kv_cache.shape
    oob = num_pages * page_size
    slots = jnp.where(slot_mapping < 0, oob, slot_mapping)
    page, offset = slots // page_size, slots % page_size
    kv = saturate(jnp.stack([k, v]), kv_cache.dtype)  # [2, T, Hkv, D]
    kv = jnp.swapaxes(kv, 1, 2)  # [2, Hkv, T, D]
    return kv_cache.at[:, :, page, offset].set(kv, mode="drop")


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on `[T, H, D]` with tables `[T, D/2]` (the transformers layout), computed in f32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def split_heads(qkv: jax.Array, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """A step's fused projections `[T, (Hq + 2 Hkv) D]` (Q, then K, then V columns) as q, k, v `[T, H, D]`."""
    num_tokens = qkv.shape[0]
    k0, v0 = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    return (qkv[:, :k0].reshape(num_tokens, num_q_heads, head_dim),
            qkv[:, k0:v0].reshape(num_tokens, num_kv_heads, head_dim),
            qkv[:, v0:].reshape(num_tokens, num_kv_heads, head_dim))


def rope_and_write_kv(kv_cache: jax.Array, qkv: jax.Array, cos: jax.Array, sin: jax.Array,
                      slot_mapping: jax.Array, num_q_heads: int, kv_scales: jax.Array | None = None, q_dtype=None):
    """Split `qkv` into heads, rotate Q and K (RoPE), write K and V into their slots; returns (q, cache).

    With `kv_scales` (f32 `[2]`, K's and V's, for an 8-bit cache) the cache gets k / k_scale and
    v / v_scale and q comes back multiplied by k_scale, each rounded to qkv's dtype first (the order
    every implementation follows, so that they agree bit for bit). `q_dtype`: q is returned in it (after
    that rounding, `saturate`d), else in qkv's dtype."""
    q, k, v = split_heads(qkv, num_q_heads, kv_cache.shape[1], kv_cache.shape[4])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if kv_scales is not None:
        q = (q * kv_scales[0]).astype(qkv.dtype)
        k, v = (k / kv_scales[0]).astype(qkv.dtype), (v / kv_scales[1]).astype(qkv.dtype)
    if q_dtype is not None:
        q = saturate(q, q_dtype)
    return q, write_kv(kv_cache, k, v, slot_mapping)


def token_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int):
    """Per query token: its sequence index `[T]`, its absolute position `[T]`, and whether it is real."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    real = t < cu_q_lens[num_seqs[0]]
    seq = jnp.where(real, jnp.minimum(seq, kv_lens.shape[0] - 1), 0)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, real


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [2, Hkv, num_pages, page_size, D]
    kv_lens: jax.Array,  # [S] int32, total KV length of each sequence (new tokens included)
    page_indices: jax.Array,  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S + 1] int32, query span of each sequence
    num_seqs: jax.Array,  # [1] int32, how many of the S rows are real
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out_dtype=None,
) -> jax.Array:
    """Causal attention of each query token over its own sequence's cached K/V. Returns `[T, Hq, D]` in
    `out_dtype` (default q's), rounded once from f32.

    Token j of a sequence with q_len queries and kv_len keys sits at position kv_len - q_len + j and
    sees keys at positions p with p <= pos (and pos - p < sliding_window when a window is given).
    Padding tokens (beyond cu_q_lens[num_seqs]) produce zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    seq, pos, real = token_positions(cu_q_lens, kv_lens, num_seqs, num_tokens)

    pages = page_indices[seq]  # [T, P]
    k = kv_cache[0][:, pages]  # [Hkv, T, P, ps, D]
    v = kv_cache[1][:, pages]
    max_len = pages.shape[1] * page_size
    k = k.reshape(num_kv_heads, num_tokens, max_len, head_dim).astype(jnp.float32)
    v = v.reshape(num_kv_heads, num_tokens, max_len, head_dim).astype(jnp.float32)

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    s = jnp.einsum("tkgd,ktld->tkgl", qg, k) * sm_scale  # [T, Hkv, G, L]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = jnp.arange(max_len, dtype=jnp.int32)[None, :]
    visible = (key_pos <= pos[:, None]) & (key_pos < kv_lens[seq][:, None])
    if sliding_window is not None:
        visible &= pos[:, None] - key_pos < sliding_window
    visible &= real[:, None]
    s = jnp.where(visible[:, None, None, :], s, MASK_VALUE)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True))
    p = jnp.where(visible[:, None, None, :], p, 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    v = jnp.where(visible[None, :, :, None], v, 0.0)  # unused slots may hold garbage (even NaN)
    out = jnp.einsum("tkgl,ktld->tkgd", p / jnp.where(denom == 0, 1.0, denom), v)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(out_dtype or q.dtype)
