"""Ragged paged attention for Hopper GPUs: Pallas Mosaic GPU, pages copied by the TMA engine, wgmma.

Scope: one program (CTA, one warpgroup) owns one query block of one kv head and one key split. A
query block is up to `block_q` consecutive tokens of one sequence (`gpu.work_items`), and its rows
are those tokens' `group` query heads, token-major: `block_q * group` rows fill the 64-row wgmma tile
(the instruction's minimum height; block_q = 64 // group by default). A decode row is a block of one
token (its other rows are never stored); a prompt chunk is cut into blocks of block_q tokens, each
with its own causal limit per row.

Per key block of `block_kv` tokens the program issues one bulk copy per page for K and one for V
(`block_kv / page_size` of each, all counted on the block's barrier) into a ring of `num_stages`
shared-memory slots, so up to `num_stages` blocks are in flight while it computes: S = Q K^T on the
tensor cores, an online softmax in f32 registers, then acc += P V with P from registers. A slot is
refilled as soon as its block's second wgmma has completed. Keys no row of the block may see (past
the last token's causal limit, before a sliding window's start for the first token) get their V rows
zeroed in shared memory, since slots past a sequence's length may hold anything; blocks where some
row sees less than others (the diagonal, the window's edge) are masked per row. All metadata enter as
one int32 array built here: the kernel needs 256-byte aligned inputs, and the engine's metadata are
slices of one packed buffer.

Key splits (small decode batches) write f32 partial results and base-2 log-sum-exps that
`gpu._merge_splits` combines, like the Triton kernel's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .gpu import LOG2E, M_INIT, NUM_SMS, _merge_splits, is_decode_bucket, key_blocks, work_items

ROWS = 64  # wgmma tile height
SWIZZLE = 128  # bytes


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    block_kv: int = 64  # keys per wgmma step, a multiple of page_size and of 64 (the wgmma tile height)
    num_stages: int = 2  # key blocks in flight per program (3-4 were slower on an H200: fewer programs per SM)
    num_kv_splits: int = 1
    block_q: int | None = None  # query tokens per program; None: 64 // group (the tile's 64 rows)

    def __post_init__(self):
        for name, value in vars(self).items():
            if name == "block_q" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MosaicConfig: `{name}` must be a positive int, got {value!r}")


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), where this kernel runs."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def supports(q_dtype, head_dim: int, group: int, page_size: int, block_kv: int = 64) -> bool:
    """Whether this kernel handles the shapes (else the Triton kernel does)."""
    return (jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 64 == 0
            and head_dim <= 256 and group <= ROWS and group % 4 == 0  # f32 log-sum-exp rows: 16-byte copies
            and page_size % 8 == 0 and block_kv % page_size == 0 and block_kv % ROWS == 0)


def tuned_config(num_tokens: int, num_seqs_max: int, num_kv_heads: int, max_kv_len: int, block_kv: int = 64,
                 num_stages: int = 2) -> MosaicConfig:
    """Decode buckets: one-token query blocks, and key splits so that small batches still cover the GPU
    (programs = tokens x kv heads x splits); other buckets have enough query blocks without splitting.

    The split count counts a decode bucket's padding tokens too; counting only its sequences (twice
    the splits at batch 1-8) made the 8B decode step 0.09-0.10 ms slower on an H200 (RESULTS.md)."""
    if not is_decode_bucket(num_tokens, num_seqs_max):
        # (Two warpgroups per program sharing each K/V block were tried: no faster at 4k, slower in
        # mixed buckets; RESULTS.md, session 7.)
        return MosaicConfig(block_kv, num_stages, 1)
    # Decode rows are blocks of one token: a taller block would load Q rows that no row stores.
    programs = num_tokens * num_kv_heads
    splits = max(1, min(16, (2 * NUM_SMS) // max(programs, 1), max_kv_len // (4 * block_kv)))
    return MosaicConfig(block_kv, num_stages, 1 << (splits.bit_length() - 1), block_q=1)


def _kernel(meta_ref, q_ref, kv_ref, *refs, num_items, num_seqs_max, pages_per_seq, splits, block_q, block_kv,
            num_stages, page_size, sm_scale, soft_cap, window):
    if splits == 1:
        o_ref, q_smem, k_smem, v_smem, q_bar, kv_bars = refs
    else:
        o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, kv_bars = refs
    item = lax.axis_index("item")
    h = lax.axis_index("head")
    split = lax.axis_index("split")
    _, _, num_pages, _, head_dim = kv_ref.shape
    num_tokens, _, group, _ = q_ref.shape
    pages_per_blk = block_kv // page_size
    dtype = q_ref.dtype
    # meta: [seq, q_start, q_end] per item, then kv_lens [S], cu_q_lens [S + 1], page table [S, P].
    lens_at, cu_at = 3 * num_items, 3 * num_items + num_seqs_max
    pages_at = cu_at + num_seqs_max + 1

    seq_raw = meta_ref[item]
    seq = jnp.maximum(seq_raw, 0)
    q_start = meta_ref[num_items + item]
    n_tok = meta_ref[2 * num_items + item] - q_start
    kv_len = jnp.where(seq_raw >= 0, meta_ref[lens_at + seq], 0)
    cu_lo, cu_hi = meta_ref[cu_at + seq], meta_ref[cu_at + seq + 1]
    pos = kv_len - (cu_hi - cu_lo) + (q_start - cu_lo)  # the block's first token's position
    # [kv_lo, kv_hi): keys some row sees (the first token's window start, the last token's limit).
    kv_lo, kv_hi, blk_lo, blk_hi = key_blocks(kv_len, pos, n_tok, window=window, block_kv=block_kv,
                                              splits=splits, split=split)
    blk_hi = jnp.maximum(blk_hi, blk_lo)
    # Blocks every row sees whole need no mask: [blk_a, blk_b), from the last token's window start
    # to the first token's causal limit.
    last_lo = 0 if window is None else jnp.maximum(pos + n_tok - window, 0)
    blk_a = jnp.clip((last_lo + block_kv - 1) // block_kv, blk_lo, blk_hi)
    blk_b = jnp.clip(jnp.minimum(pos + 1, kv_hi) // block_kv, blk_a, blk_hi)

    def issue(b, slot):
        for j in range(pages_per_blk):
            page = meta_ref[pages_at + seq * pages_per_seq + jnp.minimum(b * pages_per_blk + j, pages_per_seq - 1)]
            page = jnp.clip(page, 0, num_pages - 1)
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(kv_ref.at[0, h, page], k_smem.at[slot, rows], kv_bars.at[slot])
            plgpu.copy_gmem_to_smem(kv_ref.at[1, h, page], v_smem.at[slot, rows], kv_bars.at[slot])

    @pl.when(n_tok > 0)
    def _():
        for j in range(block_q):  # rows past the block's tokens: never stored
            row = jnp.minimum(q_start + j, num_tokens - 1)
            plgpu.copy_gmem_to_smem(q_ref.at[row, h], q_smem.at[pl.ds(j * group, group)], q_bar)
        for i in range(num_stages):
            pl.when(blk_lo + i < blk_hi)(functools.partial(issue, blk_lo + i, i))
        plgpu.barrier_wait(q_bar)
        q = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA)  # rows past the group: never stored

        def step(b, carry, masked):
            acc, m, denom = carry
            slot = lax.rem(b - blk_lo, num_stages)
            plgpu.barrier_wait(kv_bars.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
            if soft_cap is not None:
                s = (soft_cap * LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
            else:
                s = s * (sm_scale * LOG2E)
            if masked:
                key = b * block_kv + plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1,
                                                            layout=plgpu.Layout.WGMMA)
                visible = key < kv_hi
                if block_q > 1 or window is not None:
                    # Row r is token r // group of the block: its own causal limit and window start.
                    row_pos = pos + plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0,
                                                           layout=plgpu.Layout.WGMMA) // group
                    visible &= key <= row_pos
                    if window is not None:
                        visible &= key > row_pos - window
                s = jnp.where(visible, s, -jnp.inf)
                # Zero the V rows of masked keys: 0 * (whatever a free slot holds) must stay 0.
                v_tile = v_smem.at[slot]
                row = b * block_kv + plgpu.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0,
                                                            layout=plgpu.Layout.WGMMA)
                v_tile[...] = jnp.where((row < kv_hi) & (row >= kv_lo), v_tile[...], jnp.zeros((), dtype))
                plgpu.commit_smem()
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            denom = denom * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))

            @pl.when(b + num_stages < blk_hi)
            def _():
                issue(b + num_stages, slot)

            return acc, m_new, denom

        carry = (plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                 plgpu.layout_cast(jnp.full((ROWS,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                 plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
        masked_step = functools.partial(step, masked=True)
        if window is not None:
            carry = lax.fori_loop(blk_lo, blk_a, masked_step, carry)
        carry = lax.fori_loop(blk_a, blk_b, functools.partial(step, masked=False), carry)
        acc, m, denom = lax.fori_loop(blk_b, blk_hi, masked_step, carry)

        safe = jnp.where(denom == 0.0, 1.0, denom)
        out = acc / lax.broadcast_in_dim(safe, acc.shape, [0])
        if splits == 1:
            q_smem[...] = out.astype(dtype)  # Q is in registers
        else:
            o_smem[...] = out
            lse_smem[...] = jnp.where(denom > 0.0, m + jnp.log2(safe), -jnp.inf)
        plgpu.commit_smem()
        def store(j):
            rows = pl.ds(j * group, group)
            if splits == 1:
                plgpu.copy_smem_to_gmem(q_smem.at[rows], o_ref.at[q_start + j, h])
            else:
                plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[split, q_start + j, h])
                plgpu.copy_smem_to_gmem(lse_smem.at[rows], lse_ref.at[split, q_start + j, h])

        for j in range(block_q):
            pl.when(j < n_tok)(functools.partial(store, j))
        plgpu.wait_smem_to_gmem(0)


def ragged_attention_mosaic(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                            sliding_window=None, soft_cap=None, config: MosaicConfig | None = None):
    """Same contract as `reference.ragged_paged_attention`; one program per (query block, kv head, split)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_pages, page_size, _ = kv_cache.shape
    num_seqs_max, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    config = config or tuned_config(num_tokens, num_seqs_max, num_kv_heads, pages_per_seq * page_size)
    block_q = config.block_q or max(1, ROWS // group)
    if not supports(q.dtype, head_dim, group, page_size, config.block_kv) or block_q * group > ROWS:
        raise ValueError(f"ragged_paged_attention: `config` {config} asks for the Mosaic GPU kernel, which needs "
                         f"bf16/f16, head_dim a multiple of 64 (<= 256), a GQA group that is a multiple of 4, "
                         f"page_size a multiple of 8, block_kv a multiple of 64 and of page_size, and block_q x "
                         f"group <= {ROWS}; got {q.dtype}, head_dim {head_dim}, group {group}, page_size {page_size}")
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    items = work_items(cu_q_lens, num_seqs, num_tokens, block_q)
    num_items = items[0].shape[0]
    splits, stages, block_kv = config.num_kv_splits, config.num_stages, config.block_kv

    def tiled(shape, dt):
        bits = jnp.dtype(dt).itemsize * 8
        transforms = (plgpu.TilingTransform((8, SWIZZLE * 8 // bits)), plgpu.SwizzleTransform(SWIZZLE))
        return plgpu.SMEM(shape, dt, transforms=transforms)

    # Q lands untiled (a TMA copy per token of just the group's rows) and goes to registers as the
    # wgmma's A; the result leaves through the same buffer (f32 results through their own).
    scratch = [plgpu.SMEM((ROWS, head_dim), q.dtype), tiled((stages, block_kv, head_dim), q.dtype),
               tiled((stages, block_kv, head_dim), q.dtype)]
    if splits == 1:
        out_type = jax.ShapeDtypeStruct(qg.shape, q.dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((splits, *qg.shape), jnp.float32),
                    jax.ShapeDtypeStruct((splits, *qg.shape[:-1]), jnp.float32))
        scratch += [plgpu.SMEM((ROWS, head_dim), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32)]
    scratch += [plgpu.Barrier(num_arrivals=block_q),
                plgpu.Barrier(num_arrivals=2 * (block_kv // page_size), num_barriers=stages)]
    # One int32 array for all metadata: a fresh buffer (the kernel needs 256-byte aligned inputs, and
    # the engine's metadata are slices of one packed buffer).
    meta = jnp.concatenate([*items, kv_lens, cu_q_lens, page_indices.reshape(-1)])
    kernel = functools.partial(
        _kernel, num_items=num_items, num_seqs_max=num_seqs_max, pages_per_seq=pages_per_seq,
        splits=splits, block_q=block_q, block_kv=block_kv, num_stages=stages, page_size=page_size,
        sm_scale=float(sm_scale), soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if sliding_window is None else int(sliding_window))
    res = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(num_items, num_kv_heads, splits),
        grid_names=("item", "head", "split"), compiler_params=plgpu.CompilerParams(approx_math=True),
    )(meta, qg, kv_cache)
    if splits == 1:
        out = res
    else:
        out = _merge_splits(*res).astype(q.dtype)
    return out.reshape(num_tokens, num_q_heads, head_dim)
