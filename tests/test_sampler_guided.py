"""Structured outputs' token bitmask: masked logits equal a numpy reference; sampling the masked logits, greedy and
random draws land on allowed tokens only and raw logprobs are the masked logits'; a guided batch takes the sampling
program an unguided batch of the same options takes (the runner masks its logits first, in a program of its own)."""

import dataclasses

import jax
import numpy as np
import pytest

from jengine.runner import SAMPLER_VARIANTS
from jengine.sampler import apply_token_bitmask, sample
from jengine.sampling_params import SamplingParams as P
from jengine.sampling_tables import (
    SamplerSwitches,
    SamplingRow,
    build_sampling_tensors,
    program_inputs,
    sampler_switches,
)

V = 70  # three words per row, the last one partly past the vocabulary
WORDS = 3

_sample = jax.jit(sample, static_argnames=("filter_k", "filter_p", "random", "top_logprobs", "k_bound", "small_p",
                                           "logprobs_mode"))
_mask = jax.jit(apply_token_bitmask)


def _guided_sample(logits, t, **options):
    """What the runner does on a guided step: the masked logits, then the sampling program of `t`'s switches
    over the tensors it takes."""
    switches = sampler_switches(t, V)
    return _sample(_mask(logits, t.token_bitmask), program_inputs(t, switches), **switches._asdict(), **options)


