"""Ragged paged attention for NVIDIA GPUs (Hopper first): Pallas with the Triton lowering.

Work decomposition. The query tokens of each sequence are cut into blocks of `block_q` tokens; one
program owns one (query block, kv head, kv split). Its tile is all `group` query heads of that kv head
for its tokens, `[block_q * group, D]` rows, so each K/V page is read once per group. The list of
query blocks is computed in jnp from `cu_q_lens` (fixed size: cdiv(T, block_q) + S + 1 entries); the
tokens after the last real sequence form one extra "padding" segment whose programs see no keys and
write zeros, so padding rows cost one cheap program per block and need no separate pass.

Each program walks its sequence's pages `block_kv` tokens at a time (a gather of block_kv/page_size
pages), with an online softmax in f32. Blocks wholly below the causal diagonal skip the mask. For
small batches (decode) the key range is split over `num_kv_splits` programs whose partial results are
merged by a log-sum-exp combine outside the kernel. Mixed buckets run two launches into one output
(aliased): short sequences (decodes) with the decode tile, the rest with the prefill tile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .blocks import LOG2E, M_INIT, NUM_SMS, is_decode_bucket, key_blocks, merge_splits, work_items


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    block_q: int  # query tokens per program (rows = block_q * group)
    block_kv: int  # keys per inner step, a multiple of page_size
    num_kv_splits: int
    num_warps: int
    num_stages: int


# Tuning table: (kind) -> settings, measured on an H200 (benchmarks/RESULTS.md). `rows` is the target
# tile height block_q * group; block_kv is in tokens.
TUNED = {
    # decode: B=64 x 2k ctx 203 us with one stage and 8 warps; two stages 251 us (shared memory caps
    # occupancy), 2 warps 327 us, block_kv 64 253 us, 256 229 us.
    "decode": dict(rows=16, block_kv=128, num_warps=8, num_stages=1),
    # decode with few (sequence, kv head) programs, at most half the SMs (batch-1 steps: 8 sequence rows
    # x 8 kv heads): 64-key blocks in 4 warps give 4 key splits per program instead of 2; in the 8B
    # step at 128-384 tokens of context this was 0.07-0.11 ms faster per step (benchmarks/RESULTS.md).
    "decode_few": dict(rows=16, block_kv=64, num_warps=4, num_stages=1),
    # prefill: causal 4k tokens 501 us; rows 64/256 or block_kv 64 or 4 warps were slower.
    "prefill": dict(rows=128, block_kv=128, num_warps=8, num_stages=3),
}
def tuned_config(kind: str, num_seqs: int, num_kv_heads: int, group: int, page_size: int,
                 max_kv_len: int, itemsize: int = 2) -> GpuConfig:
    """Tile sizes for a "decode" or "prefill" launch, from static shapes only."""
    few = kind == "decode" and num_seqs * num_kv_heads <= NUM_SMS // 2
    t = TUNED["decode_few" if few else kind]
    block_q = max(1, t["rows"] // group)
    # f32 tiles take twice the shared memory: halve the key block and drop pipelining (the table is
    # for 2-byte types; an f32 prefill tile overflowed the H200's 227 KiB).
    block_kv = max(page_size, t["block_kv"] * 2 // max(itemsize, 2) // page_size * page_size)
    splits = 1
    if kind == "decode":
        # Enough programs to fill every SM twice, but no split shorter than a few blocks.
        programs = num_seqs * num_kv_heads
        splits = max(1, min(16, (2 * NUM_SMS) // max(programs, 1), max_kv_len // (4 * block_kv)))
        splits = 1 << (splits.bit_length() - 1)
    stages = t["num_stages"] if itemsize <= 2 else 1
    return GpuConfig(block_q, block_kv, splits, t["num_warps"], stages)


def _kernel(seq_ref, qs_ref, qe_ref, kv_lens_ref, cu_ref, pages_ref,  # metadata
            q_ref, k_ref, v_ref,  # q [T, G, D] of this kv head; k/v [num_pages, page_size, D]
            *refs,  # [o_in (aliased to o)], o [T, G, D], [lse [T, G] with splits]
            aliased, block_q, group, block_kv, page_size, num_splits, num_items, sm_scale, soft_cap, window):
    refs = refs[1:] if aliased else refs
    o_ref, lse_ref = refs[0], refs[1:]
    item = num_items - 1 - pl.program_id(0)  # last blocks of a sequence (most keys) start first
    split = pl.program_id(2)
    num_pages, _, head_dim = k_ref.shape
    pages_per_seq = pages_ref.shape[1]
    pages_per_blk = block_kv // page_size
    rows = block_q * group

    seq_raw = seq_ref[item]
    seq = jnp.maximum(seq_raw, 0)
    q_start, q_end = qs_ref[item], qe_ref[item]
    kv_len = jnp.where(seq_raw >= 0, kv_lens_ref[seq], 0)
    q_len = cu_ref[seq + 1] - cu_ref[seq]
    first_pos = kv_len - q_len + (q_start - cu_ref[seq])  # position of the block's first token
    n_tok = q_end - q_start

    kv_lo, kv_hi, blk_lo, blk_hi = key_blocks(kv_len, first_pos, n_tok, window=window, block_kv=block_kv,
                                              splits=num_splits, split=split)
    # Blocks whose last key is at or before the first token's position need no mask.
    blk_full = blk_lo if window is not None else jnp.clip((first_pos + 1) // block_kv, blk_lo, blk_hi)
    blk_hi = jnp.maximum(blk_hi, blk_full)

    tok_ok = jnp.arange(block_q) < n_tok
    q_mask = jnp.broadcast_to(tok_ok[:, None, None], (block_q, group, head_dim))
    q = plgpu.load(q_ref.at[pl.ds(q_start, block_q)], mask=q_mask, other=0.0)
    q = q.reshape(rows, head_dim)
    row_pos = first_pos + jnp.arange(rows) // group  # [rows]

    def step(b, carry, masked):
        acc, m, denom = carry
        pg_ok = b * pages_per_blk + jnp.arange(pages_per_blk) < pages_per_seq
        pg = plgpu.load(pages_ref.at[seq, pl.ds(b * pages_per_blk, pages_per_blk)], mask=pg_ok, other=0)
        pg = jnp.clip(pg, 0, num_pages - 1)
        k = k_ref[pg].reshape(block_kv, head_dim).astype(q.dtype)  # (an 8-bit cache: to q's dtype)
        v = v_ref[pg].reshape(block_kv, head_dim).astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True)  # [rows, block_kv] f32
        if soft_cap is not None:
            s = (soft_cap * LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
        else:
            s = s * (sm_scale * LOG2E)
        if masked:
            key_pos = b * block_kv + jnp.arange(block_kv)
            key_ok = key_pos < kv_len
            vis = (key_pos[None, :] <= row_pos[:, None]) & key_ok[None, :]
            if window is not None:
                vis &= row_pos[:, None] - key_pos[None, :] < window
            s = jnp.where(vis, s, -jnp.inf)
            v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))  # slots past kv_len may hold NaN
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        denom = denom * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, denom

    carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), M_INIT, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    carry = jax.lax.fori_loop(blk_lo, blk_full, functools.partial(step, masked=False), carry)
    acc, m, denom = jax.lax.fori_loop(blk_full, blk_hi, functools.partial(step, masked=True), carry)

    out = acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]
    o_mask = jnp.broadcast_to(tok_ok[:, None, None], (block_q, group, head_dim))
    plgpu.store(o_ref.at[pl.ds(q_start, block_q)], out.reshape(block_q, group, head_dim).astype(o_ref.dtype),
                mask=o_mask)
    if num_splits > 1:
        lse = jnp.where(denom > 0.0, m + jnp.log2(jnp.where(denom > 0.0, denom, 1.0)), -jnp.inf)
        plgpu.store(lse_ref[0].at[pl.ds(q_start, block_q)], lse.reshape(block_q, group),
                    mask=jnp.broadcast_to(tok_ok[:, None], (block_q, group)))


def _launch(qg, kv_cache, kv_lens, page_indices, cu_q_lens, items, config, block_q, out, *, sm_scale,
            sliding_window, soft_cap, interpret):
    """One pallas_call over `items`; writes its rows of `out` (aliased) or of a fresh array."""
    num_tokens, num_kv_heads, group, head_dim = qg.shape
    _, _, num_pages, page_size, _ = kv_cache.shape
    num_items = items[0].shape[0]
    splits = config.num_kv_splits
    kernel = functools.partial(
        _kernel, aliased=out is not None, block_q=block_q, group=group, block_kv=config.block_kv,
        page_size=page_size, num_splits=splits, num_items=num_items, sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if sliding_window is None else int(sliding_window))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda i, h, s: (0,) * x.ndim)

    head_spec = pl.BlockSpec((num_tokens, None, group, head_dim), lambda i, h, s: (0, h, 0, 0))
    inputs = (*items, kv_lens, cu_q_lens, page_indices, qg, kv_cache, kv_cache)
    in_specs = [whole(x) for x in inputs[:6]] + [
        head_spec,
        pl.BlockSpec((None, None, num_pages, page_size, head_dim), lambda i, h, s: (0, h, 0, 0, 0)),
        pl.BlockSpec((None, None, num_pages, page_size, head_dim), lambda i, h, s: (1, h, 0, 0, 0)),
    ]
    aliases = {}
    if out is not None:
        assert splits == 1
        inputs, in_specs, aliases = (*inputs, out), [*in_specs, head_spec], {len(inputs): 0}
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(qg.shape, qg.dtype)
        out_specs = head_spec
    else:
        out_shape = (jax.ShapeDtypeStruct((splits, *qg.shape), jnp.float32),
                     jax.ShapeDtypeStruct((splits, *qg.shape[:-1]), jnp.float32))
        out_specs = (
            pl.BlockSpec((None, num_tokens, None, group, head_dim), lambda i, h, s: (s, 0, h, 0, 0)),
            pl.BlockSpec((None, num_tokens, None, group), lambda i, h, s: (s, 0, h, 0)),
        )
    res = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*inputs)
    return res if splits == 1 else merge_splits(*res).astype(qg.dtype)


def ragged_paged_attention_gpu(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                               sliding_window=None, soft_cap=None, config: GpuConfig | None = None,
                               interpret=False):
    """Same contract as `reference.ragged_paged_attention`; inputs are assumed validated.

    config None: decode buckets (`is_decode_bucket`) run one launch with the decode tile; other buckets
    run two launches into one output, short sequences (decodes) with the decode tile and the rest with
    the prefill tile, so a decode in a mixed batch does not pay for a prefill-sized tile.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_pages, page_size, _ = kv_cache.shape
    num_seqs_max, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    decode_bucket = is_decode_bucket(num_tokens, num_seqs_max)
    # Triton tiles need power-of-two sides: pad the group with zero query heads if it is not.
    group_p = 1 << (group - 1).bit_length()
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if group_p != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_p - group), (0, 0)))
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    meta = (kv_lens, page_indices, cu_q_lens)
    tuned = functools.partial(tuned_config, num_seqs=num_seqs_max, num_kv_heads=num_kv_heads, group=group,
                              page_size=page_size, max_kv_len=pages_per_seq * page_size,
                              itemsize=q.dtype.itemsize)

    def block_q_of(cfg):
        return max(1, cfg.block_q * group // group_p)

    if config is None and not decode_bucket:
        dec = tuned("decode")  # its key splits are merged before the prefill launch writes into it
        pre = tuned("prefill")
        bq_dec, bq_pre = block_q_of(dec), block_q_of(pre)
        items = work_items(cu_q_lens, num_seqs, num_tokens, bq_dec, select="short", short_len=bq_dec,
                           num_items=num_seqs_max)
        out = _launch(qg, kv_cache, *meta, items, dec, bq_dec, None, **kw)
        items = work_items(cu_q_lens, num_seqs, num_tokens, bq_pre, select="long", short_len=bq_dec)
        out = _launch(qg, kv_cache, *meta, items, pre, bq_pre, out, **kw)
    else:
        config = config or tuned("decode" if decode_bucket else "prefill")
        block_q = block_q_of(config)
        items = work_items(cu_q_lens, num_seqs, num_tokens, block_q)
        out = _launch(qg, kv_cache, *meta, items, config, block_q, None, **kw)
    return out[:, :, :group].reshape(num_tokens, num_q_heads, head_dim)
