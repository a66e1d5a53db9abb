"""Bucket shapes for the jitted step: pure functions, no state.

XLA compiles one program per input shape, so the batch is padded up to one of a few sizes on each of
two axes: T, the tokens scheduled in a step, and S, the sequences in it. Powers of two keep the
number of programs logarithmic in the cap and the padding under half; the default T buckets add the
sizes halfway between from 256 tokens up (padding under a third there), and an optional linear step
above some size trades a few more programs for less waste on large batches. Bucket lists are plain sorted
tuples of ints so they can live in config files.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence


def make_buckets(cap: int, min_bucket: int = 1, linear_step: int | None = None) -> tuple[int, ...]:
    """Sizes `min_bucket, 2*min_bucket, 4*min_bucket, ...`, ending exactly at `cap`.

    With `linear_step`, doubling stops once a size reaches `linear_step` and sizes then grow by
    `linear_step` (e.g. 16, 32, ..., 512, 1024, 1536, ... for linear_step=512).
    """
    if cap < 1 or min_bucket < 1:
        raise ValueError(f"bucket cap and min_bucket must be >= 1, got cap={cap}, min_bucket={min_bucket}")
    if linear_step is not None and linear_step < 1:
        raise ValueError(f"linear_step must be >= 1 or None, got {linear_step}")
    sizes = []
    size = min(min_bucket, cap)
    while size < cap:
        sizes.append(size)
        if linear_step is not None and size >= linear_step:
            size += linear_step
        else:
            size *= 2
    sizes.append(cap)
    return tuple(sizes)


# From this many tokens up, the default T buckets add a size halfway between powers of two (384, 768, 1536,
# ...): steps that large are compute-bound, so their padding costs its share of the step's time, and mixed
# steps (decodes plus whatever prompt work is queued) land anywhere between the powers. On an H200 the 8B
# chat-like offline run (1,000 requests) took 26.5 s against 27.9 s (+5.2% output tok/s) for 4 more forward
# programs (cold start 47.7 against 44.2 s; RESULTS.md, session 50).
HALF_STEPS_FROM = 256


def default_token_buckets(max_num_batched_tokens: int, min_bucket: int = 8,
                          linear_step: int | None = None) -> tuple[int, ...]:
    """Buckets for T, the tokens of one step (8, 16, 32, ..., 256, 384, 512, 768, ... up to
    max_num_batched_tokens: powers of two, and 1.5 times each from `HALF_STEPS_FROM` up; with
    `linear_step`, `make_buckets`' sizes alone).

    The 8-token bucket is for decodes of up to 8 sequences: there attention splits each sequence's keys
    4 ways rather than 2 (`gpu_mosaic.tuned_config` counts the bucket's tokens), one 64-key block per
    program at 256 tokens. On an H200 the 8B model's batch-1 attention took 4.9 µs + a 1.4 µs fusion per
    layer against 8.5 µs in a 16-token bucket, and the step 4.47 ms against 4.51 (means over three
    machines, RESULTS.md session 33)."""
    sizes = make_buckets(max_num_batched_tokens, min_bucket, linear_step)
    if linear_step is not None:  # linear steps above some size instead
        return sizes
    halves = {s + s // 2 for s in sizes if s >= HALF_STEPS_FROM and s + s // 2 < max_num_batched_tokens}
    return tuple(sorted(set(sizes) | halves))


def default_seq_buckets(max_num_seqs: int, min_bucket: int = 8) -> tuple[int, ...]:
    """Buckets for S, the sequences of one step (8, 16, ... up to max_num_seqs; at least `min_bucket`).

    A padded sequence costs one empty row of metadata, so coarse buckets are cheap here. Below 8 rows an
    8-token step would not be decode-shaped (`is_decode_bucket`: T <= 2 S) and its attention would take the
    query-block kernel: with `max_num_seqs=1` the 8B model's batch-1 attention took 8.8 µs a layer against
    4.9 µs plus a 1.3 µs merge of its key splits in the decode kernel (H200 profiles, RESULTS.md session 43),
    so S never goes below 8.
    """
    return make_buckets(max(max_num_seqs, min_bucket), min_bucket)


def normalize_buckets(values: Iterable[int], cap: int | None = None) -> tuple[int, ...]:
    """Validate a user-given bucket list: positive ints, sorted, unique; `cap` appended if missing."""
    sizes = sorted(set(values))
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in sizes):
        raise ValueError(f"bucket sizes must be positive integers, got {sorted(values)}")
    if cap is not None:
        if sizes and sizes[-1] > cap:
            raise ValueError(f"bucket {sizes[-1]} exceeds the cap {cap}")
        if not sizes or sizes[-1] != cap:
            sizes.append(cap)
    if not sizes:
        raise ValueError("bucket list is empty")
    return tuple(sizes)


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n. `buckets` must be sorted ascending."""
    i = bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1] if buckets else None}")
    return buckets[i]


def padding_waste(n: int, buckets: Sequence[int]) -> float:
    """Fraction of the padded size that is padding when `n` is rounded up to its bucket."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    bucket = pick_bucket(n, buckets)
    return (bucket - n) / bucket


def max_padding_waste(buckets: Sequence[int]) -> float:
    """Worst `padding_waste` over every n from 1 to the largest bucket (just above each bucket)."""
    worst = padding_waste(1, buckets)
    for b in buckets[:-1]:
        worst = max(worst, padding_waste(b + 1, buckets))
    return worst


# A step padded to T tokens gets at least T / TOKENS_PER_SEQ_ROW sequence rows. Steps with many tokens
# and few sequences (long prompt chunks) then pad their rows a little (an LM-head row costs 1/13 of a
# token's matmul FLOPs in the 8B shape, so T / 4 rows at most ~2% of the step's; plus their sampler rows),
# and the number of (T, S) programs to compile drops: 38 with no floor, 23 with T / 8, 18 with T / 4 for
# the powers of two from 16 up to 2048 tokens / 256 sequences (cold warm-up of the 8B buckets on an H200:
# 69.9 s with T / 8, 52.7 s with T / 4). Today's default buckets make 23: 8 to 2048 with 384, 768 and 1536.
TOKENS_PER_SEQ_ROW = 4


def seq_bucket(num_seqs: int, num_tokens_padded: int, seq_buckets: Sequence[int]) -> int:
    """The sequence-row bucket of a step with `num_seqs` sequences padded to `num_tokens_padded` tokens."""
    floor = min(num_tokens_padded // TOKENS_PER_SEQ_ROW, seq_buckets[-1])
    return pick_bucket(max(num_seqs, floor), seq_buckets)


def shape_pairs(token_buckets: Sequence[int], seq_buckets: Sequence[int]) -> list[tuple[int, int]]:
    """Every (T, S) bucket pair a step can land on, for ahead-of-time compilation.

    Each sequence brings at least one token, so a step padded to T has at most T sequences: S ranges
    from `seq_bucket(1, T)` up to the bucket of min(T, largest S).
    """
    pairs = []
    for t in token_buckets:
        s_min = seq_bucket(1, t, seq_buckets)
        s_max = pick_bucket(min(t, seq_buckets[-1]), seq_buckets)
        pairs.extend((t, s) for s in seq_buckets if s_min <= s <= s_max)
    return pairs