def _random_bitmask(rng, rows: int, min_allowed: int = 1) -> np.ndarray:
    """Random `[rows, WORDS]` int32 bitmasks (sign bits included) allowing at least `min_allowed` tokens < V."""
    words = rng.integers(0, 2**32, (rows, WORDS), dtype=np.uint64).astype(np.uint32).view(np.int32)
    for r in range(rows):
        for t in rng.choice(V, min_allowed, replace=False):
            words[r, t // 32] |= np.array(1 << (t % 32), np.uint32).view(np.int32)
    return words


def _allowed_reference(bitmask: np.ndarray) -> np.ndarray:
    """[rows, V] bool: bit t % 32 of word t // 32, read through Python ints."""
    return np.array([[(int(np.uint32(row[t // 32].view(np.uint32))) >> (t % 32)) & 1 == 1 for t in range(V)]
                     for row in bitmask])


def _tensors(params, bitmask, S=None):
    rows = [SamplingRow(p, [1, 2], [], i) for i, p in enumerate(params)]
    return build_sampling_tensors(rows, S or len(rows), V, penalty_window=8, max_bias_entries=8,
                                  token_bitmask=bitmask)


def test_masked_logits_equal_the_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, V)).astype(np.float32)
    bitmask = _random_bitmask(rng, 6)
    bitmask[0] = -1  # every token
    bitmask[1] = 0
    bitmask[1, 2] = np.int32(-2**31)  # bit 31 of the last word only: token 95, past V: nothing allowed
    t = _tensors([P()] * 6, bitmask)
    got = np.asarray(_mask(logits, t.token_bitmask))
    want = np.where(_allowed_reference(bitmask), logits, -np.inf)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got[0]).all() and np.isneginf(got[1]).all()


@pytest.mark.parametrize("filters", [False, True])
def test_greedy_and_random_draws_land_on_allowed_tokens_only(filters):
    rng = np.random.default_rng(1)
    S = 8
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    bitmask = _random_bitmask(rng, S, min_allowed=3)
    bitmask[:, :] &= rng.integers(0, 2**32, (S, WORDS), dtype=np.uint64).astype(np.uint32).view(np.int32)
    for r in range(S):  # keep a few allowed
        bitmask[r, r % WORDS] |= np.int32(0b1011)
    allowed = _allowed_reference(bitmask)
    extra = dict(top_k=5, top_p=0.9) if filters else {}
    params = [P(temperature=0)] * 2 + [P(temperature=1.5, seed=s, **extra) for s in range(S - 2)]
    t = _tensors(params, bitmask)
    assert sampler_switches(t, V).filter_k == filters
    seen = set()
    for step in range(20):
        t = dataclasses.replace(t, rng_step=np.full(S, step, np.uint32))
        out = _guided_sample(logits, t)
        ids = np.asarray(out.next_ids)
        assert allowed[np.arange(S), ids].all(), ids
        seen.update((r, int(i)) for r, i in enumerate(ids))
        # greedy rows: the largest allowed logit
        for r in range(2):
            assert ids[r] == np.argmax(np.where(allowed[r], logits[r], -np.inf))
        # raw logprobs (the default) are those of the masked logits, as in vLLM (unlike logit_bias's)
        lp = np.asarray(jax.nn.log_softmax(np.where(allowed, logits, -np.inf), axis=-1))
        np.testing.assert_allclose(np.asarray(out.sampled_logprobs), lp[np.arange(S), ids], rtol=1e-5, atol=1e-5)
    assert len({i for r, i in seen if r >= 2}) > S - 2  # random rows do draw different allowed tokens


def test_a_greedy_guided_batch_takes_an_argmax_of_the_masked_logits_without_the_general_tables():
    rng = np.random.default_rng(3)
    S = 8
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    bitmask = _random_bitmask(rng, S, min_allowed=3)
    t = _tensors([P(temperature=0)] * (S - 1), bitmask, S=S)  # and a padding row
    switches = sampler_switches(t, V)
    assert switches == SamplerSwitches(False, False, False, False) and switches in SAMPLER_VARIANTS
    inputs = program_inputs(t, switches)
    assert np.asarray(inputs.penalty_ids).shape == (S, 0) and np.asarray(inputs.bias_ids).shape == (S, 0)
    out = _guided_sample(logits, t)
    masked = np.where(_allowed_reference(bitmask), logits, -np.inf)
    np.testing.assert_array_equal(np.asarray(out.next_ids), np.argmax(masked, axis=-1))
    general = _sample(masked, dataclasses.replace(t, token_bitmask=np.zeros((S, 0), np.int32)),
                      **switches._replace(random=True, top_logprobs=True)._asdict())  # the general program
    np.testing.assert_array_equal(np.asarray(out.next_ids), np.asarray(general.next_ids))
    np.testing.assert_allclose(np.asarray(out.sampled_logprobs), np.asarray(general.sampled_logprobs), rtol=1e-6)


def test_processed_logprobs_leave_out_the_masked_tokens():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((2, V)).astype(np.float32)
    bitmask = np.zeros((2, WORDS), np.int32)
    bitmask[:, 0] = 0b110  # tokens 1 and 2
    t = _tensors([P(temperature=0, logprobs=5), P(temperature=1.0, seed=3, logprobs=5)], bitmask)
    out = _guided_sample(logits, t, logprobs_mode="processed_logprobs")
    top_ids, top_lp = np.asarray(out.topk_ids), np.asarray(out.topk_logprobs)
    for r in range(2):
        assert set(top_ids[r, :2].tolist()) == {1, 2} and np.isneginf(top_lp[r, 2:]).all()
        np.testing.assert_allclose(np.exp(top_lp[r, :2]).sum(), 1.0, rtol=1e-5)


def test_a_bitmask_changes_no_switch_and_is_no_sampling_programs_input():
    plain = _tensors([P(temperature=0)], None, S=4)
    assert np.asarray(plain.token_bitmask).shape == (4, 0)
    for params in ([P(temperature=0)], [P(temperature=0.7, top_p=0.5)], [P(top_k=3), P(min_p=0.2, logprobs=2)],
                   [P(repetition_penalty=1.3, logit_bias={4: 2.0})], [P(temperature=0.9, top_k=300)]):
        t = _tensors(params, np.full((1, WORDS), -1, np.int32), S=4)
        assert np.asarray(t.token_bitmask).shape == (4, WORDS) and (np.asarray(t.token_bitmask) == -1).all()
        switches = sampler_switches(t, V)
        assert switches == sampler_switches(_tensors(params, None, S=4), V)
        assert switches._replace(top_logprobs=False) in SAMPLER_VARIANTS  # top logprobs: the runner's own program
        assert np.asarray(program_inputs(t, switches).token_bitmask).shape == (4, 0)
    assert len(SAMPLER_VARIANTS) == 7


def test_a_bitmask_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"token_bitmask must be \[at most 2, 3\]"):
        _tensors([P()], np.zeros((1, 2), np.int32), S=2)
    with pytest.raises(ValueError, match=r"token_bitmask must be"):
        _tensors([P()], np.zeros((3, WORDS), np.int32), S=2)
