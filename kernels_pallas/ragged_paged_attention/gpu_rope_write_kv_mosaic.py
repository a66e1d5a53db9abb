"""A step's new Q/K/V on Hopper GPUs, in one Pallas Mosaic GPU kernel: split into heads, RoPE on Q and K,
K and V written into the paged cache (the contract of `reference.rope_and_write_kv`).

One program (one warpgroup) per (block of `block_t` tokens, block of `block_h` kv heads). It copies its
tokens' Q, K and V columns of the fused QKV projection (viewed `[T, heads, D]`) and their RoPE tables into
shared memory with three bulk (TMA) copies, rotates Q and K in registers (f32, each half rounded to qkv's
dtype: the reference's order), and writes back with bulk copies: the rotated queries as one
`[block_t, heads, D]` box, and per token its K and V rows (`[block_h, D]` each) into the token's cache slot,
in place (the cache is aliased to the output). A padding token (slot -1) writes no K/V.

The rotation pairs the two halves of each head. Mosaic GPU's strided register layout cannot broadcast a
`[tokens, D/2]` table across the heads of a `[tokens, heads, D/2]` block, so the tables come in already
repeated for `block_h` heads (`[2, T, block_h, D/2]`, built once per step by XLA and shared by every
layer) and Q is rotated `block_h` heads at a time.

This kernel replaces the Pallas Triton one (`gpu_rope_write_kv.py`, whose backend JAX has deprecated) on
Hopper; timings are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .reference import is_fp8, to_cache_dtype

WARPGROUP = 128  # threads per program


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    block_t: int  # tokens per program
    block_h: int  # kv heads per program (with their Q heads)

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RopeConfig: `{name}` must be a positive int, got {value!r}")


def _vec(config: RopeConfig, head_dim: int) -> int:
    """Elements per register of the strided layout the rotation uses, 0 where the block cannot be laid
    out across a warpgroup (an 8-bit cache converts pairs, so it needs 2)."""
    n = config.block_t * config.block_h * head_dim // 2
    return 2 if n % (2 * WARPGROUP) == 0 else 1 if n % WARPGROUP == 0 else 0


def default_config(num_tokens: int, num_kv_heads: int, head_dim: int, kv_dtype=None) -> RopeConfig | None:
    """The block shape for a step (None: no shape fits). Small steps spread tokens over programs one token
    and a few kv heads each; large ones take several tokens and every kv head per program."""
    need = 2 if kv_dtype is not None and is_fp8(kv_dtype) else 1
    heads = [h for h in (2, 4, 8, 1, 16) if num_kv_heads % h == 0]
    tokens = (1, 2, 4, 8) if num_tokens <= 64 else (4, 8, 2, 1)
    if num_tokens > 64:
        heads = sorted(heads, reverse=True)
    for block_t in tokens:
        if num_tokens % block_t:
            continue
        for block_h in heads:
            config = RopeConfig(block_t, block_h)
            if _vec(config, head_dim) >= need:
                return config
    return None


def supports(num_tokens: int, num_kv_heads: int, head_dim: int, dtype, kv_dtype) -> bool:
    """16-bit activations, head rows of whole 16-byte copies, and some block shape that fits."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 16 == 0
            and head_dim * jnp.dtype(kv_dtype).itemsize % 16 == 0
            and default_config(num_tokens, num_kv_heads, head_dim, kv_dtype) is not None)


