"""On-device sampling with vLLM's semantics, one fixed-shape program for every mix of options.

The host builds the inputs, a fixed-shape `SamplingTensors` pytree per step, and picks the program's
switches (`jengine.sampling_tables`). Structured outputs' token bitmask is applied first, to the logits
themselves, by a program of its own (`apply_token_bitmask`, run by `runner.ModelRunner` on guided steps only);
`sample(logits[S, V], tensors)` then applies, in vLLM's order,
    allowed_token_ids, bad words, logit_bias, min_tokens suppression of stop ids (all one bias table)
    -> repetition/presence/frequency penalties
    -> [greedy rows: argmax] -> temperature -> min_p -> top_k -> top_p -> categorical draw,
all per row in one batch.

Logprobs follow vLLM's default `logprobs_mode="raw_logprobs"`: log_softmax of the model's logits
*before* any processing (so they do not depend on temperature, penalties, filters, logit_bias,
allowed_token_ids or bad words). Pass
`logprobs_mode="processed_logprobs"` for log_softmax of the final, filtered distribution.

Randomness: each row gets its own key,
    fold_in(fold_in(PRNGKey(seed or engine_seed), stream), step)
with stream = 0 for seeded requests and 1 + a host-assigned per-request counter otherwise, and step =
the request's number of generated tokens. A seeded request therefore draws the same tokens whatever
else is in the batch and wherever its row is; keys use threefry explicitly so this holds on every
backend.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jengine.sampling_params import MAX_LOGPROBS
from jengine.sampling_tables import SMALL_TOP_K_CHUNK, SamplingTensors
from jengine.selection import kth_largest_key, largest_key, ordered_keys, top_n


class SamplerOutput(NamedTuple):
    next_ids: jax.Array  # [S] int32
    sampled_logprobs: jax.Array  # [S] f32, logprob of next_ids (raw or processed, see module doc)
    sampled_ranks: jax.Array  # [S] int32, tokens at least as likely as next_ids (vLLM's rank; 0: top logprobs off)
    topk_ids: jax.Array  # [S, MAX_LOGPROBS] int32
    topk_logprobs: jax.Array  # [S, MAX_LOGPROBS] f32


def _rows(S: int) -> jax.Array:
    return jnp.arange(S)[:, None]  # [S, 1], row index for per-row scatters


def _apply_bias_table(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Add each row's bias table to its logits; `allow_only` rows keep the table's ids only (the rest -inf).

    One gather and one scatter for both: the table's logits are read, the row masked where `allow_only`,
    and read + bias written back. Ids are unique per row, so on other rows this equals adding the bias in
    place; padding id V reads a clamped id and its write is dropped.
    """
    S, V = logits.shape
    table = jnp.take_along_axis(logits, jnp.minimum(t.bias_ids, V - 1), axis=1)  # [S, B]
    base = jnp.where(t.allow_only[:, None], -jnp.inf, logits)  # [S, V]
    return base.at[_rows(S), t.bias_ids].set(table + t.bias_values, mode="drop")


def _apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM's penalties on a gathered window of each row's seen tokens, scattered back.

    Why a [S, W] window of unique ids with counts rather than [S, V] counts: with V ~ 150k-250k an
    [S, V] count tensor is hundreds of MB per step to send (or a persistent device state the runner
    must keep in sync with preemption and slot reuse); a window is S*W*8 bytes, built by the host from
    lists it already has, and touches only W logits per row. Limit: tokens past W unique per row are
    not penalised (the builder keeps output tokens first). Ids are unique per row, so a set-scatter is
    exact; padding id V is dropped by the scatter.
    """
    S, V = logits.shape
    ids = t.penalty_ids  # [S, W]
    valid = ids < V
    g = jnp.take_along_axis(logits, jnp.minimum(ids, V - 1), axis=1)  # [S, W]
    counts = t.penalty_output_counts.astype(jnp.float32)  # [S, W]
    rep = t.repetition_penalty[:, None]
    # Repetition: every window token is in prompt or output; divide positive logits, multiply others.
    new = jnp.where(g > 0, g / rep, g * rep)
    new = new - t.frequency_penalty[:, None] * counts
    new = new - t.presence_penalty[:, None] * (counts > 0)
    new = jnp.where(valid, new, 0.0)
    return logits.at[_rows(S), ids].set(new, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where a row's bitmask `[S, ceil(V / 32)]` int32 does not allow the token (bit j of word w is
    token 32 w + j). Structured outputs mask the model's logits before everything else, raw logprobs
    included (as vLLM does, unlike logit_bias and allowed_token_ids, which leave raw logprobs alone)."""
    S, V = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(S, -1)[:, :V] != 0  # [S, V]
    return jnp.where(allowed, logits, -jnp.inf)


