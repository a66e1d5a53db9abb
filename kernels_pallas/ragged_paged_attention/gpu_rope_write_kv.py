"""A step's new Q/K/V on NVIDIA GPUs, in one Pallas (Triton lowering) kernel: split into heads, RoPE on Q and K,
K and V written into the paged cache.

One program per (token, kv head) reads that head's columns of the fused QKV projection, rotates its
`group` query heads and its key head, writes the rotated queries to the output (in `q_dtype` if asked: float16
for the Hopper attention over an 8-bit cache) and the key and value rows to the token's cache slot, in place
(the cache is aliased to the output); padding tokens (slot -1) write no K/V. On an H200 (8B shape,
benchmarks/RESULTS.md sessions 42 and 44) it takes 1.4 µs a layer at batch 1 and 1.8 µs at 64 tokens, where XLA's
Q-RoPE fusion plus its K-RoPE + scatter fusion took 4.3 and 4.8 µs (at batch 1 XLA had folded the QKV GEMM's
split-K reduction into those two; it is now a 1.4 µs kernel of its own). In the throughput run's 2048-token mixed
step (8-bit cache) it takes 11.8 µs a layer, where XLA's ops took 22.0 + 8.9 µs. Timed alone, XLA's ops look faster
than this kernel at every size (1.1-7.0 µs against 1.5-14.0): don't choose between them that way. JAX has deprecated
the Triton lowering; a Mosaic GPU port (commit c33d26e, not kept) was correct but about 2x slower alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .reference import saturate


def supports(head_dim: int) -> bool:
    """Triton tiles need power-of-two rows (half a head for the rotation); other head sizes keep XLA's ops."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def _kernel(slots_ref, qkv_ref, cos_ref, sin_ref, *refs, group, num_q_heads, page_size, scaled):
    if scaled:
        scales_ref, _cache_in_ref, q_ref, cache_ref = refs
        k_scale, v_scale = scales_ref[0], scales_ref[1]
    else:
        _cache_in_ref, q_ref, cache_ref = refs
    t, h = pl.program_id(0), pl.program_id(1)
    num_kv_heads, head_dim = cache_ref.shape[1], cache_ref.shape[4]
    half, dtype = head_dim // 2, qkv_ref.dtype
    cos, sin = cos_ref[t, :], sin_ref[t, :]
    # Every load is issued before the first store, so that they are all in flight at once (a store may
    # alias a later load as far as the compiler knows, which would otherwise serialise them).
    heads = [h * group + g for g in range(group)] + [num_q_heads + h]  # this program's Q heads, then its K head
    halves = [(qkv_ref[t, pl.ds(head * head_dim, half)], qkv_ref[t, pl.ds(head * head_dim + half, half)])
              for head in heads]
    v = qkv_ref[t, pl.ds((num_q_heads + num_kv_heads + h) * head_dim, head_dim)]
    slot = slots_ref[t]
    rotated = []
    for x1, x2 in halves:  # RoPE in f32, each half rounded to qkv's dtype (the reference's order)
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        rotated.append(((x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)))

    for head, parts in zip(heads[:-1], rotated[:-1]):
        for i, part in enumerate(parts):
            if scaled:
                part = (part.astype(jnp.float32) * k_scale).astype(dtype)
            q_ref[t, head, pl.ds(i * half, half)] = saturate(part, q_ref.dtype)

    @pl.when(slot >= 0)
    def _():
        page, offset = slot // page_size, slot % page_size
        for i, part in enumerate(rotated[-1]):
            if scaled:
                part = (part.astype(jnp.float32) / k_scale).astype(dtype)
            cache_ref[0, h, page, offset, pl.ds(i * half, half)] = saturate(part, cache_ref.dtype)
        value = (v.astype(jnp.float32) / v_scale).astype(dtype) if scaled else v
        cache_ref[1, h, page, offset, :] = saturate(value, cache_ref.dtype)


def rope_and_write_kv_gpu(kv_cache: jax.Array, qkv: jax.Array, cos: jax.Array, sin: jax.Array,
                          slot_mapping: jax.Array, num_q_heads: int, kv_scales: jax.Array | None = None,
                          q_dtype=None, *, interpret: bool = False):
    """Same contract as `reference.rope_and_write_kv`: returns (q `[T, Hq, D]`, the cache)."""
    num_tokens = qkv.shape[0]
    _, num_kv_heads, _, page_size, head_dim = kv_cache.shape
    scaled = kv_scales is not None
    inputs = (slot_mapping, qkv, cos, sin) + ((kv_scales,) if scaled else ()) + (kv_cache,)
    return pl.pallas_call(
        functools.partial(_kernel, group=num_q_heads // num_kv_heads, num_q_heads=num_q_heads,
                          page_size=page_size, scaled=scaled),
        grid=(num_tokens, num_kv_heads),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), q_dtype or qkv.dtype),
                   jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype)),
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="rope_and_write_kv",
    )(*inputs)
