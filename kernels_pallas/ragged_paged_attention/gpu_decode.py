"""Decode attention for small decode buckets on NVIDIA GPUs: Pallas (Triton lowering), one program per
(query token, kv head, key split).

Where it runs: decode-shaped buckets (`gpu.is_decode_bucket`) with at most `NUM_SMS` (token, kv head) pairs,
e.g. the 8B model's 8- and 16-token buckets (batch 1-16). There the other kernels pay for their generality:
the Mosaic GPU kernel takes ~9 µs a layer at batch 1 whatever its key splits (H200, benchmarks/RESULTS.md
session 43), and the Triton query-block kernel (`gpu.py`) walks work items of several tokens.

A program reads its token's sequence and position (`reference.token_positions`, computed once per step in
jnp), then the page ids of its split's key blocks, then the blocks; each of its `group` query heads keeps its
own online softmax in f32 over the block (products on the CUDA cores: a one-token tile is far below the
tensor cores' 16-row minimum, and the work is a few thousand multiply-adds per block). Padding tokens see no
keys and write zeros. With key splits the programs write f32 partial results and base-2 log-sum-exps that
`gpu._merge_splits` combines (XLA fuses it into the next projection's GEMM).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .gpu import LOG2E, M_INIT, NUM_SMS, _merge_splits, is_decode_bucket, key_blocks
from .reference import token_positions


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    block_kv: int = 64  # keys per step: a multiple of page_size, a power of two
    num_kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DecodeConfig: `{name}` must be a positive int, got {value!r}")
        if self.block_kv & (self.block_kv - 1):
            raise ValueError(f"DecodeConfig: `block_kv` must be a power of two, got {self.block_kv!r}")


def applies(num_tokens: int, num_seqs_max: int, num_kv_heads: int) -> bool:
    """Whether the table sends a bucket here: decode-shaped, with at most one (token, kv head) pair per SM."""
    return is_decode_bucket(num_tokens, num_seqs_max) and num_tokens * num_kv_heads <= NUM_SMS


def supports(head_dim: int, page_size: int, block_kv: int = 64) -> bool:
    """Triton tiles need power-of-two sides; a key block is whole pages."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and block_kv % page_size == 0


def tuned_config(num_tokens: int, num_kv_heads: int, max_kv_len: int, page_size: int) -> DecodeConfig:
    """Key splits so that the programs fill the SMs about twice, but no split gets less than one block."""
    block_kv = max(64, page_size)
    programs = num_tokens * num_kv_heads
    splits = max(1, min(16, (2 * NUM_SMS) // max(programs, 1), max_kv_len // block_kv))
    return DecodeConfig(block_kv=block_kv, num_kv_splits=1 << (splits.bit_length() - 1))


def _kernel(seq_ref, pos_ref, pages_ref, q_ref, k_ref, v_ref, *out_refs, group, block_kv, page_size, splits,
            sm_scale, soft_cap, window):
    t, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_pages, _, head_dim = k_ref.shape
    pages_per_seq = pages_ref.shape[1]
    pages_per_blk = block_kv // page_size
    seq, pos = seq_ref[t], pos_ref[t]  # pos -1: a padding token
    qs = [q_ref[t, h * group + g, :].astype(jnp.float32) for g in range(group)]
    kv_lo, kv_hi, blk_lo, blk_hi = key_blocks(pos + 1, pos, jnp.minimum(pos + 1, 1), window=window,
                                              block_kv=block_kv, splits=splits, split=split)

    def step(b, carry):
        pg_ok = b * pages_per_blk + jnp.arange(pages_per_blk) < pages_per_seq
        pg = plgpu.load(pages_ref.at[seq, pl.ds(b * pages_per_blk, pages_per_blk)], mask=pg_ok, other=0)
        pg = jnp.clip(pg, 0, num_pages - 1)
        k = k_ref[pg].reshape(block_kv, head_dim).astype(jnp.float32)
        v = v_ref[pg].reshape(block_kv, head_dim).astype(jnp.float32)
        key = b * block_kv + jnp.arange(block_kv)
        vis = (key >= kv_lo) & (key < kv_hi)
        v = jnp.where(vis[:, None], v, 0.0)  # slots past the sequence may hold anything, NaN included
        out = []
        for q, (acc, m, denom) in zip(qs, carry):
            s = jnp.sum(k * q[None, :], axis=1)  # [block_kv]
            if soft_cap is not None:
                s = (soft_cap * LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
            else:
                s = s * (sm_scale * LOG2E)
            s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new)
            out.append((acc * alpha + jnp.sum(p[:, None] * v, axis=0), m_new, denom * alpha + jnp.sum(p)))
        return tuple(out)

    init = tuple((jnp.zeros((head_dim,), jnp.float32), jnp.float32(M_INIT), jnp.float32(0.0)) for _ in qs)
    carry = jax.lax.fori_loop(blk_lo, jnp.maximum(blk_hi, blk_lo), step, init)
    o_ref = out_refs[0]
    for g, (acc, m, denom) in enumerate(carry):
        safe = jnp.where(denom > 0.0, denom, 1.0)
        if splits == 1:
            o_ref[t, h * group + g, :] = (acc / safe).astype(o_ref.dtype)
        else:
            o_ref[split, t, h * group + g, :] = acc / safe
            out_refs[1][split, t, h * group + g] = jnp.where(denom > 0.0, m + jnp.log2(safe), -jnp.inf)


def decode_attention_gpu(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None,
                         soft_cap=None, config: DecodeConfig | None = None, interpret=False):
    """Same contract as `reference.ragged_paged_attention` (inputs assumed validated), for any bucket; the
    table sends it decode buckets with few tokens (`applies`)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_pages, page_size, _ = kv_cache.shape
    pages_per_seq = page_indices.shape[1]
    config = config or tuned_config(num_tokens, num_kv_heads, pages_per_seq * page_size, page_size)
    if not supports(head_dim, page_size, config.block_kv):
        raise ValueError(f"ragged_paged_attention: `config` {config} asks for the small-decode kernel, which needs "
                         f"head_dim a power of two (>= 16) and block_kv a multiple of page_size; got head_dim "
                         f"{head_dim}, page_size {page_size}")
    seq, pos, real = token_positions(cu_q_lens, kv_lens, num_seqs, num_tokens, method="compare_all")
    pos = jnp.where(real, pos, -1).astype(jnp.int32)
    splits = config.num_kv_splits
    kernel = functools.partial(
        _kernel, group=num_q_heads // num_kv_heads, block_kv=config.block_kv, page_size=page_size, splits=splits,
        sm_scale=float(sm_scale), soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if sliding_window is None else int(sliding_window))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda t, h, s: (0,) * len(x.shape))

    def cache_half(i):
        return pl.BlockSpec((None, None, num_pages, page_size, head_dim), lambda t, h, s: (i, h, 0, 0, 0))

    inputs = (seq, pos, page_indices, q, kv_cache, kv_cache)
    in_specs = [whole(x) for x in inputs[:4]] + [cache_half(0), cache_half(1)]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = whole(q)
    else:
        out_shape = (jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
                     jax.ShapeDtypeStruct((splits, num_tokens, num_q_heads), jnp.float32))
        out_specs = tuple(whole(x) for x in out_shape)
    res = pl.pallas_call(
        kernel,
        grid=(num_tokens, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(*inputs)
    return res if splits == 1 else _merge_splits(*res).astype(q.dtype)
