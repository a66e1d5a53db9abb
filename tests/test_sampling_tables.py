"""The sampler's host side (`jengine.sampling_tables`): the per-step tables built from requests, the
program switches a batch selects, the inputs each program reads, and the checks on requests' tables."""

import jax.numpy as jnp
import numpy as np
import pytest

from jengine.sampler import sample
from jengine.sampling_params import SamplingParams as P
from jengine.sampling_tables import (
    SamplerSwitches,
    SamplingRow,
    bias_row,
    build_sampling_tensors,
    sampler_switches,
)

V = 16


def tensors(rows, S=None, **kw):
    rows = [r if isinstance(r, SamplingRow) else SamplingRow(r, [], []) for r in rows]
    kw.setdefault("penalty_window", 8)
    kw.setdefault("max_bias_entries", 8)
    return build_sampling_tensors(rows, S or len(rows), V, **kw)


def test_penalty_window_keeps_output_tokens_first():
    p = P(frequency_penalty=1.0)
    t = tensors([SamplingRow(p, [5, 6, 7, 8], [9, 9, 4])], penalty_window=3)
    assert t.penalty_ids[0].tolist() == [9, 4, 5]
    assert t.penalty_output_counts[0].tolist() == [2, 1, 0]


def test_out_of_vocab_logit_bias_is_rejected():
    with pytest.raises(ValueError, match="out-of-vocab"):
        tensors([P(logit_bias={V: 1.0})])


def test_a_request_s_kept_bias_row_gives_the_tables_built_each_step():
    """A row with its `bias_row` (made once per request) fills the same bias table as one built at the step, while
    min_tokens suppresses stop ids, while a bad word is banned, and after; rows without entries have none."""
    params = [P(allowed_token_ids=[3, 5, 7, 2], logit_bias={5: 2.0, 9: 50.0}, min_tokens=2),
              P(logit_bias={1: -3.0, 4: 0.5}), P(allowed_token_ids=[0, 4, 6, 11]), P(min_tokens=3), P()]
    bad = [(), ((8, 12),), ((4, 6),), (), ((4,),)]
    assert [bias_row(p, V) is None for p in params] == [False, False, False, True, True]
    assert bias_row(params[0], V).ids.tolist() == [3, 5, 7, 2] and bias_row(params[0], V).values.tolist()[1] == 2.0
    def table(outputs, kept):
        rows = [SamplingRow(p, [1], outputs, 0, b, None, bias_row(p, V) if kept else None)
                for p, b in zip(params, bad)]
        t = build_sampling_tensors(rows, 6, V, eos_token_ids=(2,))
        return (np.asarray(t.bias_ids), np.asarray(t.bias_values), np.asarray(t.allow_only))

    for outputs in ([], [8], [4, 8], [8, 4, 1]):  # suppressed for the first two steps; bans after 8 and 4
        for built, kept in zip(table(outputs, False), table(outputs, True)):
            np.testing.assert_array_equal(kept, built)
    with pytest.raises(ValueError, match="out-of-vocab"):
        bias_row(P(logit_bias={V + 3: 1.0}), V)


def test_requests_that_could_overflow_the_bias_table_are_value_errors_naming_the_field():
    from jengine.sampling_tables import DEFAULT_MAX_BIAS_ENTRIES as B
    from jengine.sampling_tables import check_bias_table

    check_bias_table(P(allowed_token_ids=list(range(B)), logit_bias={i: 1.0 for i in range(B, B + 300)}))
    with pytest.raises(ValueError, match=f"^allowed_token_ids may name at most {B} tokens, got {B + 1}"):
        check_bias_table(P(allowed_token_ids=list(range(B + 1))))
    bias = {i: 1.0 for i in range(300)}
    check_bias_table(P(logit_bias=bias), banned_token_ids=frozenset(range(250, 250 + B - 250)))  # overlaps count once
    with pytest.raises(ValueError, match=f"^logit_bias, bad_words together need {B + 1} entries"):
        check_bias_table(P(logit_bias=bias), banned_token_ids=frozenset(range(300, B + 1)))
    with pytest.raises(ValueError, match=f"^bad_words together need {B + 1} entries"):
        check_bias_table(P(), banned_token_ids=frozenset(range(B + 1)))
    with pytest.raises(ValueError, match=f"^logit_bias, stop_token_ids together need {B + 1} entries"):
        check_bias_table(P(logit_bias=bias, stop_token_ids=list(range(300, B)), min_tokens=1), eos_token_ids=[B])