def _kernel(slots_ref, qkv_ref, tables_ref, *refs, group, num_q_heads, page_size, scaled, vec, num_kv_heads):
    if scaled:
        scales_ref, cache_ref, q_ref, xq, xk, xv, tab, q_out, kv_out, bar = refs
        k_scale, v_scale = scales_ref[0], scales_ref[1]
    else:
        cache_ref, q_ref, xq, xk, xv, tab, q_out, kv_out, bar = refs
    block_t, block_h, head_dim = xk.shape
    half, dtype, f32 = head_dim // 2, xq.dtype, jnp.float32
    ti, hi = jax.lax.axis_index("token"), jax.lax.axis_index("head")
    t0, kv0 = ti * block_t, hi * block_h
    tokens = pl.ds(t0, block_t)
    plgpu.copy_gmem_to_smem(qkv_ref.at[tokens, pl.ds(kv0 * group, block_h * group)], xq, bar)
    plgpu.copy_gmem_to_smem(qkv_ref.at[tokens, pl.ds(num_q_heads + kv0, block_h)], xk, bar)
    plgpu.copy_gmem_to_smem(qkv_ref.at[tokens, pl.ds(num_q_heads + num_kv_heads + kv0, block_h)], xv, bar)
    plgpu.copy_gmem_to_smem(tables_ref.at[:, tokens], tab, bar)
    # The slots are read while the copies fly.
    slots = [slots_ref[t0 + j] for j in range(block_t)]
    plgpu.barrier_wait(bar)

    layout = plgpu.Layout.WG_STRIDED((block_t, block_h, half), vec_size=vec)
    cos, sin = plgpu.load(tab.at[0], layout=layout), plgpu.load(tab.at[1], layout=layout)

    def rotate(src, dst, h0, finish):
        """Heads [h0, h0 + block_h) of `src`, rotated, through `finish` into the same heads of `dst`."""
        heads = pl.ds(h0, block_h)
        x1 = plgpu.load(src.at[:, heads, pl.ds(0, half)], layout=layout).astype(f32)
        x2 = plgpu.load(src.at[:, heads, pl.ds(half, half)], layout=layout).astype(f32)
        dst[:, heads, pl.ds(0, half)] = finish((x1 * cos - x2 * sin).astype(dtype))
        dst[:, heads, pl.ds(half, half)] = finish((x2 * cos + x1 * sin).astype(dtype))

    q_finish = (lambda x: (x.astype(f32) * k_scale).astype(dtype)) if scaled else (lambda x: x)
    for h0 in range(0, block_h * group, block_h):
        rotate(xq, q_out, h0, q_finish)
    k_finish = (lambda x: to_cache_dtype((x.astype(f32) / k_scale).astype(dtype), kv_out.dtype)) if scaled else (
        lambda x: to_cache_dtype(x, kv_out.dtype))
    rotate(xk, kv_out.at[0], 0, k_finish)
    v = plgpu.load(xv, layout=plgpu.Layout.WG_STRIDED((block_t, block_h, head_dim), vec_size=vec))
    if scaled:
        v = (v.astype(f32) / v_scale).astype(dtype)
    kv_out[1] = to_cache_dtype(v, kv_out.dtype)
    plgpu.commit_smem()

    plgpu.copy_smem_to_gmem(q_out, q_ref.at[tokens, pl.ds(kv0 * group, block_h * group)])
    for j, slot in enumerate(slots):
        @pl.when(slot >= 0)
        def _(j=j, slot=slot):
            for which in range(2):
                plgpu.copy_smem_to_gmem(kv_out.at[which, j],
                                        cache_ref.at[which, pl.ds(kv0, block_h), slot // page_size, slot % page_size])
    plgpu.wait_smem_to_gmem(0)


def rope_and_write_kv_mosaic(kv_cache: jax.Array, qkv: jax.Array, cos: jax.Array, sin: jax.Array,
                             slot_mapping: jax.Array, num_q_heads: int, kv_scales: jax.Array | None = None, *,
                             config: RopeConfig | None = None, interpret: bool = False):
    """Same contract as `reference.rope_and_write_kv`: returns (q `[T, Hq, D]`, the cache)."""
    num_tokens = qkv.shape[0]
    _, num_kv_heads, _, page_size, head_dim = kv_cache.shape
    group, half = num_q_heads // num_kv_heads, head_dim // 2
    need = 2 if is_fp8(kv_cache.dtype) else 1
    config = config or default_config(num_tokens, num_kv_heads, head_dim, kv_cache.dtype)
    if (not isinstance(config, RopeConfig) or num_tokens % config.block_t or num_kv_heads % config.block_h
            or _vec(config, head_dim) < need):
        raise ValueError(f"rope_and_write_kv: `config` {config!r} does not fit {num_tokens} tokens and {num_kv_heads} "
                         f"kv heads of size {head_dim} (block_t * block_h * head_dim / 2 must be a multiple of "
                         f"{need * WARPGROUP})")
    block_t, block_h = config.block_t, config.block_h
    # [2, T, block_h, D/2]: the tables repeated for block_h heads (XLA builds this once per step).
    tables = jnp.broadcast_to(jnp.stack([cos, sin])[:, :, None, :], (2, num_tokens, block_h, half))
    scaled = kv_scales is not None
    heads = qkv.reshape(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim)
    scratch = [plgpu.SMEM((block_t, block_h * group, head_dim), qkv.dtype),
               plgpu.SMEM((block_t, block_h, head_dim), qkv.dtype),
               plgpu.SMEM((block_t, block_h, head_dim), qkv.dtype),
               plgpu.SMEM((2, block_t, block_h, half), jnp.float32),
               plgpu.SMEM((block_t, block_h * group, head_dim), qkv.dtype),
               plgpu.SMEM((2, block_t, block_h, head_dim), kv_cache.dtype),
               plgpu.Barrier(num_arrivals=4)]
    # The cache enters as a mutable reference, so the kernel writes its slots in place.
    cache = jax.new_ref(kv_cache)
    q = plgpu.kernel(
        functools.partial(_kernel, group=group, num_q_heads=num_q_heads, page_size=page_size, scaled=scaled,
                          vec=_vec(config, head_dim), num_kv_heads=num_kv_heads),
        out_type=jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), qkv.dtype), scratch_types=scratch,
        grid=(num_tokens // block_t, num_kv_heads // block_h), grid_names=("token", "head"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(slot_mapping, heads, tables, *((kv_scales,) if scaled else ()), cache)
    return q, jax.freeze(cache)
