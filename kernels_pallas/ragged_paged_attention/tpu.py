"""Ragged paged attention for TPUs: Pallas Mosaic TPU, with scalar-prefetched page tables and lengths.

Work decomposition. The token axis is cut into fixed blocks of `block_q` tokens; a block can hold the
tail of one sequence and the head of the next, so the unit of work is a (token block, sequence) pair,
an "item". Items are listed in jnp, ordered by block (fixed count: cdiv(T, block_q) + S), and sent to
the kernel through scalar prefetch. The grid is (kv head, item): consecutive items of one block share
the output block, which stays in VMEM until the block index changes; the first item of a block zeroes
it and every item writes only its own rows, so padding rows stay zero. A block with no sequence in it
gets one item with seq = -1 that only zeroes it.

Per item the kernel double-buffers K/V pages HBM -> VMEM by manual DMA (`pages_per_block` pages per
step, page ids read from SMEM) and runs an online softmax in f32 over the tile of all `group` query
heads of the kv head, `[group * block_q, D]` rows, so each K/V page is fetched once per group.
Queries are laid out `[Hkv, G, T, D]` by the wrapper so that a head's tokens are a native tile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

M_INIT = -1e30


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    block_q: int  # tokens per q block, a multiple of 8 (f32) or 16 (bf16) sublanes
    pages_per_block: int  # K/V pages fetched per inner step


# Tuning table (not yet measured on a TPU): tile height group * block_q and keys per step.
TUNED = {"decode": dict(rows=32, block_kv=128), "prefill": dict(rows=256, block_kv=256)}


def default_config(num_tokens: int, num_seqs: int, group: int, page_size: int, itemsize: int) -> TpuConfig:
    t = TUNED["decode" if num_tokens <= 2 * num_seqs else "prefill"]
    sublanes = 8 * (4 // min(itemsize, 4))  # a native tile holds 8 rows of f32, 16 of bf16
    block_q = max(sublanes, t["rows"] // group // sublanes * sublanes)
    return TpuConfig(block_q=block_q, pages_per_block=max(1, t["block_kv"] // page_size))


def work_items(cu_q_lens: jax.Array, num_seqs: jax.Array, num_blocks: int, block_q: int):
    """Items `(block, seq)`, each `[cdiv(T, block_q) + S]` int32, ordered by block; seq -1 = no sequence."""
    s = cu_q_lens.shape[0] - 1
    n = num_seqs[0]
    end = cu_q_lens[n]
    cu = jnp.where(jnp.arange(s + 1) <= n, cu_q_lens, end)  # rows past num_seqs: empty spans at the end

    def seq_of(t):  # sequence whose span holds token t (t < end)
        return jnp.searchsorted(cu[1:], t, side="right", method="compare_all").astype(jnp.int32)

    b = jnp.arange(num_blocks, dtype=jnp.int32)
    lo, hi = b * block_q, jnp.minimum(b * block_q + block_q, end)
    has = lo < hi
    first = seq_of(lo)
    count = jnp.where(has, seq_of(hi - 1) - first + 1, 1)
    ends = jnp.cumsum(count)
    i = jnp.arange(num_blocks + s, dtype=jnp.int32)
    blk = jnp.minimum(jnp.searchsorted(ends, i, side="right", method="compare_all"), num_blocks - 1)
    local = i - (ends[blk] - count[blk])
    seq = jnp.where(has[blk] & (i < ends[-1]), first[blk] + local, -1)
    return blk.astype(jnp.int32), seq.astype(jnp.int32)


def _kernel(item_blk_ref, item_seq_ref, kv_lens_ref, pages_ref, cu_ref,  # scalar prefetch (SMEM)
            q_ref,  # [G, block_q, D] (VMEM)
            kv_hbm,  # [2, Hkv, num_pages, page_size, D] (HBM)
            o_ref,  # [G, block_q, D] (VMEM)
            k_buf, v_buf,  # [2, pages_per_block, page_size, D] each
            sems,  # DMA [2 (k, v), 2 (slot)]
            *, pages_per_seq, sm_scale, soft_cap, window):
    h, i = pl.program_id(0), pl.program_id(1)
    group, block_q, head_dim = q_ref.shape
    _, _, num_pages, page_size, _ = kv_hbm.shape
    pages_per_block = k_buf.shape[1]
    block_kv = pages_per_block * page_size
    rows = group * block_q
    blk, seq_raw = item_blk_ref[i], item_seq_ref[i]

    @pl.when((i == 0) | (item_blk_ref[jnp.maximum(i - 1, 0)] != blk))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(seq_raw >= 0)
    def _():
        seq = seq_raw
        cu0, cu1 = cu_ref[seq], cu_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        tok_lo = jnp.maximum(cu0, blk * block_q)
        tok_hi = jnp.minimum(cu1, blk * block_q + block_q)
        shift = kv_len - (cu1 - cu0) - cu0  # position of token t is t + shift
        kv_hi = jnp.where(tok_hi > tok_lo, jnp.clip(tok_hi + shift, 0, kv_len), 0)
        kv_lo = 0 if window is None else jnp.maximum(tok_lo + shift - window + 1, 0)
        first_blk = kv_lo // block_kv
        num_blks = jnp.maximum((kv_hi + block_kv - 1) // block_kv - first_blk, 0)

        def copies(j, slot):
            out = []
            for p in range(pages_per_block):
                idx = jnp.minimum((first_blk + j) * pages_per_block + p, pages_per_seq - 1)
                page = jnp.clip(pages_ref[seq * pages_per_seq + idx], 0, num_pages - 1)
                out.append(pltpu.make_async_copy(kv_hbm.at[0, h, page], k_buf.at[slot, p], sems.at[0, slot]))
                out.append(pltpu.make_async_copy(kv_hbm.at[1, h, page], v_buf.at[slot, p], sems.at[1, slot]))
            return out

        @pl.when(num_blks > 0)
        def _():
            for c in copies(0, 0):
                c.start()

        q = q_ref[...].reshape(rows, head_dim)
        tok = blk * block_q + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) % block_q  # row r = g*bq + t
        row_ok = (tok >= tok_lo) & (tok < tok_hi)
        row_pos = tok + shift

        def body(j, carry):
            acc, m, denom = carry
            slot = j % 2

            @pl.when(j + 1 < num_blks)
            def _():
                for c in copies(j + 1, 1 - slot):
                    c.start()

            for c in copies(j, slot):
                c.wait()
            k = k_buf[slot].reshape(block_kv, head_dim).astype(q.dtype)  # (an 8-bit cache: to q's dtype)
            v = v_buf[slot].reshape(block_kv, head_dim).astype(q.dtype)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            key_pos = (first_blk + j) * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            key_ok = key_pos < kv_len
            vis = (key_pos <= row_pos) & key_ok & row_ok
            if window is not None:
                vis &= row_pos - key_pos < window
            s = jnp.where(vis, s, -jnp.inf)
            key_ok_col = (first_blk + j) * block_kv + jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0) < kv_len
            v = jnp.where(key_ok_col, v, jnp.zeros_like(v))  # slots past kv_len may hold NaN
            m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new)
            denom = denom * alpha + p.sum(axis=1, keepdims=True)
            pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)
            return acc * alpha + pv, m_new, denom

        init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows, 1), M_INIT, jnp.float32),
                jnp.zeros((rows, 1), jnp.float32))
        acc, _, denom = jax.lax.fori_loop(0, num_blks, body, init)
        out = (acc / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)
        prev = o_ref[...].reshape(rows, head_dim)
        o_ref[...] = jnp.where(row_ok, out, prev).reshape(group, block_q, head_dim)


def ragged_paged_attention_tpu(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                               sliding_window=None, soft_cap=None, config: TpuConfig | None = None,
                               interpret=False):
    """Same contract as `reference.ragged_paged_attention`; inputs are assumed validated.

    interpret: True (or a `pltpu.InterpretParams`) runs the kernel in TPU interpret mode on CPU.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_pages, page_size, _ = kv_cache.shape
    num_seqs_max, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    config = config or default_config(num_tokens, num_seqs_max, group, page_size, q.dtype.itemsize)
    block_q = config.block_q
    num_blocks = pl.cdiv(num_tokens, block_q)
    padded = num_blocks * block_q
    qt = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, T, D]
    if padded != num_tokens:
        qt = jnp.pad(qt, ((0, 0), (0, 0), (0, padded - num_tokens), (0, 0)))
    item_blk, item_seq = work_items(cu_q_lens, num_seqs, num_blocks, block_q)

    kernel = functools.partial(
        _kernel, pages_per_seq=pages_per_seq, sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if sliding_window is None else int(sliding_window))
    q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda h, i, blk, *_: (h, 0, blk[i], 0))
    buf = pltpu.VMEM((2, config.pages_per_block, page_size, head_dim), kv_cache.dtype)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_kv_heads, item_blk.shape[0]),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret or False,
        name="ragged_paged_attention",
    )(item_blk, item_seq, kv_lens, page_indices.reshape(-1), cu_q_lens, qt, kv_cache)
    return out[:, :, :num_tokens].transpose(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim)
