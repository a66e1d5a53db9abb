"""FlatLogprobs reads like a list of per-position dicts; step_entries builds vLLM's entries."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from jengine.logprobs import FlatLogprobs, Logprob, step_entries


def _entry(token, logprob, rank, top_ids, top_lps, k):
    """vLLM's entry, one position at a time: the chosen token, then the top k by place (a chosen token
    among them takes its place as its rank)."""
    entry = {token: Logprob(logprob, rank)}
    for place, (tid, lp) in enumerate(zip(top_ids[:k], top_lps[:k]), 1):
        if tid < 0:
            break
        if tid == token:
            entry[token].rank = place
        else:
            entry[tid] = Logprob(lp, place)
    return entry


DICTS = [None, {3: Logprob(-0.5, 1)}, {7: Logprob(-2.0, 4, "x"), 1: Logprob(-0.1, 1), 2: Logprob(-1.0, 2)}, None,
         {9: Logprob(-3.0, 30)}]


def test_flat_logprobs_read_as_the_dicts_they_were_built_from():
    flat = FlatLogprobs(DICTS)
    assert len(flat) == 5 and list(flat) == DICTS and flat == DICTS
    assert flat[0] is None and flat[-1] == DICTS[-1] and flat[2] == DICTS[2]
    assert list(flat[2]) == [7, 1, 2]  # entry order kept: the chosen token first
    assert flat[1:4] == DICTS[1:4] and flat[3:] == DICTS[3:] and flat[4:2] == [] and flat[:] == DICTS
    with pytest.raises(IndexError):
        flat[5]
    with pytest.raises(ValueError, match="step 1"):
        flat[::2]
    grown = FlatLogprobs(DICTS[:2])
    grown.extend(FlatLogprobs(DICTS[2:]))
    assert grown == DICTS
    grown.append_position([4, 5], [-0.25, -1.5], [1, 2])
    assert grown[-1] == {4: Logprob(-0.25, 1), 5: Logprob(-1.5, 2)}
    assert pickle.loads(pickle.dumps(flat)) == DICTS  # outputs cross process boundaries (data parallel)
    assert flat.position(2) == ([7, 1, 2], [-2.0, -0.1, -1.0], [4, 1, 2]) and flat.position(0) == ([], [], [])


def test_a_slice_is_a_copy_that_later_appends_do_not_reach():
    flat = FlatLogprobs(DICTS[:3])
    tail = flat[1:]
    flat.append({5: Logprob(-1.0, 1)})
    assert len(tail) == 2 and tail == DICTS[1:3]


@pytest.mark.parametrize("seed", range(4))
def test_step_entries_equal_the_per_position_entries(seed):
    rng = np.random.default_rng(seed)
    r, n, vocab = 40, 20, 60
    top_ids = np.stack([rng.permutation(vocab)[:n] for _ in range(r)]).astype(np.int32)
    top_ids[:3, 15:] = -1  # rows with fewer real entries than asked for (padding)
    top_lps = -np.sort(rng.exponential(size=(r, n)), axis=1).astype(np.float32)
    in_top = rng.random(r) < 0.5  # half the chosen tokens sit among the row's top entries
    chosen = np.where(in_top, top_ids[np.arange(r), rng.integers(0, 15, r)], rng.integers(0, vocab, r))
    chosen_lps = rng.normal(size=r).astype(np.float32)
    chosen_ranks = rng.integers(1, vocab, r)
    ks = rng.integers(0, n + 1, r)
    ks[0] = 0
    entries = step_entries(chosen, chosen_lps, chosen_ranks, top_ids, top_lps, ks)
    flat = FlatLogprobs()
    for i in range(r):
        entries.add_to(flat, i)
    expected = [_entry(int(chosen[i]), float(chosen_lps[i]), int(chosen_ranks[i]), top_ids[i].tolist(),
                       top_lps[i].tolist(), int(ks[i])) for i in range(r)]
    assert flat == expected
    assert [list(e) for e in flat] == [list(e) for e in expected]  # and in the same order


def test_step_entries_with_no_top_logprobs_hold_the_chosen_token_only():
    entries = step_entries([5, 6], [-1.0, -2.0], [3, 1], np.full((2, 20), -1), np.zeros((2, 20)), [0, 0])
    flat = FlatLogprobs()
    entries.add_to(flat, 0)
    entries.add_to(flat, 1)
    assert flat == [{5: Logprob(-1.0, 3)}, {6: Logprob(-2.0, 1)}]
