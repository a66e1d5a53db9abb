"""Structured outputs end to end on the tiny random-weight model: its unconstrained output is gibberish, so
valid output is the constraint's doing. Choices, regexes and JSON schemas are met exactly, alone, in
batches with unguided requests (whose output does not change), with n > 1, and bad constraints are
refused at add_request without leaving anything behind."""

from __future__ import annotations

import json
import pickle
import re

import pytest

from jengine import LLM, SamplingParams, StructuredOutputsParams
from jengine.multihost_serving import decode_params, encode_params

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
PROMPTS = ["Hello", "The answer is", "x", "Once upon a time there was"]


@pytest.fixture(scope="module")
def llm():
    return LLM("jengine/tiny-llama", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
               token_buckets=(16, 64), seq_buckets=(4,), use_tqdm_on_load=False)


def _assert_no_leak(llm):
    bm = llm.engine.scheduler.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_usable_blocks


def _texts(llm, so, temperature, **kw):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=64, structured_outputs=so, **kw)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [c for o in outs for c in o.outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice_yields_exactly_one_of_the_choices(llm, temperature):
    for c in _texts(llm, StructuredOutputsParams(choice=["yes", "no"]), temperature):
        assert c.text in ("yes", "no") and c.finish_reason == "stop"
    _assert_no_leak(llm)


def test_regex_is_fully_matched(llm):
    for temperature in (0.0, 1.0):
        for c in _texts(llm, StructuredOutputsParams(regex="[0-9]{3}-[0-9]{2}"), temperature):
            assert re.fullmatch("[0-9]{3}-[0-9]{2}", c.text) and len(c.token_ids) == 6, c.text
            assert c.finish_reason == "stop"


def test_json_schema_output_parses_and_matches_the_schema(llm):
    so = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    for temperature in (0.0, 1.0):
        for c in _texts(llm, so, temperature, top_p=0.9 if temperature else 1.0):
            value = json.loads(c.text)
            assert set(value) == {"name", "age", "ok"}, c.text
            assert isinstance(value["name"], str) and len(value["name"]) <= 5
            assert type(value["age"]) is int and 0 <= value["age"] <= 120
            assert type(value["ok"]) is bool
    # any JSON object, with the default flexible whitespace, through LLM.chat
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)
    assert isinstance(json.loads(out[0].outputs[0].text), dict)


def test_unguided_requests_in_a_guided_batch_keep_their_output(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[::2], greedy, use_tqdm=False)]
    guided = SamplingParams(temperature=0.8, seed=1, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex="[a-c]{12}"))
    outs = llm.generate(PROMPTS, [greedy, guided, greedy, guided], use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert all(re.fullmatch("[a-c]{12}", outs[i].outputs[0].text) for i in (1, 3))
    _assert_no_leak(llm)


def test_every_completion_of_n_follows_the_constraint(llm):
    so = StructuredOutputsParams(choice=["red", "green", "blue"])
    outs = llm.generate(PROMPTS[:2], SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=8,
                                                    structured_outputs=so), use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 6 and set(texts) <= {"red", "green", "blue"}
    _assert_no_leak(llm)


def test_an_unfinished_grammar_ends_at_max_tokens(llm):
    out = llm.generate(["a"], SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(
        regex="[xyz]{10}")), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and re.fullmatch("[xyz]{3}", out.text)


@pytest.mark.parametrize(("so", "message"), [
    ({"json": '{"type": "objekt"}'}, "structured_outputs.json is invalid: Invalid type: objekt"),
    ({"regex": "(unclosed"}, "structured_outputs.regex is invalid"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
])
def test_bad_constraints_are_refused_at_add_request(llm, so, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["hi"], SamplingParams(n=2, structured_outputs=so), use_tqdm=False)
    assert llm.engine.num_unfinished_requests() == 0
    _assert_no_leak(llm)


def test_structured_outputs_travel_to_engine_processes_and_followers():
    params = SamplingParams(n=2, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert pickle.loads(pickle.dumps(params)) == params  # engine_core's child process
    assert decode_params(json.loads(json.dumps(encode_params(params)))) == params  # multi-host followers


def test_preempted_guided_requests_resume_where_their_grammar_was():
    """Recompute preemption drops a request's pages, not its matcher: the resumed request goes on from the
    tokens it has, so its output still matches in full (7 usable pages of 16 tokens, four 32-token prompts)."""
    llm = LLM("jengine/tiny-llama", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128,
              token_buckets=(16, 128), seq_buckets=(4,), num_gpu_blocks_override=8, preemption_mode="recompute",
              use_tqdm_on_load=False)
    prompts = [[(7 * i + j) % 250 for j in range(32)] for i in range(4)]
    so = StructuredOutputsParams(regex="[a-z]{5}(-[0-9]{4}){6}")
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured_outputs=so),
                        use_tqdm=False)
    assert llm.engine.stats["preemptions"] > 0
    for o in outs:
        assert re.fullmatch("[a-z]{5}(-[0-9]{4}){6}", o.outputs[0].text) and o.outputs[0].finish_reason == "stop"
    _assert_no_leak(llm)


def test_allowed_token_ids_with_no_first_token_in_common_are_refused(llm):
    tok = llm.get_tokenizer()
    texts = [tok.decode([t]) for t in range(llm.engine.model_config.vocab_size)]
    letters = [t for t, text in enumerate(texts) if text.isalpha()]
    digits = [t for t, text in enumerate(texts) if len(text) == 1 and text.isdigit()]
    so = StructuredOutputsParams(regex="[0-9]{3}")
    with pytest.raises(ValueError, match="allowed_token_ids and structured_outputs have no token in common"):
        llm.generate(["hi"], SamplingParams(n=2, allowed_token_ids=letters, structured_outputs=so), use_tqdm=False)
    assert llm.engine.num_unfinished_requests() == 0
    _assert_no_leak(llm)
    # with some in common the output follows both
    two = digits[:2]
    out = llm.generate(["hi"], SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=letters + two,
                                              structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", out.text) and set(out.token_ids[:3]) <= set(two), out
    _assert_no_leak(llm)