@pytest.mark.parametrize("options, expected", [
    ([dict(temperature=0.0)], (False, False, False, False, 0, False)),
    ([dict(temperature=0.0), dict(temperature=0.7)], (False, False, True, False, 0, False)),
    ([dict(temperature=0.7, top_p=0.9)], (False, True, True, False, 0, False)),  # top-p alone skips top-k
    ([dict(temperature=0.7, top_k=5)], (True, True, True, False, 64, True)),  # top-k comes with top-p
    ([dict(temperature=0.7, top_k=50, top_p=0.9), dict(temperature=0.7)], (True, True, True, False, 64, True)),
    # a top-p row without top-k: its nucleus may lie beyond the top-k candidates
    ([dict(temperature=0.7, top_k=5), dict(temperature=0.7, top_p=0.5)], (True, True, True, False, 64, False)),
    # 64 < k <= 256: the wide bound, only without top-p-only rows
    ([dict(temperature=0.7, top_k=64), dict(temperature=0.7, top_k=65)], (True, True, True, False, 256, True)),
    ([dict(temperature=0.7, top_k=65), dict(temperature=0.7, top_p=0.5)], (True, True, True, False, 0, False)),
    ([dict(temperature=0.0, logprobs=0)], (False, False, False, True, 0, False)),
    ([dict(temperature=0.0), dict(temperature=0.0, logprobs=3)], (False, False, False, True, 0, False)),
    ([dict(temperature=0.0, min_p=0.5)], (False, False, False, False, 0, False)),  # min_p: argmax stays
    # greedy batches with logit_bias, penalties or min_tokens suppression take the general program
    ([dict(temperature=0.0), dict(temperature=0.0, logit_bias={3: 1.0})], (False, False, True, False, 0, False)),
    ([dict(temperature=0.0, repetition_penalty=1.1)], (False, False, True, False, 0, False)),
    ([dict(temperature=0.0, presence_penalty=0.5)], (False, False, True, False, 0, False)),
    ([dict(temperature=0.0, frequency_penalty=-0.5)], (False, False, True, False, 0, False)),
    ([dict(temperature=0.0, min_tokens=3, stop_token_ids=[7])], (False, False, True, False, 0, False)),
    ([dict(temperature=0.0, min_tokens=3, ignore_eos=True)], (False, False, False, False, 0, False)),
    ([dict(temperature=0.0), dict(temperature=0.0, allowed_token_ids=[3])], (False, False, True, False, 0, False)),
])
def test_sampler_switches_follow_the_batch(options, expected):
    rows = [SamplingRow(P(**o), [1, 2], []) for o in options]
    t = build_sampling_tensors(rows, 8, 100)
    assert sampler_switches(t, 100) == SamplerSwitches(*expected)


def test_greedy_rows_keep_the_greedy_program_while_their_bad_words_ban_nothing():
    """A bad word's ban is a bias table entry only at a step whose outputs end with its other tokens."""
    params = P(temperature=0.0)
    for outputs, general in (([3], False), ([3, 4], True), ([4, 3], False)):
        t = build_sampling_tensors([SamplingRow(params, [4], outputs, 0, ((4, 5),))], 8, 100)
        assert sampler_switches(t, 100).random is general, outputs
    t = build_sampling_tensors([SamplingRow(params, [1], [], 0, ((5,),))], 8, 100)  # one token: always
    assert sampler_switches(t, 100).random


def test_a_k_past_the_wide_bound_takes_the_radix_select():
    rows = [SamplingRow(P(temperature=0.7, top_k=k), [], []) for k in (5, 257)]
    assert sampler_switches(build_sampling_tensors(rows, 8, 1000), 1000)[4:6] == (0, False)
    rows = [SamplingRow(P(temperature=0.7, top_k=k), [], []) for k in (5, 256)]
    assert sampler_switches(build_sampling_tensors(rows, 8, 1000), 1000)[4:6] == (256, True)


def test_program_inputs_leave_out_the_bias_and_penalty_tables_only_where_no_program_reads_them():
    from jengine.sampling_tables import SamplerSwitches, program_inputs

    t = build_sampling_tensors([SamplingRow(P(temperature=0.0), [1, 2], [3])], 4, 32)
    general = program_inputs(t, SamplerSwitches(filter_k=False, filter_p=False, random=True, top_logprobs=False))
    assert general is t
    greedy = program_inputs(t, SamplerSwitches(filter_k=False, filter_p=False, random=False, top_logprobs=True))
    for name in ("penalty_ids", "penalty_output_counts", "bias_ids", "bias_values"):
        assert getattr(greedy, name).shape == (4, 0) and getattr(greedy, name).dtype == getattr(t, name).dtype
    assert np.array_equal(greedy.greedy, t.greedy) and np.array_equal(greedy.rng_step, t.rng_step)
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.float32)
    assert np.array_equal(sample(logits, greedy, filter_k=False, filter_p=False, random=False).next_ids,
                          sample(logits, t, filter_k=False, filter_p=False, random=False).next_ids)
