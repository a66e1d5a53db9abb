"""Ragged paged attention for Hopper GPUs: Pallas Mosaic GPU, pages copied by the TMA engine, wgmma.

Rows. A query block is up to `block_q` consecutive tokens of one sequence (`blocks.work_items`), and its
rows are those tokens' `group` query heads, token-major: `block_q * group` rows fill the 64-row wgmma
tile (the instruction's minimum height; block_q = 64 // group by default). A decode row is a block of
one token (in layout 1 its other rows are never stored; the table runs such blocks transposed, below);
a prompt chunk is cut into blocks, each row with its own causal limit.

Program layouts:
- 1 (`compute_warpgroups=1`, buckets with room for many decode rows): one program (CTA, one warpgroup)
  per (query block, kv head, key split). It issues one bulk copy per page for K and for V
  (`block_kv / page_size` of each, counted on the block's barrier) into a ring of `num_stages`
  shared-memory slots, computes S = Q K^T on the tensor cores, an online softmax in f32 registers,
  then acc += P V with P from registers, and refills a slot once its block's second wgmma has
  completed. Key splits (small batches) write f32 partial results and base-2 log-sum-exps that
  `blocks.merge_splits` combines, like the Triton kernel's.
- Transposed (`transposed=True`: decode buckets, and an 8-bit cache's decode rows in mixed buckets):
  a one-token block would fill 4 of the 64-row tile's rows (GQA group 4), so `_kernel_t` turns the
  matmuls around: S^T = K Q^T with the block's keys as the tile's rows and the token's query heads as
  its columns (8: a slab of Q rows), a softmax down the columns, P^T to shared memory, then
  O^T += V^T P^T. Its matmul and softmax work per key block is an eighth of layout 1's. In a mixed
  bucket the decode rows' items and the query blocks share one launch (`_kernel_mixed`).
- 2 (`compute_warpgroups=2`, buckets of mostly prompt tokens, see `tuned_config`): one program per
  (two query blocks, kv head) with three warpgroups: a copier that fills the slots (K and V on their
  own barriers) and refills one when both compute warpgroups have released it, and two compute
  warpgroups, one query block each, that take turns on the tensor cores: a shared barrier keeps them
  half a step apart, so one's softmax runs while the other's matmuls do. Each K/V block read from L2
  feeds twice the rows. A warpgroup without tokens (a decode row's block) only keeps the barriers'
  counts.

8-bit caches (`kv_cache_dtype="fp8"`): one warpgroup. Blocks are multiplied in f16 (8-bit floats
convert to f16 in one instruction, to bf16 only through f32), Q saturated to f16's range. Layout 1
converts each block into two more f16 tiles and refills the slot at once. The transposed kernel takes
K into registers (the wgmma's A operand) and writes V in f16 over the stage's own 8-bit K and V (a
`RefUnion`): 40 KB of shared memory, five programs per SM. On an H200 (RESULTS.md, session 10) a
B=256 decode at 640 tokens takes 117 µs with e4m3 against 177 with bf16; layout 1 took 186 with bf16
(near the bytes' bound already) and 179 with e4m3, held back by its conversions and their shared memory.

Keys no row of the block may see (past the last token's causal limit, before a sliding window's start
for the first token) get their V rows zeroed in shared memory, since slots past a sequence's length
may hold anything; blocks where some row sees less than others (the diagonal, the window's edge) are
masked per row. All metadata enter as one int32 array built here: the kernel needs 256-byte aligned
inputs, and the engine's metadata are slices of one packed buffer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .blocks import LOG2E, M_INIT, NUM_SMS, is_decode_bucket, key_blocks, merge_splits, work_items
from .reference import is_fp8, saturate

ROWS = 64  # wgmma tile height
PROMPT_TOKENS_PER_SEQ = 32  # buckets with at least this many tokens per sequence slot: two compute warpgroups
SWIZZLE = 128  # bytes


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    block_kv: int = 64  # keys per wgmma step, a multiple of page_size and of 64 (the wgmma tile height)
    num_stages: int = 2  # key blocks in flight per program (3-4 were slower on an H200: fewer programs per SM)
    num_kv_splits: int = 1
    block_q: int | None = None  # query tokens per compute warpgroup; None: 64 // group (the tile's 64 rows)
    # 1: one warpgroup copies and computes; 2: two compute warpgroups share each K/V block, which a third
    # copies in (no key splits, head_dim <= 128).
    compute_warpgroups: int = 1
    # One-token query blocks computed transposed (`_kernel_t`): S^T = K Q^T with the block's keys as the
    # wgmma's rows and the token's query heads as its columns, then O^T += V^T P^T. With block_q 1 every
    # item is one token; with taller blocks, sequences of one query token (decodes) get one-token items
    # and the others block_q-token blocks, in one launch (no key splits). One compute warpgroup.
    transposed: bool = False
    # Diagnostics: a directory where each call writes an in-kernel trace (Mosaic GPU's on-device
    # profiler: cycle stamps per warpgroup, kept in shared memory) of the transposed kernel's named
    # regions (prologue, per key block wait / convert / qk / max / exp / p_store / pv / refill,
    # epilogue). The stamps add work at every region's edges: a profiled launch ran at least 1.3-1.5x
    # longer (H200, RESULTS.md session 19), so read the regions as shares of a slowed chain and time
    # the kernel without them; `benchmarks/kernels.py --region-profile` reads the traces.
    profile_dir: str | None = None

    def __post_init__(self):
        for name, value in vars(self).items():
            if (name == "block_q" and value is None) or name in ("transposed", "profile_dir"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MosaicConfig: `{name}` must be a positive int, got {value!r}")
        if self.compute_warpgroups not in (1, 2):
            raise ValueError(f"MosaicConfig: `compute_warpgroups` must be 1 or 2, got {self.compute_warpgroups!r}")
        if self.compute_warpgroups == 2 and self.num_kv_splits != 1:
            raise ValueError("MosaicConfig: `num_kv_splits` must be 1 with two compute warpgroups, got "
                             f"{self.num_kv_splits!r}")
        if self.profile_dir is not None and (not isinstance(self.profile_dir, str) or not self.profile_dir):
            raise ValueError(f"MosaicConfig: `profile_dir` must be None or a directory path, got {self.profile_dir!r}")
        if not isinstance(self.transposed, bool):
            raise ValueError(f"MosaicConfig: `transposed` must be a bool, got {self.transposed!r}")
        if self.transposed and self.compute_warpgroups != 1:
            raise ValueError("MosaicConfig: `transposed` needs one compute warpgroup, got compute_warpgroups "
                             f"{self.compute_warpgroups!r}")
        if self.compute_warpgroups == 2 and self.num_stages < 2:
            # (Only 2-3 slots were tested on a GPU; with one, K of the next block and V of this one share a
            # slot's turn and an idle warpgroup's early releases are unchecked.)
            raise ValueError("MosaicConfig: `num_stages` must be at least 2 with two compute warpgroups, got "
                             f"{self.num_stages!r}")


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), where this kernel runs."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def supports(q_dtype, head_dim: int, group: int, page_size: int, block_kv: int = 64, kv_dtype=None) -> bool:
    """Whether this kernel handles the shapes (else the Triton kernel does). An 8-bit cache needs rows
    of whole 128-byte swizzle lines (head_dim a multiple of 128)."""
    kv_ok = (kv_dtype is None or jnp.dtype(kv_dtype) == jnp.dtype(q_dtype)
             or (is_fp8(kv_dtype) and head_dim % 128 == 0))
    return (jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 64 == 0
            and head_dim <= 256 and group <= ROWS and group % 4 == 0  # f32 log-sum-exp rows: 16-byte copies
            and page_size % 8 == 0 and block_kv % page_size == 0 and block_kv % ROWS == 0 and kv_ok)


def tuned_config(num_tokens: int, num_seqs_max: int, num_kv_heads: int, max_kv_len: int,
                 head_dim: int = 128, fp8_cache: bool = False) -> MosaicConfig:
    """Decode buckets: one-token query blocks, transposed, and key splits so that small batches still
    cover the GPU (programs = tokens x kv heads x splits); other buckets have enough query blocks
    without splitting.

    The split count counts a decode bucket's padding tokens too; counting only its sequences (twice
    the splits at batch 1-8) made the 8B decode step 0.09-0.10 ms slower on an H200 (RESULTS.md)."""
    block_kv, num_stages = 64, 2
    if not is_decode_bucket(num_tokens, num_seqs_max):
        # Two compute warpgroups where the bucket's rows are mostly prompt tokens (at least
        # PROMPT_TOKENS_PER_SEQ per sequence slot): causal 4k prefill 295 µs against 434 with one (H200,
        # RESULTS.md session 8). A decode row's block leaves one of them idle and takes a whole SM (a
        # step with 128 decode rows: 1.2 ms slower), so buckets with room for many decode rows stay on
        # one warpgroup. (With the engine's default 256 sequences no bucket qualifies: S >= T / 8.)
        # 8-bit caches: one warpgroup, which converts each block to f16, and the decode tokens' items
        # transposed in the same launch: a mixed batch of 255 decodes and a 512-token chunk at 640 / 2048
        # tokens of context took 170 / 445 µs against 192 / 533 (H200, RESULTS.md session 10). With bf16
        # that was no faster (1.5% faster to 5.6% slower): the launch's shared memory is the query
        # blocks' (2 programs per SM, against 3 for decode alone).
        two = head_dim <= 128 and num_tokens >= PROMPT_TOKENS_PER_SEQ * num_seqs_max and not fp8_cache
        return MosaicConfig(block_kv, num_stages, 1, compute_warpgroups=2 if two else 1, transposed=fp8_cache)
    # Decode rows are blocks of one token, computed transposed (keys as the wgmma's rows): in layout 1
    # a one-token block fills 4 of the tile's 64 rows (B=256 at 640 tokens: 176.9 µs against 186.3 with
    # bf16, 116.8 against 178.6 with e4m3; RESULTS.md session 10).
    programs = num_tokens * num_kv_heads
    splits = max(1, min(16, (2 * NUM_SMS) // max(programs, 1), max_kv_len // (4 * block_kv)))
    return MosaicConfig(block_kv, num_stages, 1 << (splits.bit_length() - 1), block_q=1, transposed=True)


class _Item:
    """One work item's scalars, read from the metadata array: its sequence, query tokens
    [q_start, q_start + n_tok), the first token's position, the keys [kv_lo, kv_hi) some row sees,
    its key blocks [blk_lo, blk_hi), and [blk_a, blk_b), the blocks every row sees whole (no mask)."""

    def __init__(self, meta_ref, item, split, *, num_items, num_seqs_max, block_kv, splits, window):
        lens_at, cu_at = 3 * num_items, 3 * num_items + num_seqs_max
        seq_raw = meta_ref[item]
        self.seq = jnp.maximum(seq_raw, 0)
        self.q_start = meta_ref[num_items + item]
        self.n_tok = meta_ref[2 * num_items + item] - self.q_start
        kv_len = jnp.where(seq_raw >= 0, meta_ref[lens_at + self.seq], 0)
        cu_lo, cu_hi = meta_ref[cu_at + self.seq], meta_ref[cu_at + self.seq + 1]
        self.pos = kv_len - (cu_hi - cu_lo) + (self.q_start - cu_lo)
        self.kv_lo, self.kv_hi, self.blk_lo, blk_hi = key_blocks(
            kv_len, self.pos, self.n_tok, window=window, block_kv=block_kv, splits=splits, split=split)
        self.blk_hi = jnp.maximum(blk_hi, self.blk_lo)
        # From the last token's window start to the first token's causal limit.
        last_lo = 0 if window is None else jnp.maximum(self.pos + self.n_tok - window, 0)
        self.blk_a = jnp.clip((last_lo + block_kv - 1) // block_kv, self.blk_lo, self.blk_hi)
        self.blk_b = jnp.clip(jnp.minimum(self.pos + 1, self.kv_hi) // block_kv, self.blk_a, self.blk_hi)


def _page_ids(meta_ref, it, b, *, pages_at, pages_per_seq, pages_per_block):
    """The cache pages of key block b: scalar loads from global memory (issue them well before the
    copies that use them)."""
    return [meta_ref[pages_at + it.seq * pages_per_seq + jnp.minimum(b * pages_per_block + j, pages_per_seq - 1)]
            for j in range(pages_per_block)]


def _copy_pages(meta_ref, kv_ref, it, h, b, dsts, *, pages_at, pages_per_seq, page_size, pages=None):
    """Start the bulk copies of key block b's pages: for each page, one copy per `(which, dst, bar)`
    in `dsts` (which: 0 = K, 1 = V), counted on `bar`. Each page's index is read once for all of them
    (`pages`, else loaded here: a scalar load from global memory on the issuing thread's path)."""
    num_pages = kv_ref.shape[2]
    block_kv = dsts[0][1].shape[0]
    if pages is None:
        pages = _page_ids(meta_ref, it, b, pages_at=pages_at, pages_per_seq=pages_per_seq,
                          pages_per_block=block_kv // page_size)
    for j in range(block_kv // page_size):
        page = jnp.clip(pages[j], 0, num_pages - 1)
        for which, dst, bar in dsts:
            plgpu.copy_gmem_to_smem(kv_ref.at[which, h, page], dst.at[pl.ds(j * page_size, page_size)], bar)


def _scale(s, sm_scale, soft_cap):
    """Scores in base 2: scaled, soft-capped where the model caps them."""
    if soft_cap is not None:
        return (soft_cap * LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
    return s * (sm_scale * LOG2E)


def _scores(s, b, it, *, masked, first_pos, group, block_kv, sm_scale, soft_cap, window):
    """Scaled (base-2) scores of key block b. Masked: keys past kv_hi, and, unless group is None (every
    row is the same token), per row past its causal limit or before its window; rows are token-major,
    `group` rows per token, the first at first_pos."""
    s = _scale(s, sm_scale, soft_cap)
    if masked:
        key = b * block_kv + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        visible = key < it.kv_hi
        if group is not None:
            row_pos = first_pos + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA) // group
            visible &= key <= row_pos
            if window is not None:
                visible &= key > row_pos - window
        s = jnp.where(visible, s, -jnp.inf)
    return s


def _zero_masked_v(v_tile, b, it, block_kv):
    """Zero the V rows of keys no row may see: 0 * (whatever a free slot holds) must stay 0."""
    row = b * block_kv + plgpu.broadcasted_iota(jnp.int32, v_tile.shape, 0, layout=plgpu.Layout.WGMMA)
    v_tile[...] = jnp.where((row < it.kv_hi) & (row >= it.kv_lo), v_tile[...], jnp.zeros((), v_tile.dtype))
    plgpu.commit_smem()


def _softmax(s, m, denom, acc):
    """Online-softmax update: the block's probabilities and the new running max, sum and accumulator."""
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    denom = denom * alpha + p.sum(axis=1)
    return p, m_new, denom, acc * lax.broadcast_in_dim(alpha, acc.shape, [0])


def _init_carry(head_dim):
    return (plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((ROWS,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))


def _key_loops(step, it, carry, window):
    """Run `step(b, carry, masked)` over the item's key blocks: masked ones at the window's edge,
    unmasked ones, then masked ones at the causal edge."""
    if window is not None:
        carry = lax.fori_loop(it.blk_lo, it.blk_a, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(it.blk_a, it.blk_b, functools.partial(step, masked=False), carry)
    return lax.fori_loop(it.blk_b, it.blk_hi, functools.partial(step, masked=True), carry)


def _normalise(acc, denom, dim=0):
    """acc over its running sums (`denom`, along acc's dimension `dim`; a row with no keys stays 0)."""
    safe = jnp.where(denom == 0.0, 1.0, denom)
    return acc / lax.broadcast_in_dim(safe, acc.shape, [dim]), safe


# 8-bit caches: blocks are converted to f16 (in shared memory, or K into registers in the transposed
# kernel) and multiplied in f16 (with Q and P in f16): 8-bit floats convert to f16 in one instruction (to
# bf16 only through f32 with this ptxas), and this load layout was the fastest of WGMMA, WGMMA_8BIT and
# WGMMA_UPCAST_2X on an H200 (RESULTS.md, session 9).
FP8_LOAD_LAYOUT = plgpu.Layout.WGMMA_UPCAST_2X


def _upcast(ref):
    """An 8-bit tile in shared memory, in registers as f16."""
    return plgpu.load(ref, layout=FP8_LOAD_LAYOUT).astype(jnp.float16)


def _kernel(meta_ref, q_ref, kv_ref, *refs, num_items, num_seqs_max, pages_per_seq, splits, block_q, block_kv,
            num_stages, page_size, sm_scale, soft_cap, window):
    """One warpgroup per program: it issues the copies and computes. With an 8-bit cache it converts
    each block to f16 in two more shared-memory tiles and refills the slot at once. Q may come in f16
    already (the mixed launch's, shared with its transposed items) while the result is in o_ref's dtype:
    then Q's buffer is a union of the two."""
    refs = list(refs)
    convert = kv_ref.dtype != q_ref.dtype
    kc_smem, vc_smem = (refs.pop(-3), refs.pop(-3)) if convert else (None, None)
    if splits == 1:
        o_ref, q_buf, k_smem, v_smem, q_bar, kv_bars = refs
    else:
        o_ref, lse_ref, q_buf, k_smem, v_smem, o_smem, lse_smem, q_bar, kv_bars = refs
    # Q in, the result out: one buffer, or a union of two dtypes (`_block_scratch`)
    q_smem, r_smem = q_buf if splits == 1 and q_ref.dtype != o_ref.dtype else (q_buf, q_buf)
    h = lax.axis_index("head")
    split = lax.axis_index("split")
    it = _Item(meta_ref, lax.axis_index("item"), split, num_items=num_items,
               num_seqs_max=num_seqs_max, block_kv=block_kv, splits=splits, window=window)
    num_tokens, _, group, head_dim = q_ref.shape
    dtype = q_ref.dtype
    copy = functools.partial(_copy_pages, meta_ref, kv_ref, it=it, h=h, pages_at=3 * num_items + 2 * num_seqs_max + 1,
                             pages_per_seq=pages_per_seq, page_size=page_size)

    def issue(b, slot):
        copy(b=b, dsts=((0, k_smem.at[slot], kv_bars.at[slot]), (1, v_smem.at[slot], kv_bars.at[slot])))

    @pl.when(it.n_tok > 0)
    def _():
        for j in range(block_q):  # rows past the block's tokens: never stored
            row = jnp.minimum(it.q_start + j, num_tokens - 1)
            plgpu.copy_gmem_to_smem(q_ref.at[row, h], q_smem.at[pl.ds(j * group, group)], q_bar)
        for i in range(num_stages):
            pl.when(it.blk_lo + i < it.blk_hi)(functools.partial(issue, it.blk_lo + i, i))
        plgpu.barrier_wait(q_bar)
        q = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA)  # rows past the group: never stored
        mm_dtype = jnp.float16 if convert else dtype
        if convert and q.dtype != mm_dtype:  # saturated to f16's range
            q = saturate(q, mm_dtype)
        row_group = group if block_q > 1 or window is not None else None

        def step(b, carry, masked):
            acc, m, denom = carry
            slot = lax.rem(b - it.blk_lo, num_stages)
            plgpu.barrier_wait(kv_bars.at[slot])

            def refill():
                pl.when(b + num_stages < it.blk_hi)(functools.partial(issue, b + num_stages, slot))

            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            if convert:
                kc_smem[...] = _upcast(k_tile)
                vc_smem[...] = _upcast(v_tile)
                plgpu.commit_smem()  # (also: every thread's reads of the slot are done)
                refill()
                k_tile, v_tile = kc_smem, vc_smem

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q, k_tile.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
            s = _scores(s, b, it, masked=masked, first_pos=it.pos, group=row_group, block_kv=block_kv,
                        sm_scale=sm_scale, soft_cap=soft_cap, window=window)
            if masked:
                _zero_masked_v(v_tile, b, it, block_kv)
            p, m, denom, acc = _softmax(s, m, denom, acc)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(mm_dtype), v_tile)

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            if not convert:
                refill()
            return acc, m, denom

        acc, m, denom = _key_loops(step, it, _init_carry(head_dim), window)
        out, safe = _normalise(acc, denom)
        if splits == 1:
            r_smem[...] = out.astype(r_smem.dtype)  # Q is in registers
        else:
            o_smem[...] = out
            lse_smem[...] = jnp.where(denom > 0.0, m + jnp.log2(safe), -jnp.inf)
        plgpu.commit_smem()

        def store(j):
            rows = pl.ds(j * group, group)
            if splits == 1:
                plgpu.copy_smem_to_gmem(r_smem.at[rows], o_ref.at[it.q_start + j, h])
            else:
                plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[split, it.q_start + j, h])
                plgpu.copy_smem_to_gmem(lse_smem.at[rows], lse_ref.at[split, it.q_start + j, h])

        for j in range(block_q):
            pl.when(j < it.n_tok)(functools.partial(store, j))
        plgpu.wait_smem_to_gmem(0)


def _kernel_t(meta_ref, q_ref, kv_ref, *refs, num_items, num_seqs_max, pages_per_seq, splits, block_kv,
              num_stages, page_size, sm_scale, soft_cap, window, group, per_slab):
    """Transposed, for one-token query blocks: the block's keys are the wgmma's rows and the token's
    query heads its columns: a slab of Q rows holding `per_slab` kv heads' groups (the other heads'
    columns are computed and never stored), or one group padded to a multiple of 8.
    Per key block: S^T = K Q^T [block_kv, cols], a softmax down the columns (running sums kept per key
    row, reduced once at the end), P^T to shared memory, then O^T += V^T P^T [head_dim, cols]."""
    refs = list(refs)
    convert = kv_ref.dtype != q_ref.dtype
    q_bar, kv_bars = refs[-2:]
    refs = refs[:-2]
    if splits == 1:
        (o_ref, q_smem, *slots, p_smem, o_smem), lse_ref, lse_smem = refs, None, None
    else:
        o_ref, lse_ref, q_smem, *slots, p_smem, o_smem, lse_smem = refs
    if convert:  # one union: each stage's 8-bit K and V, or that stage's V in f16
        (kv8, vc), = slots
        k_at, v_at = (lambda slot: kv8.at[slot, 0]), (lambda slot: kv8.at[slot, 1])
    else:
        k_smem, v_smem = slots
        k_at, v_at = (lambda slot: k_smem.at[slot]), (lambda slot: v_smem.at[slot])
    h = lax.axis_index("head")
    split = lax.axis_index("split")
    it = _Item(meta_ref, lax.axis_index("item"), split, num_items=num_items,
               num_seqs_max=num_seqs_max, block_kv=block_kv, splits=splits, window=window)
    cols, head_dim = q_smem.shape
    pages_at = 3 * num_items + 2 * num_seqs_max + 1
    copy = functools.partial(_copy_pages, meta_ref, kv_ref, it=it, h=h, pages_at=pages_at,
                             pages_per_seq=pages_per_seq, page_size=page_size)

    def issue(b, slot, pages=None):
        copy(b=b, dsts=((0, k_at(slot), kv_bars.at[slot]), (1, v_at(slot), kv_bars.at[slot])), pages=pages)

    @pl.when(it.n_tok > 0)
    def _():
        with jax.named_scope("prologue"):
            plgpu.copy_gmem_to_smem(q_ref.at[it.q_start, h // per_slab], q_smem, q_bar)
            for i in range(num_stages):
                pl.when(it.blk_lo + i < it.blk_hi)(functools.partial(issue, it.blk_lo + i, i))
            plgpu.barrier_wait(q_bar)

        def step(b, carry, masked):
            acc, m, run_sum = carry
            slot = lax.rem(b - it.blk_lo, num_stages)
            # The refill's page ids, loaded while this block's copies land.
            pages = _page_ids(meta_ref, it, b + num_stages, pages_at=pages_at, pages_per_seq=pages_per_seq,
                              pages_per_block=block_kv // page_size)
            with jax.named_scope("wait"):
                plgpu.barrier_wait(kv_bars.at[slot])
            k_tile, v_tile = k_at(slot), v_at(slot)
            if convert:  # K into registers (the wgmma's A); V in f16 over the stage's 8-bit K and V
                with jax.named_scope("convert"):
                    k_tile = plgpu.layout_cast(_upcast(k_tile), plgpu.Layout.WGMMA)
                    v_f16 = _upcast(v_tile)
                    plgpu.commit_smem()  # every thread's reads of the stage are done
                    v_tile = vc.at[slot]
                    v_tile[...] = v_f16
                    plgpu.commit_smem()

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, k_tile, q_smem.transpose((1, 0)))
                return acc_ref[...]

            with jax.named_scope("qk"):
                s = _scale(pl.run_scoped(qk, plgpu.ACC((block_kv, cols), jnp.float32)), sm_scale, soft_cap)
            if masked:
                key = b * block_kv + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                s = jnp.where((key >= it.kv_lo) & (key < it.kv_hi), s, -jnp.inf)
                _zero_masked_v(v_tile, b, it, block_kv)
            with jax.named_scope("max"):  # down the columns: across the warpgroup's four warps
                m_new = jnp.maximum(m, s.max(axis=0))
            with jax.named_scope("exp"):
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
                run_sum = run_sum * lax.broadcast_in_dim(alpha, run_sum.shape, [1]) + p
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
            with jax.named_scope("p_store"):
                p_smem.transpose((1, 0))[...] = p.astype(p_smem.dtype)
                plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, v_tile.transpose((1, 0)), p_smem.transpose((1, 0)))

            with jax.named_scope("pv"):
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            with jax.named_scope("refill"):
                pl.when(b + num_stages < it.blk_hi)(functools.partial(issue, b + num_stages, slot, pages))
            return acc, m_new, run_sum

        carry = (plgpu.layout_cast(jnp.zeros((head_dim, cols), jnp.float32), plgpu.Layout.WGMMA),
                 plgpu.layout_cast(jnp.full((cols,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(0)),
                 plgpu.layout_cast(jnp.zeros((block_kv, cols), jnp.float32), plgpu.Layout.WGMMA))
        acc, m, run_sum = _key_loops(step, it, carry, window)
        with jax.named_scope("epilogue"):
            denom = run_sum.sum(axis=0)
            out, safe = _normalise(acc, denom, dim=1)
            o_smem.transpose((1, 0))[...] = plgpu.layout_cast(out.astype(o_smem.dtype),
                                                              plgpu.Layout.WGMMA_TRANSPOSED)
            rows = pl.ds(lax.rem(h, per_slab) * group, group)
            if splits == 1:
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[it.q_start, h])
            else:
                lse_smem[...] = jnp.where(denom > 0.0, m + jnp.log2(safe), -jnp.inf)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[split, it.q_start, h])
                plgpu.copy_smem_to_gmem(lse_smem.at[rows], lse_ref.at[split, it.q_start, h])
            plgpu.wait_smem_to_gmem(0)


def _kernel_ws(meta_ref, q_ref, kv_ref, o_ref, *, num_items, num_seqs_max, pages_per_seq, block_q, block_kv,
               num_stages, page_size, sm_scale, soft_cap, window):
    """Warp-specialised: two compute warpgroups of `block_q` tokens each share every K/V block, which a
    third warpgroup copies in. The compute warpgroups take turns on the tensor cores (one's softmax
    runs under the other's matmuls), kept half a step apart by a shared barrier."""
    num_tokens, _, group, head_dim = q_ref.shape
    dtype = q_ref.dtype

    def body(q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, k_free, v_free, turn):
        wg = lax.axis_index("wg")
        h = lax.axis_index("head")
        it = _Item(meta_ref, num_items - 1 - lax.axis_index("item"), 0, num_items=num_items,
                   num_seqs_max=num_seqs_max, block_kv=block_kv, splits=1, window=window)

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when((it.n_tok > 0) & (wg == 2))
        def _copier():
            plgpu.set_max_registers(40, action="decrease")
            copy = functools.partial(_copy_pages, meta_ref, kv_ref, it=it, h=h, pages_per_seq=pages_per_seq,
                                     pages_at=3 * num_items + 2 * num_seqs_max + 1, page_size=page_size)

            def issue(b, slot, wait):
                if wait:  # until both compute warpgroups are done with the slot's previous block
                    plgpu.barrier_wait(k_free.at[slot])
                copy(b=b, dsts=((0, k_smem.at[slot], k_bars.at[slot]),))
                if wait:
                    plgpu.barrier_wait(v_free.at[slot])
                copy(b=b, dsts=((1, v_smem.at[slot], v_bars.at[slot]),))

            for i in range(num_stages):
                pl.when(it.blk_lo + i < it.blk_hi)(functools.partial(issue, it.blk_lo + i, i, False))

            @pl.loop(it.blk_lo + num_stages, it.blk_hi)
            def _(b):
                issue(b, lax.rem(b - it.blk_lo, num_stages), True)

        first = wg * block_q  # this warpgroup's tokens: [first, first + mine) of the item's
        mine = jnp.clip(it.n_tok - first, 0, block_q)

        @pl.when((it.n_tok > 0) & (wg < 2))
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            pl.when(wg == 1)(take_turn)  # half a step behind warpgroup 0

            @pl.when(mine == 0)
            def _idle():  # no tokens here (a short item): keep the barriers' counts
                @pl.loop(it.blk_lo, it.blk_hi)
                def _(b):
                    slot = lax.rem(b - it.blk_lo, num_stages)
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    take_turn()
                    take_turn()

            @pl.when(mine > 0)
            def _work():
                q_mine = q_smem.at[wg]
                for j in range(block_q):  # rows past the tokens: never stored
                    row = jnp.minimum(it.q_start + first + j, num_tokens - 1)
                    plgpu.copy_gmem_to_smem(q_ref.at[row, h], q_mine.at[pl.ds(j * group, group)], q_bars.at[wg])
                plgpu.barrier_wait(q_bars.at[wg])
                q = plgpu.load(q_mine, layout=plgpu.Layout.WGMMA)
                # (The padding segment's items see no keys: no block comes.)
                pl.when(it.blk_hi > it.blk_lo)(lambda: plgpu.barrier_wait(k_bars.at[0]))

                def step(b, carry, masked):
                    acc, m, denom = carry
                    slot = lax.rem(b - it.blk_lo, num_stages)

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q, k_smem.at[slot].transpose((1, 0)))
                        take_turn()
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    s = _scores(s, b, it, masked=masked, first_pos=it.pos + first, group=group,
                                block_kv=block_kv, sm_scale=sm_scale, soft_cap=soft_cap, window=window)
                    p, m, denom, acc = _softmax(s, m, denom, acc)
                    p = p.astype(dtype)
                    acc, m, denom, p = lax.optimization_barrier((acc, m, denom, p))
                    plgpu.barrier_arrive(turn)
                    plgpu.barrier_wait(v_bars.at[slot])
                    if masked:  # both compute warpgroups write the same zeros
                        _zero_masked_v(v_smem.at[slot], b, it, block_kv)
                    plgpu.barrier_wait(turn)

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p, v_smem.at[slot])

                        @pl.when(b + 1 < it.blk_hi)
                        def _():
                            plgpu.barrier_wait(k_bars.at[lax.rem(b + 1 - it.blk_lo, num_stages)])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m, denom

                acc, _, denom = _key_loops(step, it, _init_carry(head_dim), window)
                out, _ = _normalise(acc, denom)
                q_mine[...] = out.astype(dtype)  # Q is in registers
                plgpu.commit_smem()
                for j in range(block_q):
                    pl.when(j < mine)(lambda j=j: plgpu.copy_smem_to_gmem(
                        q_mine.at[pl.ds(j * group, group)], o_ref.at[it.q_start + first + j, h]))
                plgpu.wait_smem_to_gmem(0)

            pl.when(wg == 0)(take_turn)

    pages = block_kv // page_size
    pl.run_scoped(
        body,
        plgpu.SMEM((2, ROWS, head_dim), dtype), _tiled((num_stages, block_kv, head_dim), dtype),
        _tiled((num_stages, block_kv, head_dim), dtype),
        plgpu.Barrier(num_arrivals=block_q, num_barriers=2),
        plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )


def _tiled(shape, dt):
    bits = jnp.dtype(dt).itemsize * 8
    transforms = (plgpu.TilingTransform((8, SWIZZLE * 8 // bits)), plgpu.SwizzleTransform(SWIZZLE))
    return plgpu.SMEM(shape, dt, transforms=transforms)


def ragged_attention_mosaic(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                            sliding_window=None, soft_cap=None, config: MosaicConfig | None = None, out_dtype=None):
    """Same contract as `reference.ragged_paged_attention`; one program per (query block, kv head, split). The
    result is in `out_dtype` (default q's): the transposed launches write it so (an 8-bit cache's f16 queries give
    a bf16 result without a pass of their own), the others convert it after."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_pages, page_size, _ = kv_cache.shape
    num_seqs_max, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    fp8_cache = is_fp8(kv_cache.dtype)
    config = config or tuned_config(num_tokens, num_seqs_max, num_kv_heads, pages_per_seq * page_size, head_dim,
                                    fp8_cache=fp8_cache)
    block_q = config.block_q or max(1, ROWS // group)
    wgs = config.compute_warpgroups
    if (not supports(q.dtype, head_dim, group, page_size, config.block_kv, kv_dtype=kv_cache.dtype)
            or block_q * group > ROWS or (wgs == 2 and (head_dim > 128 or fp8_cache))):
        raise ValueError(f"ragged_paged_attention: `config` {config} asks for the Mosaic GPU kernel, which needs "
                         f"bf16/f16, head_dim a multiple of 64 (<= 256; <= 128 with two compute warpgroups), a GQA "
                         f"group that is a multiple of 4, page_size a multiple of 8, block_kv a multiple of 64 and "
                         f"of page_size, and block_q x group <= {ROWS}; an 8-bit cache needs head_dim a multiple of "
                         f"128 and one compute warpgroup; got {q.dtype} (cache {kv_cache.dtype}), head_dim "
                         f"{head_dim}, group {group}, page_size {page_size}")
    splits, stages, block_kv = config.num_kv_splits, config.num_stages, config.block_kv
    if config.transposed and block_q > 1 and splits > 1:
        raise ValueError(f"ragged_paged_attention: `config` {config} splits keys, which the transposed kernel "
                         f"does only with one-token blocks (block_q 1)")
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
    result = jax.ShapeDtypeStruct(qg.shape, out_dtype)  # what the transposed launches' results are typed from
    if config.transposed and block_q > 1:
        items, num_long = mixed_items(cu_q_lens, num_seqs, num_tokens, block_q)
    else:
        items = work_items(cu_q_lens, num_seqs, num_tokens, block_q * wgs)
    num_items = items[0].shape[0]
    # One int32 array for all metadata: a fresh buffer (the kernel needs 256-byte aligned inputs, and
    # the engine's metadata are slices of one packed buffer).
    meta = jnp.concatenate([*items, kv_lens, cu_q_lens, page_indices.reshape(-1)])
    static = dict(num_items=num_items, num_seqs_max=num_seqs_max, pages_per_seq=pages_per_seq, block_q=block_q,
                  block_kv=block_kv, num_stages=stages, page_size=page_size, sm_scale=float(sm_scale),
                  soft_cap=None if soft_cap is None else float(soft_cap),
                  window=None if sliding_window is None else int(sliding_window))
    static_t = {k: v for k, v in static.items() if k != "block_q"}
    params = plgpu.CompilerParams(approx_math=True, **_profiler_params(config, pages_per_seq * page_size))
    if wgs == 2:
        # Heads vary fastest and items run last first: the items with the most keys start first.
        out = plgpu.kernel(
            functools.partial(_kernel_ws, **static), out_type=jax.ShapeDtypeStruct(qg.shape, q.dtype),
            grid=(num_kv_heads, num_items), grid_names=("head", "item"), num_threads=3, thread_name="wg",
            compiler_params=params,
        )(meta, qg, kv_cache)
        return out.astype(out_dtype).reshape(num_tokens, num_q_heads, head_dim)

    if config.transposed and block_q == 1:  # every item one token (decode buckets)
        qs, per_slab = _transposed_q(q, num_kv_heads, kv_cache.dtype)
        out_type, scratch = _transposed_scratch(qs, result, kv_cache.dtype, splits, block_kv, stages, page_size)
        res = plgpu.kernel(
            functools.partial(_kernel_t, splits=splits, group=group, per_slab=per_slab, **static_t),
            out_type=out_type, scratch_types=scratch, grid=(num_items, num_kv_heads, splits),
            grid_names=("item", "head", "split"), compiler_params=params,
        )(meta, qs, kv_cache)
    elif config.transposed:  # prompt blocks, then the decode tokens' items transposed, in one launch
        qs, per_slab = _transposed_q(q, num_kv_heads, kv_cache.dtype)
        _, scratch_t = _transposed_scratch(qs, result, kv_cache.dtype, 1, block_kv, stages, page_size)
        # The blocks read the items' Q where its slabs are whole groups (no padding): one f16 Q for the launch,
        # which the model's RoPE kernel writes in f16 already (`attention_q_dtype`), else converted here once.
        q_blocks = qs.reshape(qg.shape) if qs.size == qg.size else qg
        out_type, scratch_1 = _block_scratch(result, kv_cache.dtype, 1, block_q, block_kv, stages, page_size,
                                             q_dtype=q_blocks.dtype)
        res = plgpu.kernel(
            functools.partial(_kernel_mixed, num_long=num_long, scratch_1=scratch_1, scratch_t=scratch_t,
                              kw_1=dict(splits=1, **static), kw_t=dict(splits=1, group=group, per_slab=per_slab,
                                                                       **static_t)),
            out_type=out_type, grid=(num_items, num_kv_heads, 1), grid_names=("item", "head", "split"),
            compiler_params=params,
        )(meta, q_blocks, qs, kv_cache)
    else:
        out_type, scratch = _block_scratch(qg, kv_cache.dtype, splits, block_q, block_kv, stages, page_size)
        res = plgpu.kernel(
            functools.partial(_kernel, splits=splits, **static), out_type=out_type, scratch_types=scratch,
            grid=(num_items, num_kv_heads, splits), grid_names=("item", "head", "split"), compiler_params=params,
        )(meta, qg, kv_cache)
    out = res if splits == 1 else merge_splits(*res)
    return out.astype(out_dtype).reshape(num_tokens, num_q_heads, head_dim)


PROFILED_REGIONS_PER_BLOCK = 8  # named regions per key block in `_kernel_t` (wait ... refill)


def _profiler_params(config: MosaicConfig, max_kv_len: int) -> dict:
    """`plgpu.CompilerParams` settings for `config.profile_dir`: room for every region of a program
    with the most key blocks (traces that would overflow are cut short, not written past the buffer)."""
    if config.profile_dir is None:
        return {}
    blocks = -(-max_kv_len // config.block_kv) + 1
    per_program = 4  # prologue, epilogue and the profiler's own, with one to spare
    return dict(profile_space=PROFILED_REGIONS_PER_BLOCK * blocks + per_program, profile_dir=config.profile_dir,
                profile_bounds_check=True)


def mixed_items(cu_q_lens, num_seqs, num_tokens: int, block_q: int):
    """`_kernel_mixed`'s work items `(seq, q_start, q_end)` and how many of them come first as query
    blocks: block_q-token blocks of the sequences with more than one query token (and the padding
    segment), then one item per sequence row for the sequences of one query token (decodes)."""
    long = work_items(cu_q_lens, num_seqs, num_tokens, block_q, select="long")
    short = work_items(cu_q_lens, num_seqs, num_tokens, 1, select="short", num_items=cu_q_lens.shape[0] - 1)
    return tuple(jnp.concatenate(pair) for pair in zip(long, short)), long[0].shape[0]


def _kernel_mixed(meta_ref, q_ref, qs_ref, kv_ref, o_ref, *, num_long, scratch_1, scratch_t, kw_1, kw_t):
    """Items [0, num_long) are query blocks (`_kernel`), the others one decode token each (`_kernel_t`);
    each branch holds its own shared memory (the launch takes the larger)."""
    item = lax.axis_index("item")
    pl.when(item < num_long)(lambda: pl.run_scoped(
        lambda *scratch: _kernel(meta_ref, q_ref, kv_ref, o_ref, *scratch, **kw_1), *scratch_1))
    pl.when(item >= num_long)(lambda: pl.run_scoped(
        lambda *scratch: _kernel_t(meta_ref, qs_ref, kv_ref, o_ref, *scratch, **kw_t), *scratch_t))


def _block_scratch(qg, kv_dtype, splits, block_q, block_kv, stages, page_size, q_dtype=None):
    """Output types and shared memory of `_kernel`. Q (`q_dtype`, by default qg's) lands untiled (a TMA
    copy per token of just the group's rows) and goes to registers as the wgmma's A; the result leaves
    through the same buffer (a union where Q's dtype is not the result's; f32 results through their own)."""
    head_dim = qg.shape[-1]
    q_buf = plgpu.SMEM((ROWS, head_dim), q_dtype or qg.dtype)
    if splits == 1 and jnp.dtype(q_dtype or qg.dtype) != jnp.dtype(qg.dtype):
        q_buf = plgpu.RefUnion(q_buf, plgpu.SMEM((ROWS, head_dim), qg.dtype))
    scratch = [q_buf, _tiled((stages, block_kv, head_dim), kv_dtype), _tiled((stages, block_kv, head_dim), kv_dtype)]
    if splits > 1:
        scratch += [plgpu.SMEM((ROWS, head_dim), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32)]
    if is_fp8(kv_dtype):  # the block converted for the wgmma: K, V
        scratch += [_tiled((block_kv, head_dim), jnp.float16)] * 2
    scratch += [plgpu.Barrier(num_arrivals=block_q),
                plgpu.Barrier(num_arrivals=2 * (block_kv // page_size), num_barriers=stages)]
    return _out_type(qg, splits), scratch


def _out_type(qg, splits):
    """The launch's results: `[T, Hkv, G, D]` in q's dtype, or with key splits f32 partial results
    `[splits, T, Hkv, G, D]` and their base-2 log-sum-exps `[splits, T, Hkv, G]` (`blocks.merge_splits`)."""
    if splits == 1:
        return jax.ShapeDtypeStruct(qg.shape, qg.dtype)
    return (jax.ShapeDtypeStruct((splits, *qg.shape), jnp.float32),
            jax.ShapeDtypeStruct((splits, *qg.shape[:-1]), jnp.float32))


def _transposed_q(q, num_kv_heads, kv_dtype):
    """Q for `_kernel_t` as slabs [T, slabs, cols, D], each one bulk copy into a tiled wgmma operand
    (cols: the group rounded up to the wgmma's multiple of 8): `cols` consecutive query heads where
    that covers whole groups (group 4: two kv heads'), else each group padded to `cols` rows. Returns
    the slabs and the kv heads per slab. 8-bit caches: in f16, saturated to its range."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    cols = -(-group // 8) * 8
    if is_fp8(kv_dtype):
        q = saturate(q, jnp.float16)  # nothing to do where Q comes in f16 (`attention_q_dtype`)
    if cols % group == 0 and num_q_heads % cols == 0:
        return q.reshape(num_tokens, num_q_heads // cols, cols, head_dim), cols // group
    q = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    return jnp.pad(q, ((0, 0), (0, 0), (0, cols - group), (0, 0))), 1


def _transposed_scratch(qs, qg, kv_dtype, splits, block_kv, stages, page_size):
    """Output types and shared memory of `_kernel_t`: Q and P^T tiled (wgmma operands), the result
    untiled (copied out by rows), V converted to the matmul's dtype when the cache is 8-bit."""
    cols, head_dim = qs.shape[-2:]
    mm_dtype = qs.dtype
    if mm_dtype == kv_dtype:
        slots = [_tiled((stages, block_kv, head_dim), kv_dtype)] * 2  # K, V
    else:  # 8-bit K and V of a stage, or its V converted for the wgmma (K goes to registers)
        slots = [plgpu.RefUnion(_tiled((stages, 2, block_kv, head_dim), kv_dtype),
                                _tiled((stages, block_kv, head_dim), mm_dtype))]
    scratch = [_tiled((cols, head_dim), mm_dtype), *slots, _tiled((cols, block_kv), mm_dtype)]
    if splits == 1:
        scratch += [plgpu.SMEM((cols, head_dim), qg.dtype)]
    else:
        scratch += [plgpu.SMEM((cols, head_dim), jnp.float32), plgpu.SMEM((cols,), jnp.float32)]
    scratch += [plgpu.Barrier(num_arrivals=1),
                plgpu.Barrier(num_arrivals=2 * (block_kv // page_size), num_barriers=stages)]
    return _out_type(qg, splits), scratch
