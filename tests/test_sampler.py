"""Sampler (the device program): exact masks and penalties on tiny logits, seeds, statistics, padding, one
compilation. The host tables it reads are tested in test_sampling_tables.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling_tables import V, tensors

from jengine.sampler import compute_logprobs, process_logits, sample
from jengine.sampling_params import SamplingParams as P
from jengine.sampling_tables import (
    SamplerSwitches,
    SamplingRow,
    build_sampling_tensors,
    sampler_switches,
)
from jengine.selection import TOP_N_CHUNK, kth_largest_key, largest_key, ordered_keys, top_n

_sample = jax.jit(sample, static_argnames=("filter_k", "filter_p", "logprobs_mode"))
_sample_as_the_runner = jax.jit(sample, static_argnames=SamplerSwitches._fields)  # with `sampler_switches`
_process = jax.jit(process_logits, static_argnames=("filter_k", "filter_p", "k_bound", "small_p"))


def kept(processed_row) -> set[int]:
    return {int(i) for i in np.flatnonzero(np.isfinite(np.asarray(processed_row)))}


def ref_filter(logits, temperature=1.0, min_p=0.0, top_k=0, top_p=1.0):
    """vLLM's filters in numpy (sort-based, as in vllm apply_top_k_top_p), returns the kept set."""
    x = np.asarray(logits, np.float64) / temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    x = np.where(probs < min_p * probs.max(), -np.inf, x)
    order = np.argsort(x)  # ascending
    xs = x[order]
    if top_k:
        xs = np.where(xs < xs[len(xs) - top_k], -np.inf, xs)
    if top_p < 1.0:
        ps = np.exp(xs - xs.max())
        ps /= ps.sum()
        mask = np.cumsum(ps) <= 1 - top_p
        mask[-1] = False
        xs = np.where(mask, -np.inf, xs)
    return {int(order[i]) for i in np.flatnonzero(np.isfinite(xs))}


def row_logits(probs):
    out = np.full(V, -30.0, np.float32)
    out[: len(probs)] = np.log(probs)
    return out


PROBS = [0.5, 0.25, 0.15, 0.1]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (dict(top_k=1), {0}),
        (dict(top_k=3), {0, 1, 2}),
        (dict(top_p=0.45), {0}),
        (dict(top_p=0.55), {0, 1}),
        (dict(top_p=0.8), {0, 1, 2}),
        # top-k first, then top-p on the renormalised survivors (2/3, 1/3): 0.6 keeps only token 0
        (dict(top_k=2, top_p=0.6), {0}),
        (dict(min_p=0.25), {0, 1, 2}),  # p >= 0.125
        (dict(min_p=0.6), {0}),
        (dict(min_p=0.25, temperature=2.0), {0, 1, 2, 3}),  # temperature before min_p flattens
    ],
)
# the radix selects, the k <= 64 one (V < 64 here), and that with top-p among its candidates
@pytest.mark.parametrize("small", [dict(), dict(k_bound=64), dict(k_bound=64, small_p=True),
                                   dict(k_bound=256, small_p=True)])
def test_filter_masks_exact_on_small_logits(params, expected, small):
    logits = np.stack([row_logits(PROBS)] * 2)
    t = tensors([P(**params), P()])
    if small.get("small_p") and not sampler_switches(t, V).small_p:
        pytest.skip("a top-p row without top-k: not a small_p batch")
    out = _process(logits, t, **small)
    assert kept(out[0]) == expected
    assert kept(out[1]) == set(range(V))  # the other row is untouched


def test_filters_match_reference_including_wide_nuclei_and_large_k():
    rng = np.random.RandomState(0)
    logits = (rng.randn(6, V) * np.array([[0.1], [3], [1], [1], [0.3], [2]])).astype(np.float32)
    params = [
        dict(top_p=0.95),  # near-flat row: a wide nucleus
        dict(top_k=10),  # a large k
        dict(top_k=3, top_p=0.7),
        dict(min_p=0.1, top_p=0.9, temperature=0.7),
        dict(top_k=12, top_p=0.99, temperature=1.5),
        dict(),
    ]
    out = np.asarray(_process(logits, tensors([P(**p) for p in params])))
    for i, p in enumerate(params):
        assert kept(out[i]) == ref_filter(logits[i], **p), p
        # a row's result is the same alone (no other row forcing or skipping the full sort)
        alone = _process(logits[i : i + 1], tensors([P(**p)]))
        np.testing.assert_array_equal(np.asarray(alone)[0], out[i])


