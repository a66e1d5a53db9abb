"""How the GPU attention kernels (the Triton one in `gpu.py`, the Mosaic GPU one in `gpu_mosaic.py`) cut a ragged
batch into work items and key blocks, and merge the partial results of key splits. Plain jnp, no kernel backend:
the Mosaic GPU kernel must not depend on the Triton lowering, which JAX has deprecated."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)
M_INIT = -1e30  # finite, so rows that see no key keep exp2(s - m) = 0 for masked (-inf) logits
NUM_SMS = 132  # the H100/H200's: launch sizes that fill every SM twice are tuned against it


def is_decode_bucket(num_tokens: int, num_seqs_max: int) -> bool:
    """Whether a bucket of T tokens and S sequence rows is decode-shaped (T <= 2 S): one decode launch."""
    return num_tokens <= 2 * num_seqs_max


def work_items(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, block_q: int, *,
               select: str = "all", short_len: int = 1, num_items: int | None = None):
    """Query blocks `(seq, q_start, q_end)`, each `[num_items]` int32 (default cdiv(T, block_q) + S + 1).

    seq = -1 marks the padding segment (tokens past cu_q_lens[num_seqs]) and unused entries.
    select: "all" segments; "short" = sequences with 1..short_len query tokens; "long" = the others,
    padding segment included.
    """
    s = cu_q_lens.shape[0] - 1
    n = num_seqs[0]
    idx = jnp.arange(s + 1, dtype=jnp.int32)
    cu_next = jnp.append(cu_q_lens[1:], num_tokens)
    seg_start = jnp.where(idx <= n, cu_q_lens, num_tokens)
    seg_end = jnp.where(idx < n, cu_next, num_tokens)
    seg_end = jnp.maximum(seg_end, seg_start)
    count = (seg_end - seg_start + block_q - 1) // block_q
    if select != "all":
        length = seg_end - seg_start
        short = (idx < n) & (length >= 1) & (length <= short_len)
        count = jnp.where(short if select == "short" else ~short, count, 0)
    ends = jnp.cumsum(count)
    if num_items is None:
        num_items = -(-num_tokens // block_q) + s + 1
    i = jnp.arange(num_items, dtype=jnp.int32)
    # compare_all: a handful of vector ops; the default binary search is a device while-loop.
    seg = jnp.minimum(jnp.searchsorted(ends, i, side="right", method="compare_all"), s).astype(jnp.int32)
    local = i - (ends[seg] - count[seg])
    used = i < ends[-1]
    q_start = jnp.where(used, seg_start[seg] + local * block_q, 0)
    q_end = jnp.where(used, jnp.minimum(q_start + block_q, seg_end[seg]), 0)
    seq = jnp.where(used & (seg < n), seg, -1)
    return seq.astype(jnp.int32), q_start.astype(jnp.int32), q_end.astype(jnp.int32)


def key_blocks(kv_len, first_pos, n_tok, *, window, block_kv, splits, split):
    """The keys `[kv_lo, kv_hi)` that query tokens `[first_pos, first_pos + n_tok)` of a sequence with
    kv_len keys see (causal, optional window), and the key blocks `[blk_lo, blk_hi)` of split `split`
    of `splits` (blk_hi may fall below blk_lo when a split gets none). Scalars, in either kernel."""
    kv_hi = jnp.where(n_tok > 0, jnp.maximum(jnp.minimum(kv_len, first_pos + n_tok), 0), 0)
    kv_lo = 0 if window is None else jnp.maximum(first_pos - window + 1, 0)
    blk_lo = kv_lo // block_kv
    blk_hi = (kv_hi + block_kv - 1) // block_kv
    if splits > 1:
        per = (jnp.maximum(blk_hi - blk_lo, 0) + splits - 1) // splits
        blk_lo = blk_lo + split * per
        blk_hi = jnp.minimum(blk_lo + per, blk_hi)
    return kv_lo, kv_hi, blk_lo, blk_hi


def merge_splits(o, lse):
    """o [N, T, Hkv, G, D] f32 normalised per split, lse [N, T, Hkv, G] (base 2) -> [T, Hkv, G, D]."""
    top = lse.max(axis=0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    den = w.sum(axis=0)
    return (w[..., None] * o).sum(axis=0) / jnp.where(den == 0.0, 1.0, den)[..., None]
