"""Request handling in the engine: stop ids, n, logprobs and their ranks, output kinds, beam search, prompt
truncation and validation, and engine arguments of the wrong type (`test_engine.py` checks the greedy output
against transformers under every scheduling mode)."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import FIXTURE, GREEDY16, HF_CASES, _assert_no_leak, _greedy_tokens, _make_llm

from jengine import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return _make_llm()


def test_stop_token_ids_and_stop_reason(llm):
    prompt, expected = HF_CASES[1]
    stop_at = expected[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[: expected.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_n_greater_than_one_returns_n_completions(llm):
    out = llm.generate([HF_CASES[2][0]], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8,
                                                                 ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3  # each child draws its own tokens
    _assert_no_leak(llm)


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate([HF_CASES[1][0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3


def test_sampled_tokens_carry_their_rank_even_outside_the_top_k(llm):
    out = llm.generate([HF_CASES[1][0]], SamplingParams(temperature=50.0, seed=3, max_tokens=24, logprobs=1,
                                                        ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ranks = []
    for token, entry in zip(out.token_ids, out.logprobs):
        tops = [t for t, lp in entry.items() if lp.rank == 1]
        assert len(tops) == 1 and len(entry) == (1 if tops[0] == token else 2)
        assert entry[token].rank >= 1 and (entry[token].rank == 1) == (tops[0] == token)
        ranks.append(entry[token].rank)
    assert max(ranks) > 20  # a flat distribution (temperature 50) draws far outside the top 20
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_output_kinds_cumulative_delta_and_final_only(llm):
    engine = llm.engine
    prompt, expected = HF_CASES[0]
    outs = {kind.name: [] for kind in RequestOutputKind}
    for kind in RequestOutputKind:
        engine.add_request(kind.name, prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1,
                                                             prompt_logprobs=1, output_kind=kind))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    cumulative, delta, final = outs["CUMULATIVE"], outs["DELTA"], outs["FINAL_ONLY"]
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == expected
    assert len(cumulative) == len(delta) > 2 and cumulative[-1].outputs[0].token_ids == expected
    assert all(not o.finished for o in cumulative[:-1]) and cumulative[-1].finished and delta[-1].finished
    for a, b in zip(cumulative[:-1], cumulative[1:]):  # each output extends the last
        assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
    # an output is not changed by later steps: its lists are its own, not the engine's
    assert [len(o.outputs[0].logprobs) for o in cumulative] == [len(o.outputs[0].token_ids) for o in cumulative]
    assert len({len(o.outputs[0].logprobs) for o in cumulative}) == len(cumulative)
    assert sum((o.outputs[0].token_ids for o in delta), []) == expected
    assert sum((o.outputs[0].logprobs for o in delta), []) == cumulative[-1].outputs[0].logprobs
    assert "".join(o.outputs[0].text for o in delta) == cumulative[-1].outputs[0].text == final[0].outputs[0].text
    assert delta[0].prompt_logprobs == final[0].prompt_logprobs and len(final[0].prompt_logprobs) == len(prompt)
    assert all(o.prompt_logprobs is None for o in delta[1:])
    _assert_no_leak(llm)


def _outputs_by_kind(engine, prompt, **params):
    outs = {kind: [] for kind in RequestOutputKind}
    for kind in RequestOutputKind:
        engine.add_request(kind.name, prompt, SamplingParams(output_kind=kind, **params))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[RequestOutputKind[out.request_id]].append(out)
    return outs


def test_flat_logprobs_equal_the_dict_logprobs_in_every_output_kind(llm):
    from jengine.logprobs import FlatLogprobs

    params = dict(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    prompt = HF_CASES[2][0]
    dicts = _outputs_by_kind(llm.engine, prompt, **params)
    flat = _outputs_by_kind(llm.engine, prompt, flat_logprobs=True, **params)
    for kind in RequestOutputKind:
        assert len(flat[kind]) == len(dicts[kind]) > 0
        for f, d in zip(flat[kind], dicts[kind]):
            assert isinstance(f.outputs[0].logprobs, FlatLogprobs) and isinstance(d.outputs[0].logprobs, list)
            assert f.outputs[0].token_ids == d.outputs[0].token_ids
            assert f.outputs[0].logprobs == d.outputs[0].logprobs
            assert len(f.outputs[0].logprobs) == len(f.outputs[0].token_ids) == len(d.outputs[0].logprobs)
            if d.prompt_logprobs is None:
                assert f.prompt_logprobs is None
            else:
                assert isinstance(f.prompt_logprobs, FlatLogprobs) and isinstance(d.prompt_logprobs, list)
                assert f.prompt_logprobs == d.prompt_logprobs and len(d.prompt_logprobs) == len(prompt)
    _assert_no_leak(llm)


def test_prompt_logprobs_are_recorded_once_when_a_preempted_prompt_is_computed_again(llm):
    base = HF_CASES[3][0]
    prompts = [base[i : i + 32] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, prompt_logprobs=2)
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = _make_llm(num_gpu_blocks_override=7, preemption_mode="recompute", max_num_batched_tokens=128,
                      token_buckets=(8, 128))
    preempted = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats["preemptions"] > 0
    for a, b in zip(preempted, roomy):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        assert a.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert list(x) == list(y) and [v.rank for v in x.values()] == [v.rank for v in y.values()]
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-4)
    _assert_no_leak(tight)


def test_over_long_prompt_and_bad_params_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 200], GREEDY16, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="vocabulary|token ids"):
        llm.generate([[10**6]], GREEDY16, use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(FIXTURE, not_an_arg=1)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2]], [{"temperature": 0}], use_tqdm=False)
    _assert_no_leak(llm)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    prompt, _ = HF_CASES[0]
    tail = list(prompt[-3:])
    want = llm.generate([tail], GREEDY16, use_tqdm=False)[0]
    got = llm.generate([list(prompt)], GREEDY16.clone(truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert got.prompt_token_ids == tail and got.outputs[0].token_ids == want.outputs[0].token_ids
    # -1: the last max_model_len (128) tokens; then max_tokens must still fit (as in vLLM)
    long = [1 + i % 50 for i in range(200)]
    with pytest.raises(ValueError, match="prompt of 128 tokens plus max_tokens=1 is 129"):
        llm.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    out = llm.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=127), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-127:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=129 is more than max_model_len=128"):
        llm.generate([long], SamplingParams(truncate_prompt_tokens=129), use_tqdm=False)
    _assert_no_leak(llm)


def test_beam_search_with_width_one_is_greedy_and_wider_beams_score_no_worse(llm):
    from jengine.beam_search import BeamSearchParams

    prompt, expected = HF_CASES[2]
    one = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0]
    assert one.sequences[0].output_tokens == expected[:6]
    wide = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True,
                                                      length_penalty=0.0))[0]
    assert len(wide.sequences) == 3
    scores = [s.cum_logprob for s in wide.sequences]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] >= one.sequences[0].cum_logprob - 1e-5
    assert len({tuple(s.output_tokens) for s in wide.sequences}) == 3
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    _assert_no_leak(llm)


def test_engine_arguments_of_the_wrong_type_are_named(llm):
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[1, 2]], GREEDY16, priority=["high"], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams, got str"):
        llm.generate([[1, 2]], "greedy", use_tqdm=False)  # a string is not a list of params
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(FIXTURE, gpu_memory_utilization="most")
    with pytest.raises(ValueError, match="swap_space"):
        LLM(FIXTURE, swap_space="4GB")
    _assert_no_leak(llm)


@pytest.mark.parametrize(("prompts", "message"), [
    (None, "prompts must be a prompt .* got NoneType"),
    (5, "prompts must be a prompt .* got int"),
    ([[1.5, 2]], "prompt token ids must be integers"),  # int() would have made it 1
    ([[True, 2]], "prompt token ids must be integers"),
    ([[[1, 2]]], "prompt token ids must be integers"),
    ([np.array([1.5, 2.0])], "prompt token ids must be integers"),
    ([np.array([True, False])], "prompt token ids must be integers"),
    ([np.array([[1, 2], [3, 4]])[None]], "prompt token ids must be integers"),  # one prompt of rows
    ([np.array(3)], "prompt token ids must be integers .* 0-D array"),
    ([[1, -1]], r"prompt token ids must be integers in \[0, "),
    ([[1, 10**12]], r"prompt token ids must be integers in \[0, "),
    ([[np.int32(1), 2.0]], "prompt token ids must be integers"),
])
def test_malformed_prompts_are_value_errors(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY16, use_tqdm=False)
    _assert_no_leak(llm)


def test_numpy_token_ids_are_one_prompt(llm):
    expected = _greedy_tokens(llm, [HF_CASES[0][0]])[0]
    ids = HF_CASES[0][0]
    for prompt in (np.asarray(ids), np.asarray(ids, np.uint32), np.asarray(ids, object), [np.int64(t) for t in ids],
                   tuple(ids)):
        out = llm.generate(prompt, GREEDY16, use_tqdm=False)
        assert len(out) == 1 and out[0].outputs[0].token_ids == expected
    _assert_no_leak(llm)