def test_the_top_p_only_program_filters_like_the_full_one_where_no_row_uses_top_k():
    """`filter_k=False` (what `sampler_switches` picks for a batch without top-k) skips the top-k select
    and nothing else; `filter_p=False` likewise for the top-p select on a top-k-only batch."""
    rng = np.random.RandomState(1)
    logits = (rng.randn(5, V) * np.array([[0.1], [3], [1], [0.3], [2]])).astype(np.float32)
    top_p_rows = [dict(top_p=0.95), dict(top_p=0.5, temperature=0.7), dict(top_p=0.9, min_p=0.05), dict(),
                  dict(top_p=0.2)]
    top_k_rows = [dict(top_k=10), dict(top_k=1), dict(), dict(top_k=7, temperature=2.0), dict(top_k=V - 1)]
    for rows, switches in ((top_p_rows, dict(filter_k=False)), (top_k_rows, dict(filter_p=False))):
        t = tensors([P(**p) for p in rows])
        assert tuple(sampler_switches(t, V))[:2] == ((False, True) if "filter_k" in switches else (True, True))
        part = np.asarray(_process(logits, t, **switches))
        np.testing.assert_array_equal(part, np.asarray(_process(logits, t)))
        for i, p in enumerate(rows):
            assert kept(part[i]) == ref_filter(logits[i], **p), p


@pytest.mark.parametrize("kind", ["normal", "ties", "few_finite"])
def test_the_small_k_select_keeps_what_the_radix_select_keeps(kind):
    """`k_bound=SMALL_TOP_K` (every row's k <= SMALL_TOP_K) finds the k-th largest key from the chunks that
    can hold it: the same masks as the 16-pass radix select, on ties and -inf too, with and without the
    chunks."""
    from jengine.sampler import _apply_top_k_top_p
    from jengine.sampling_tables import SMALL_TOP_K

    rng = np.random.default_rng(6)
    logits = rng.standard_normal((6, 9000)).astype(np.float32)  # 71 chunks of 128 (< 2 * 64): 16 below
    if kind == "ties":
        logits = np.round(logits * 2) / 2
    if kind == "few_finite":
        logits[:, 30:] = -np.inf
    top_k = np.array([1, 7, 50, SMALL_TOP_K, 9000, 3], np.int32)  # 9000 = V: off
    keys = ordered_keys(jnp.asarray(logits))
    radix = largest_key(lambda c: jnp.sum(keys >= c[..., None], axis=-1) >= jnp.asarray(top_k), 6)
    radix = np.where(top_k < 9000, np.asarray(radix), 0)
    for chunk in (16, 10**6):  # 563 chunks (pre-selected), one chunk (the whole row)
        got, ids = jax.jit(functools.partial(kth_largest_key, bound=SMALL_TOP_K, chunk=chunk))(keys, jnp.asarray(top_k))
        np.testing.assert_array_equal(np.asarray(got), radix)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(jnp.asarray(logits), SMALL_TOP_K)[1]))
    top_p = np.array([1.0, 0.9, 0.5, 1.0, 0.8, 1.0], np.float32)
    full = _apply_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p))
    small = _apply_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p), k_bound=SMALL_TOP_K)
    np.testing.assert_array_equal(np.asarray(small), np.asarray(full))


