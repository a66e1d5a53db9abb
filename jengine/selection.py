"""Exact selection over the rows of an [N, V] array without sorting V (V = a vocabulary: ~10^5).

- `ordered_keys`: uint32 keys that sort like f32 values.
- `largest_key`: radix select, the largest key that a monotone per-row predicate accepts (top-k and
  top-p thresholds for any k and p: 16 passes over [N, V]).
- `top_n`: `lax.top_k` for small n, from the n chunks with the largest maxima (one pass over [N, V]
  and two sorts of small arrays; XLA's GPU TopK kernel takes k <= 16 and otherwise sorts whole rows).
- `kth_largest_key`: the k-th largest key per row for k up to a small bound, through `top_n`
  (and the ids of the bound largest).

Device-side pure functions; `jengine.sampler` uses them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

RADIX_BITS = 2  # bits of the key decided per pass of `largest_key`
RADIX_UNROLL = 4  # passes per iteration of its loop (see `largest_key`)
TOP_N_CHUNK = 128  # elements per chunk of `top_n`'s pre-selection
_SIGN = 0x80000000


def ordered_keys(x: jax.Array) -> jax.Array:
    """uint32 keys that sort like the f32 values `x` (flip negatives, set the sign bit of positives)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((bits >> 31) == 1, ~bits, bits | jnp.uint32(_SIGN))


def largest_key(pred, rows: int) -> jax.Array:
    """Radix select: the largest key tau [rows] with pred(tau) true, for pred monotone (true at 0).

    Sixteen passes of 2 bits: each tries the 3 nonzero digits at once (pred being monotone, the number
    of candidates it keeps is the largest one it keeps). Exact. The passes run in a `fori_loop` of 4
    iterations of 4 passes: its trip count is static, so a GPU runs it without reading anything back
    (unlike a `lax.cond`, whose predicate the host reads, making the launch of the step wait for the
    previous one; RESULTS.md), and the program holds 4 passes rather than 16, so it compiles in less.
    On an H200 (8B vocabulary, top-k and top-p rows; RESULTS.md sessions 24-25) 2 bits a pass beat 1
    and 4 (S=256: 2.36 ms against 3.78 and 3.07), and 4 passes an iteration ran as fast as all 16
    unrolled (S=256: 2.335 ms both; S=8: 0.23-0.26 against 0.40-0.46) in 3.1-3.5 CPU s of compile
    against 4.4-5.5 (S=8 with top logprobs: 5.9-6.1 against 8.8-9.0); 1 pass an iteration ran
    0.04-0.07 ms slower at every S.
    """

    def one_pass(i, tau):
        shift = jnp.uint32(32 - RADIX_BITS) - jnp.uint32(RADIX_BITS) * i.astype(jnp.uint32)
        digit = sum(pred(tau | (jnp.uint32(d) << shift)).astype(jnp.uint32) for d in range(1, 1 << RADIX_BITS))
        return tau | (digit << shift)

    return jax.lax.fori_loop(0, 32 // RADIX_BITS, one_pass, jnp.zeros(rows, jnp.uint32),
                             unroll=RADIX_UNROLL)


def top_n(x: jax.Array, n: int, chunk: int = TOP_N_CHUNK) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, n)` for x [N, V] of floats (NaNs counted as -inf) or int32: the same values, ids
    and tie order (equal values by lower id), ids int32.

    The row is cut into chunks of `chunk`, and only the n chunks with the largest maxima (ties by lower
    chunk) can hold the top n: a chunk ranked behind n others has, in each of them, a value that ranks
    ahead of all of its own. So one pass over x takes the chunk maxima [N, V / chunk], `lax.top_k` (a
    sort of that small array) picks n chunks, and a second one picks the top n among their n * chunk
    values, laid out in id order so that its ties go by id. On an H200 (V = 128,256, n = 20; RESULTS.md
    session 27): 0.113 ms at 256 rows against 0.72 for n max passes over x and 2.1 for `lax.top_k`;
    0.049 against 0.080 at 8 rows. Rows of fewer than 2n chunks (small vocabularies) take `lax.top_k`.
    """
    rows, V = x.shape
    if jnp.issubdtype(x.dtype, jnp.floating):
        x, lowest = jnp.where(jnp.isnan(x), -jnp.inf, x), -jnp.inf
    else:
        lowest = jnp.iinfo(x.dtype).min
    chunks = -(-V // chunk)
    if chunks < 2 * n:
        values, ids = jax.lax.top_k(x, n)
        return values, ids.astype(jnp.int32)
    # Padding: the lowest value at ids >= V, behind every real value (n <= V, so never picked).
    xc = jnp.pad(x, ((0, 0), (0, chunks * chunk - V)), constant_values=lowest).reshape(rows, chunks, chunk)
    _, picked = jax.lax.top_k(jnp.max(xc, axis=-1), n)  # [N, n]
    picked = jnp.sort(picked, axis=-1)  # the candidates in id order
    candidates = jnp.take_along_axis(xc, picked[..., None], axis=1).reshape(rows, n * chunk)
    values, place = jax.lax.top_k(candidates, n)
    ids = jnp.take_along_axis(picked, place // chunk, axis=1) * chunk + place % chunk
    return values, ids.astype(jnp.int32)


def kth_largest_key(keys: jax.Array, k: jax.Array, bound: int,
                    chunk: int = TOP_N_CHUNK) -> tuple[jax.Array, jax.Array]:
    """The k-th largest of each row's uint32 keys [N, V], exactly, for k [N] <= bound; 0 (keep
    everything) where k > bound. Through `top_n` of the keys as int32, so no pass of 16 over [N, V].
    Also returns the ids of the row's min(bound, V) largest keys [N, bound'], largest first (ties by id)."""
    bound = min(bound, keys.shape[1])
    signed = jax.lax.bitcast_convert_type(keys ^ jnp.uint32(_SIGN), jnp.int32)  # sorts like the keys
    largest, ids = top_n(signed, bound, chunk)  # [N, bound], descending
    kth = jnp.take_along_axis(largest, jnp.clip(k - 1, 0, bound - 1)[:, None], axis=1)[:, 0]
    kth = jnp.where(k <= bound, jax.lax.bitcast_convert_type(kth, jnp.uint32) ^ jnp.uint32(_SIGN), jnp.uint32(0))
    return kth, ids