def _apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens whose probability is below min_p * (max probability): p_i/p_max = exp(l_i - l_max)."""
    ratio = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # [S, V]
    return jnp.where(ratio < min_p[:, None], -jnp.inf, logits)


def _apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *, filter_k: bool = True,
                       filter_p: bool = True, k_bound: int = 0, small_p: bool = False) -> jax.Array:
    """Mask tokens outside each row's top-k, then outside the top-p nucleus of the survivors.

    Exact for every k and p without sorting V: top-k keeps values >= the k-th largest; top-p keeps a
    token if the probability mass strictly above it is < p (so the top token always stays), i.e.
    probabilities >= the largest threshold whose mass at or above it reaches p. Ties at a threshold are
    all kept (vLLM breaks them by sort order); for top-p, ties are equal f32 probabilities.

    The top-p select runs on the probabilities' own bits (a non-negative f32 sorts like its bit
    pattern), so each of its passes reads one [S, V] array rather than the logits' keys and the
    probabilities: on an H200 (V = 128,256, RESULTS.md session 26) the filter took 1.62 ms at S=256
    against 2.09, 0.47 against 0.65 at S=64, with the same masks. Rows with the filters off keep everything.

    `filter_k=False` / `filter_p=False` leave out the top-k / top-p select (static: the caller knows that
    no row uses it); each is 16 passes over [S, V]. `k_bound > 0` (every row's k <= k_bound or off) finds
    the k-th largest key from the chunks that can hold it instead (`kth_largest_key`).
    `small_p=True` (with k_bound; every row with top_p < 1 has k <= k_bound) takes the top-p threshold
    from those k_bound largest logits: a top-k row's survivors past them tie with its k-th
    largest, whose mass is the least a survivor has, so a threshold above it sums only candidates' mass,
    and one at it keeps every survivor either way.
    """
    rows = logits.shape[0]
    survivors = logits
    if filter_k:
        keys = ordered_keys(logits)  # [S, V]
        if k_bound:
            tau_k, candidates = kth_largest_key(keys, top_k, k_bound, SMALL_TOP_K_CHUNK)
        else:
            tau_k = largest_key(lambda c: jnp.sum(keys >= c[..., None], axis=-1) >= top_k, rows)
        survivors = jnp.where(keys >= tau_k[:, None], logits, -jnp.inf)
    if not filter_p:
        return survivors
    mass = jax.nn.softmax(survivors, axis=-1)  # [S, V], 0 outside the top-k
    if filter_k and k_bound and small_p:
        cand = jnp.take_along_axis(mass, candidates, axis=1)  # [S, n], non-increasing
        at_or_above = jnp.sum(jnp.where(cand[:, None, :] >= cand[:, :, None], cand[:, None, :], 0.0), axis=-1)
        reach = at_or_above >= top_p[:, None]  # non-decreasing along the row: the first is the threshold
        first = jnp.argmax(reach, axis=-1)
        tau = jnp.take_along_axis(cand, first[:, None], axis=1)[:, 0]
        tau = jnp.where(jnp.any(reach, axis=-1) & (top_p < 1.0), tau, 0.0)
        return jnp.where(mass >= tau[:, None], survivors, -jnp.inf)
    mass_keys = jax.lax.bitcast_convert_type(mass, jnp.uint32)
    tau_p = largest_key(lambda c: jnp.sum(jnp.where(mass_keys >= c[..., None], mass, 0.0), axis=-1) >= top_p, rows)
    tau_p = jnp.where(top_p < 1.0, tau_p, jnp.uint32(0))
    return jnp.where(mass_keys >= tau_p[:, None], survivors, -jnp.inf)


def process_logits(logits: jax.Array, t: SamplingTensors, *, filter_k: bool = True, filter_p: bool = True,
                   k_bound: int = 0, small_p: bool = False, adjust: bool = True,
                   temper: bool = True) -> jax.Array:
    """logits [S, V] -> the distribution each row samples from [S, V] (masked tokens are -inf).

    Static choices of a caller that knows the batch (so the program has no data-dependent branch):
    `filter_k=False` / `filter_p=False` skip top-k / top-p (no row uses it), `adjust=False` the bias table and the
    penalties (no row has any), `temper=False` temperature and min_p (every row greedy, and only the
    argmax of the result is used: neither moves a row's largest logit).

    For greedy rows (temperature 1, filters off) this is the biased, penalised logits, whose argmax is
    the greedy token; filters always keep the max token, so argmax of the result is that token anyway.
    """
    logits = logits.astype(jnp.float32)
    if adjust:
        logits = _apply_penalties(_apply_bias_table(logits, t), t)
    if temper:
        logits = _apply_min_p(logits / jnp.where(t.greedy, 1.0, t.temperature)[:, None], t.min_p)
    return _apply_top_k_top_p(logits, t.top_k, t.top_p, filter_k=filter_k, filter_p=filter_p, k_bound=k_bound,
                              small_p=small_p)


def _row_keys(t: SamplingTensors) -> jax.Array:
    def one(words, stream, step):
        key = jax.random.wrap_key_data(words, impl="threefry2x32")
        return jax.random.fold_in(jax.random.fold_in(key, stream), step)

    return jax.vmap(one)(t.rng_key_words, t.rng_stream, t.rng_step)  # [S] keys


def compute_logprobs(
    logits: jax.Array, token_ids: jax.Array, num_logprobs: int = MAX_LOGPROBS
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logprob of `token_ids` [N] under logits [N, V] and its rank, plus the top `num_logprobs` (ids,
    logprobs) padded to MAX_LOGPROBS columns with id -1, logprob -inf.

    The rank is vLLM's: the number of tokens whose logprob is >= the token's own (1 = most likely; a
    tie counts the tied tokens as ahead), whether or not the token is among the top ones. With
    `num_logprobs=0` (no row asked for logprobs) neither the top ones nor the rank are computed: ranks
    are 0 and the top columns padding.

    Also serves prompt logprobs: pass the logits of prompt positions and the next prompt tokens.
    Ids are ordered by descending logprob.
    """
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [N, V]
    chosen = jnp.take_along_axis(lp, token_ids[:, None].astype(jnp.int32), axis=1)[:, 0]  # [N]
    n = min(num_logprobs, lp.shape[1])
    if n:
        top_lp, top_ids = top_n(lp, n)  # [N, n]
        ranks = jnp.sum(lp >= chosen[:, None], axis=-1, dtype=jnp.int32)  # [N]; one more read of lp
    else:
        top_lp, top_ids = jnp.zeros((lp.shape[0], 0), lp.dtype), jnp.zeros((lp.shape[0], 0), jnp.int32)
        ranks = jnp.zeros(lp.shape[0], jnp.int32)
    if n < MAX_LOGPROBS:  # fixed width MAX_LOGPROBS: pad with id -1, logprob -inf (tiny vocabularies, or n=0)
        pad = ((0, 0), (0, MAX_LOGPROBS - n))
        top_lp = jnp.pad(top_lp, pad, constant_values=-jnp.inf)
        top_ids = jnp.pad(top_ids, pad, constant_values=-1)
    return chosen, ranks, top_ids.astype(jnp.int32), top_lp


def sample(
    logits: jax.Array,
    t: SamplingTensors,
    *,
    filter_k: bool = True,
    filter_p: bool = True,
    random: bool = True,
    top_logprobs: bool = True,
    k_bound: int = 0,
    small_p: bool = False,
    logprobs_mode: str = "raw_logprobs",
) -> SamplerOutput:
    """Sample one token per row of logits [S, V] under each row's options. Jit with the keyword
    arguments static; the tensors' values never cause a recompilation. The host, which knows the
    batch, switches off what no row needs: `filter_k=False` when no row uses top-k, `filter_p=False` when
    none uses top-p (each skips a radix select, 16 passes of masked reductions over [S, V];
    `sampler_switches` keeps `filter_p` on with `filter_k`; `k_bound=SMALL_TOP_K` when every top-k row has
    k <= SMALL_TOP_K: the k-th largest from the chunks that can hold it, 0.23 ms at S=256 on an H200
    against 0.64; `small_p=True` when, besides, no row uses top-p without top-k: the top-p threshold from
    those candidates, no radix select at all, and then also with `k_bound=WIDE_TOP_K`), `random=False` when every row is
    greedy and no row has a bias table entry (logit_bias, allowed_token_ids, bad words, min_tokens) or a
    penalty (no categorical draw, and no scatters into a copy of the logits, no temperature or min_p pass:
    an argmax and a log-sum-exp of the logits),
    `top_logprobs=False` when no row asks for logprobs (no top-20 over [S, V]: 0.11 ms at S=256 on an
    H200, 0.05 at S=8, and no rank; the top ids are then -1, their logprobs -inf
    and the ranks 0). Structured outputs' bitmask is applied to `logits` before (`apply_token_bitmask`)."""
    if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
        raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {logprobs_mode!r}")
    assert logits.shape[0] == t.temperature.shape[0], (logits.shape, t.temperature.shape)
    processed = process_logits(logits, t, filter_k=filter_k, filter_p=filter_p, k_bound=k_bound, small_p=small_p,
                               adjust=random,
                               temper=random or logprobs_mode == "processed_logprobs")  # [S, V]
    next_ids = jnp.argmax(processed, axis=-1).astype(jnp.int32)  # [S]
    if random:
        drawn = jax.vmap(jax.random.categorical)(_row_keys(t), processed)  # [S]
        next_ids = jnp.where(t.greedy, next_ids, drawn).astype(jnp.int32)
    source = logits if logprobs_mode == "raw_logprobs" else processed
    chosen, ranks, top_ids, top_lp = compute_logprobs(source, next_ids, MAX_LOGPROBS if top_logprobs else 0)
    return SamplerOutput(next_ids, chosen, ranks, top_ids, top_lp)