@pytest.mark.parametrize("bound", [64, 256])
@pytest.mark.parametrize("kind", ["normal", "ties", "few_finite", "peaked"])
def test_top_p_among_the_top_k_candidates_keeps_what_the_radix_select_keeps(kind, bound):
    """`small_p` (every top-p row also has k <= the bound) takes the top-p threshold from the `bound`
    largest logits: the same masks as the two radix selects, on ties (the k-th largest tied past the
    candidates), rows with few finite logits, rows whose nucleus is one token or all of the top-k, and
    rows with neither filter; with the pre-selection of chunks (V / 64 chunks >= 2 x bound)."""
    from jengine.sampler import _apply_top_k_top_p

    rng = np.random.default_rng(7)
    rows, vocab = 12, 9000 if bound == 64 else 40000
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * rng.uniform(0.3, 4.0, (rows, 1))
    if kind == "ties":  # many tokens share each value: tie groups straddle the bound-th largest
        logits = np.round(logits * 1.5) / 1.5
    if kind == "few_finite":
        logits[:, 40:] = -np.inf
    if kind == "peaked":
        logits[:, 5] += 12.0
    top_k = np.array([1, 7, 50, bound, vocab, 3, bound // 3, bound, bound // 2, vocab, 2, bound - 31], np.int32)
    top_p = np.array([0.9, 0.9, 0.5, 0.95, 1.0, 1.0, 0.3, 0.99, 0.7, 1.0, 0.6, 0.05], np.float32)
    t = build_sampling_tensors([SamplingRow(P(top_k=int(k) if k < vocab else -1, top_p=float(p), temperature=0.7),
                                            [], []) for k, p in zip(top_k, top_p)], rows, vocab, penalty_window=8,
                               max_bias_entries=8)
    assert tuple(sampler_switches(t, vocab))[4:6] == (bound, True)
    np.testing.assert_array_equal(np.asarray(t.top_k), top_k)
    args = (jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p))
    full = np.asarray(_apply_top_k_top_p(*args))
    small = np.asarray(_apply_top_k_top_p(*args, k_bound=bound, small_p=True))
    np.testing.assert_array_equal(np.isfinite(small), np.isfinite(full))
    np.testing.assert_array_equal(small, full)
    kept_counts = np.isfinite(full).sum(axis=1)
    assert kept_counts.min() == 1  # a one-token nucleus
    assert kept_counts.max() == (40 if kind == "few_finite" else vocab)  # a row with neither filter keeps all
    if kind == "ties":  # the k = bound row with p = 0.99 keeps its k-th largest's tie group, past the candidates
        assert kept_counts[7] > bound


def test_penalties_exact():
    logits = np.array([[2.0, -1.0, 3.0, -2.0, 0.5] + [0.0] * (V - 5)], np.float32)
    p = P(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, temperature=0)
    # prompt has tokens 0 and 1, output has 2 twice and 3 once; token 4 unseen
    out = np.asarray(_process(logits, tensors([SamplingRow(p, [0, 1], [2, 3, 2])])))[0]
    expected = logits[0].copy()
    expected[0] = 2.0 / 2  # prompt only: repetition (positive -> divide)
    expected[1] = -1.0 * 2  # prompt only: repetition (negative -> multiply)
    expected[2] = 3.0 / 2 - 0.5 - 0.25 * 2
    expected[3] = -2.0 * 2 - 0.5 - 0.25 * 1
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)


def test_logit_bias_and_greedy_argmax():
    logits = np.stack([row_logits(PROBS)] * 2)
    t = tensors([P(temperature=0, logit_bias={3: 5.0, 0: -100}), P(temperature=0)])
    out = np.asarray(_process(logits, t))
    np.testing.assert_allclose(out[0, [0, 3]], logits[0, [0, 3]] + [-100, 5.0], atol=1e-6)
    np.testing.assert_array_equal(out[0, 1:3], logits[0, 1:3])
    ids = np.asarray(_sample(logits, t).next_ids)
    assert ids.tolist() == [3, 0]


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = np.stack([row_logits([0.1, 0.2, 0.7])] * 3)
    eos = (2,)
    rows = [
        SamplingRow(P(temperature=0, min_tokens=2, stop_token_ids=[1]), [], [5]),  # 1 output < 2
        SamplingRow(P(temperature=0, min_tokens=2), [], [5, 5]),  # reached
        SamplingRow(P(temperature=0, min_tokens=2, ignore_eos=True), [], []),  # eos allowed
    ]
    out = np.asarray(_process(logits, tensors(rows, eos_token_ids=eos)))
    assert np.isneginf(out[0, [1, 2]]).all() and np.isfinite(out[0, 0])
    assert np.asarray(_sample(logits, tensors(rows, eos_token_ids=eos)).next_ids).tolist() == [0, 2, 2]


def test_the_bias_table_with_allow_only_equals_a_reference_mask():
    """allowed_token_ids through the bias table (the table's logits read, the row masked, read + bias written
    back) give the logits of a plain mask: allowed ids keep theirs plus their logit_bias, allowed ids that
    min_tokens suppresses or a bad word bans are -inf, and so is every other id (a logit_bias outside the
    allowed set too); rows without allowed ids are only biased and banned."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    rows = [
        # EOS (2) suppressed (1 output < min_tokens); 9's bias is outside the allowed set
        SamplingRow(P(allowed_token_ids=[3, 5, 7, 2], logit_bias={5: 2.0, 9: 50.0}, min_tokens=3), [], [1]),
        # bad words: 11 always, 6 after 4 (the last output), 0 after 8 (not now), 13 (not allowed)
        SamplingRow(P(allowed_token_ids=[0, 4, 6, 11]), [], [4], 0, ((11,), (4, 6), (8, 0), (13,))),
        SamplingRow(P(logit_bias={1: -3.0}), [], [8], 0, ((8, 12),)),
        SamplingRow(P(), [], []),
    ]
    t = tensors(rows, eos_token_ids=(2,))
    assert np.asarray(t.allow_only).tolist() == [True, True, False, False]
    x = jnp.asarray(logits)
    allowed = jnp.ones((4, V), bool).at[:2].set(False).at[0, jnp.array([3, 5, 7, 2])].set(True)
    allowed = allowed.at[1, jnp.array([0, 4, 6, 11])].set(True)
    bias = jnp.zeros((4, V)).at[0, 5].set(2.0).at[2, 1].set(-3.0)
    banned = jnp.zeros((4, V), bool).at[0, 2].set(True).at[1, jnp.array([11, 6])].set(True).at[2, 12].set(True)
    want = jnp.where(allowed & ~banned, x + bias, -jnp.inf)
    np.testing.assert_array_equal(np.asarray(_process(logits, t)), np.asarray(want))


def test_greedy_and_random_draws_land_only_in_the_allowed_set():
    rng = np.random.default_rng(6)
    allowed = [1, 6, 10, 14]
    params = [P(temperature=0, allowed_token_ids=allowed)] + [
        P(temperature=1.5, allowed_token_ids=allowed, top_p=top_p, seed=seed)
        for seed, top_p in zip(range(7), (1.0, 1.0, 0.99, 1.0, 0.95, 1.0, 1.0))]
    drawn, greedy = set(), []
    for step in range(6):
        logits = rng.normal(size=(8, V)).astype(np.float32)
        logits[:, 0] = 10.0  # the argmax overall is never allowed
        t = tensors([SamplingRow(p, [], [1] * step) for p in params])
        ids = np.asarray(_sample_as_the_runner(logits, t, **sampler_switches(t, V)._asdict()).next_ids)
        drawn.update(ids[1:].tolist())
        greedy.append((int(ids[0]), allowed[int(np.argmax(logits[0, allowed]))]))
    assert drawn <= set(allowed) and len(drawn) > 2
    assert all(got == want for got, want in greedy)


def test_seeded_request_is_independent_of_batch_composition_and_position():
    rng = np.random.RandomState(1)
    base = rng.randn(V).astype(np.float32)
    seeded = P(seed=1234, top_p=0.95)

    def run(position, others, steps=8):
        ids = []
        for step in range(steps):
            rows = [SamplingRow(o, [1], [0] * step, 50 + j) for j, o in enumerate(others)]
            rows.insert(position, SamplingRow(seeded, [1], [0] * step))
            logits = np.concatenate([base[None], rng.randn(7, V).astype(np.float32)])
            logits[[0, position]] = logits[[position, 0]]
            ids.append(int(_sample(logits, tensors(rows, S=8)).next_ids[position]))
        return ids

    a = run(0, [])
    b = run(3, [P(), P(temperature=0), P(top_k=2), P(seed=7, top_p=0.5)])
    c = run(5, [P(top_k=12), P(min_p=0.2), P(repetition_penalty=1.5), P(), P(seed=1)])
    assert a == b == c
    assert len(set(a)) > 1  # the step is folded in: draws differ from step to step


def test_unseeded_requests_with_different_counters_draw_differently():
    logits = np.zeros((8, V), np.float32)
    rows = [SamplingRow(P(), [], [], counter) for counter in range(8)]
    ids = np.asarray(_sample(logits, tensors(rows)).next_ids)
    assert len(set(ids.tolist())) > 2


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_frequencies_match_softmax(temperature):
    n = 4000
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = np.tile(row_logits(probs), (n, 1))
    rows = [SamplingRow(P(temperature=temperature), [], [], c) for c in range(n)]
    ids = np.asarray(_sample(logits, tensors(rows)).next_ids)
    freq = np.bincount(ids, minlength=V)[: len(probs)] / n
    target = probs ** (1 / temperature) / np.sum(probs ** (1 / temperature))
    np.testing.assert_allclose(freq, target, atol=0.03)  # ~4 sigma at n=4000
    assert np.bincount(ids, minlength=V)[len(probs) :].sum() <= 2  # -30 logits are ~never drawn


def test_padding_rows_are_inert_even_with_nan_logits():
    rng = np.random.RandomState(2)
    real = [P(seed=3, top_p=0.9), P(top_k=2, repetition_penalty=1.3)]
    rows = [SamplingRow(p, [1, 2], [3], 9 + i) for i, p in enumerate(real)]
    logits = rng.randn(2, V).astype(np.float32)
    want = _sample(logits, tensors(rows))
    padded = np.concatenate([logits, np.full((2, V), np.nan, np.float32)])
    got = _sample(padded, tensors(rows, S=4))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g)[:2], np.asarray(w))


def test_logprobs_are_raw_by_default_and_processed_on_request():
    logits = np.stack([row_logits(PROBS)] * 2)
    t = tensors([P(temperature=0.5, top_k=2, seed=0), P(temperature=0)])
    raw = _sample(logits, t)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    ids = np.asarray(raw.next_ids)
    np.testing.assert_allclose(np.asarray(raw.sampled_logprobs), lp[[0, 1], ids], atol=1e-6)
    assert np.asarray(raw.topk_ids)[0, :4].tolist() == [0, 1, 2, 3]
    assert raw.topk_ids.shape == raw.topk_logprobs.shape == (2, 20)
    proc = _sample(logits, t, logprobs_mode="processed_logprobs")
    assert np.isneginf(np.asarray(proc.topk_logprobs)[0, 2])  # top-k=2 removed the third token
    np.testing.assert_allclose(np.exp(np.asarray(proc.topk_logprobs)[0, :2]), [0.8, 0.2], atol=1e-5)


def test_one_compilation_serves_every_option_mix():
    fn = jax.jit(functools.partial(sample))
    rng = np.random.RandomState(3)
    mixes = [
        [P(), P(), P()],
        [P(temperature=0), P(seed=5), P(top_k=3, top_p=0.8)],
        [P(repetition_penalty=1.2, presence_penalty=1, frequency_penalty=-1), P(min_p=0.3), P(top_p=0.99)],
        [P(logit_bias={1: 3.0}, min_tokens=4), P(top_k=15, temperature=3.0), P(temperature=0)],
    ]
    for mix in mixes:
        rows = [SamplingRow(p, [1, 2], [4, 4], i) for i, p in enumerate(mix)]
        fn(jnp.asarray(rng.randn(4, V), jnp.float32), tensors(rows, S=4, eos_token_ids=(2,)))
    assert fn._cache_size() == 1


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_the_greedy_program_samples_like_the_general_one(mode):
    """`random=False` (no scatters and, with raw logprobs, no temperature / min_p pass) is what the
    runner picks for a greedy batch without logit_bias or penalties: every output equals the general
    program's on such a batch."""
    rng = np.random.RandomState(4)
    logits = rng.randn(5, V).astype(np.float32) * 3
    rows = [SamplingRow(p, [1, 2], [3], i) for i, p in enumerate(
        [P(temperature=0), P(temperature=0, min_p=0.9), P(temperature=0, logprobs=3), P(temperature=0, top_k=-1)])]
    t = tensors(rows, S=5)
    assert sampler_switches(t, V) == SamplerSwitches(False, False, False, True, 0, False)
    greedy = jax.jit(functools.partial(sample, filter_k=False, filter_p=False, random=False, logprobs_mode=mode))
    general = jax.jit(functools.partial(sample, filter_k=False, filter_p=False, random=True, logprobs_mode=mode))
    for f, g in zip(greedy(logits, t), general(logits, t)):
        np.testing.assert_allclose(np.asarray(f), np.asarray(g), rtol=1e-6, atol=1e-6)


def test_greedy_rows_with_logit_bias_or_penalties_follow_them_in_the_general_program():
    logits = np.stack([row_logits(PROBS)] * 3)
    rows = [SamplingRow(P(temperature=0, logit_bias={2: 10.0}), [], []),
            SamplingRow(P(temperature=0, repetition_penalty=100.0), [0], []),  # token 0 seen: 0.5 -> divided
            SamplingRow(P(temperature=0), [], [])]
    t = tensors(rows)
    switches = sampler_switches(t, V)
    assert switches.random
    out = jax.jit(functools.partial(sample, **switches._asdict()))(logits, t)
    assert np.asarray(out.next_ids).tolist() == [2, 1, 0]


def test_largest_key_is_the_kth_largest_key_at_every_k():
    """Radix select against a sort: the largest tau with at least k keys >= tau is the k-th largest key,
    for keys at the ends of the uint32 range, ties and every k from 1 to V."""

    rng = np.random.default_rng(0)
    V = 37
    keys = rng.integers(0, 2**32, size=(4, V), dtype=np.uint64).astype(np.uint32)
    keys[0, :3] = [0, 0xFFFFFFFF, 0xFFFFFFFF]  # both ends, a tie at the top
    keys[1] = keys[1, 0]  # every key equal
    keys[2, :10] = 0x80000000  # a tie in the middle
    keys_j = jnp.asarray(keys)
    for k in range(1, V + 1):
        want = np.sort(keys, axis=1)[:, V - k]
        got = largest_key(lambda c, k=k: jnp.sum(keys_j >= c[..., None], axis=-1) >= k, 4)
        np.testing.assert_array_equal(np.broadcast_to(np.asarray(got), (4,)), want, err_msg=f"k={k}")


@pytest.mark.parametrize("chunk", [4, 7, TOP_N_CHUNK])  # 300 values: 75 / 43 chunks pre-select, 3 do not
@pytest.mark.parametrize("kind", ["normal", "ties", "few_finite"])
def test_top_n_equals_lax_top_k_including_ties_and_minus_inf(kind, chunk):
    """The top-n (used for the 20 top logprobs) gives lax.top_k's values, ids and tie order, with and
    without its chunk pre-selection."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 300)).astype(np.float32)
    if kind == "ties":
        x = np.round(x * 2) / 2  # a handful of distinct values, each many times
    if kind == "few_finite":
        x[:, 7:] = -np.inf
        x[0] = -np.inf
    for n in (1, 7, 20):
        v, i = jax.jit(functools.partial(top_n, n=n, chunk=chunk))(jnp.asarray(x))
        rv, ri = jax.lax.top_k(jnp.asarray(x), n)
        np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
        np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))


@pytest.mark.parametrize("chunk", [4, 300])  # with and without the pre-selection
def test_top_n_counts_nans_as_minus_inf(chunk):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 300)).astype(np.float32)
    x[0, ::3] = np.nan  # NaNs spread over every chunk
    x[1] = np.nan  # nothing but NaNs
    x[2, 10:] = np.nan  # fewer real values than n
    x[3, :150] = np.nan  # whole chunks of NaNs
    for n in (7, 20):
        v, i = jax.jit(functools.partial(top_n, n=n, chunk=chunk))(jnp.asarray(x))
        rv, ri = jax.lax.top_k(jnp.asarray(np.where(np.isnan(x), -np.inf, x)), n)
        np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
        np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
    assert (np.asarray(i)[1] == np.arange(20)).all() and np.isneginf(np.asarray(v)[1]).all()
    assert (0 <= np.asarray(i)).all() and (np.asarray(i) < 300).all()  # never an id outside the vocabulary


@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_ranks_count_the_tokens_at_least_as_likely_inside_and_outside_the_top_20(kind):
    """vLLM's rank of a token: how many tokens have a logprob >= its own, over the whole vocabulary."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 300)).astype(np.float32)
    if kind == "ties":
        x = np.round(x * 2) / 2
    order = np.argsort(-x, axis=1, kind="stable")
    token_ids = order[np.arange(6), [0, 3, 19, 20, 150, 299]]  # places 1, 4, 20, 21, 151, 300
    _, ranks, top_ids, _ = jax.jit(compute_logprobs)(jnp.asarray(x), jnp.asarray(token_ids))
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
    want = (lp >= lp[np.arange(6), token_ids][:, None]).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(ranks), want)
    if kind == "normal":  # no ties: the rank is the place
        np.testing.assert_array_equal(np.asarray(ranks), [1, 4, 20, 21, 151, 300])
        assert (np.asarray(top_ids)[:, :20] == order[:, :20]).all()
    _, ranks, _, _ = compute_logprobs(jnp.asarray(x), jnp.asarray(token_ids), num_logprobs=0)
    np.testing.assert_array_equal(np.asarray(ranks), 0)  # not computed without top logprobs


def test_sampled_ranks_follow_the_drawn_token():
    logits = np.stack([row_logits(PROBS)] * 3)
    t = tensors([P(temperature=0), P(temperature=5.0, seed=1), P(temperature=5.0, seed=2)])
    out = _sample(logits, t)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    ids = np.asarray(out.next_ids)
    want = (lp >= lp[np.arange(3), ids][:, None]).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(out.sampled_ranks), want)
    assert np.asarray(out.sampled_ranks)[0] == 1
