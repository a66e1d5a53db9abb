"""Structured outputs on the host: constraints are checked at the edge, and at every step a matcher's
bitmask allows exactly the tokens that keep the output a prefix of an allowed string (the tiny model's
byte tokenizer: token b < 256 is byte b, so the expected sets can be written out)."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from jengine.sampling_params import SamplingParams
from jengine.structured_output import (
    GrammarCompiler,
    StructuredOutputsParams,
    allowed_tokens,
    bitmask_words,
    consume,
    grammar_text,
)
from jengine.tokenizer import load_tokenizer

V = 384  # the tiny model's vocabulary (its tokenizer has 261 tokens)
EOS = (257, 260)


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(load_tokenizer("jengine/tiny-llama"), V, EOS)


def _allowed(compiler, matcher) -> set[int]:
    table = compiler.fill_bitmask([(0, matcher)], 1)
    assert table.shape == (1, bitmask_words(V)) and table.dtype == np.int32
    return set(allowed_tokens(table[0], V).tolist())


def _walk(compiler, so, text: str, complete: list[str]):
    """Consume `text` byte by byte, checking the mask before each byte against the prefixes of the strings
    in `complete`; returns the matcher after the last byte."""
    matcher = compiler.matcher(compiler.grammar(so))
    for i in range(len(text) + 1):
        prefix = text[:i]
        expected = {ord(s[i]) for s in complete if s.startswith(prefix) and len(s) > i}
        if prefix in complete:
            expected |= set(EOS)
        assert _allowed(compiler, matcher) == expected, prefix
        if i < len(text):
            done = consume(matcher, ord(text[i]))
            assert done == (i + 1 == len(text) and not any(len(s) > i + 1 and s.startswith(text) for s in complete))
    return matcher


def test_choice_mask_allows_exactly_the_bytes_that_continue_a_choice(compiler):
    choices = ["yes", "no", "nope", "maybe"]
    so = StructuredOutputsParams(choice=choices)
    for text in choices:
        matcher = _walk(compiler, so, text, choices)
        assert matcher.is_accepting()
    # "no" may go on to "nope": not done after "no", done after "nope"
    matcher = compiler.matcher(compiler.grammar(so))
    assert not consume(matcher, ord("n")) and not consume(matcher, ord("o"))
    assert _allowed(compiler, matcher) == {ord("p"), *EOS}


def test_regex_mask_follows_each_position(compiler):
    so = StructuredOutputsParams(regex="[0-9]{3}-[0-9]{2}")
    matcher = compiler.matcher(compiler.grammar(so))
    digits = {ord(c) for c in "0123456789"}
    for i, ch in enumerate("123-45"):
        assert _allowed(compiler, matcher) == ({ord("-")} if i == 3 else digits), i
        assert consume(matcher, ord(ch)) == (i == 5)
    assert matcher.is_stopped() and not matcher.is_error()


def test_a_token_outside_the_mask_ends_the_sequence_with_the_matcher_in_error(compiler):
    matcher = compiler.matcher(compiler.grammar(StructuredOutputsParams(regex="[0-9]+")))
    assert consume(matcher, ord("x")) and matcher.is_error()


def test_rows_are_filled_the_same_one_by_one_and_in_parallel(compiler):
    grammars = [compiler.grammar(StructuredOutputsParams(**kw)) for kw in
                (dict(choice=["ab", "cd"]), dict(regex="[a-c]+"), dict(json_object=True), dict(regex="x"))]
    matchers = [compiler.matcher(g) for g in grammars * 2]
    rows = [(2 * i + 1, m) for i, m in enumerate(matchers)]  # every other row guided
    parallel = compiler.fill_bitmask(rows, 17)  # >= 4 rows: llguidance's thread pool
    assert parallel.shape == (17, bitmask_words(V))
    for row, m in rows:
        np.testing.assert_array_equal(parallel[row], compiler.fill_bitmask([(0, m)], 1)[0])
    unguided = [r for r in range(17) if r not in dict(rows)]
    assert (parallel[unguided] == -1).all()  # everything allowed
    assert set(allowed_tokens(parallel[3], V).tolist()) == {ord(c) for c in "abc"}


def test_json_schema_mask_starts_an_object_and_ends_only_when_complete(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    matcher = compiler.matcher(compiler.grammar(so))
    assert _allowed(compiler, matcher) == {ord("{")}
    for ch in '{"a":12':
        assert not consume(matcher, ord(ch))
    assert _allowed(compiler, matcher) == {ord(c) for c in "0123456789}"}
    assert consume(matcher, ord("}"))


@pytest.mark.parametrize(("kw", "message"), [
    ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
    (dict(regex="a", choice=["a"]), "exactly one of .*; got regex, choice"),
    (dict(json=5), "structured_outputs.json must be a JSON schema"),
    (dict(json_object=False), "structured_outputs.json_object must be True"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(choice="yes"), "structured_outputs.choice must be a non-empty list"),
    (dict(choice=["a", 3]), "structured_outputs.choice must hold non-empty strings"),
    (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
    (dict(grammar=7), "structured_outputs.grammar must be a non-empty string"),
    (dict(regex="a", disable_any_whitespace="yes"), "disable_any_whitespace must be True or False"),
])
def test_malformed_constraints_are_value_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kw)
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=kw)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(json='{"type": "objekt"}'), "structured_outputs.json is invalid: Invalid type: objekt"),
    (dict(json={"type": "object", "properties": 5}), "structured_outputs.json is invalid: properties must be"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(regex="[0-9"), "structured_outputs.regex is invalid: .*unclosed character class"),
    (dict(regex="(a"), "structured_outputs.regex is invalid: .*unclosed group"),
    (dict(grammar="start: foo"), "structured_outputs.grammar is invalid"),
])
def test_bad_schemas_regexes_and_grammars_are_value_errors(compiler, kw, message):
    so = StructuredOutputsParams(**kw)
    with pytest.raises(ValueError, match=message):
        grammar_text(so)
    with pytest.raises(ValueError, match=message):
        compiler.grammar(so)


def test_params_take_a_dict_and_travel_as_one():
    params = SamplingParams(structured_outputs={"regex": "[a-z]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[a-z]+")
    assert params.clone(seed=3).structured_outputs == params.structured_outputs
    with pytest.raises(ValueError, match=re.escape("structured_outputs has unknown fields ['regexp']")):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams or a dict"):
        SamplingParams(structured_outputs="a+")


def test_disable_additional_properties_closes_objects_that_do_not_say(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
              "required": ["a"]}
    closed = StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_additional_properties=True)
    matcher = compiler.matcher(compiler.grammar(closed))
    for ch in '{"a":{"b":1}':
        consume(matcher, ord(ch))
    assert _allowed(compiler, matcher) == {ord("}")}  # no other property
    assert "additionalProperties" not in schema["properties"]["a"]  # the caller's schema is left alone


_GRAMMARS = (dict(choice=["yes", "no", "nope"]), dict(regex="[a-c]{2,5}(x|yz)?"),
             dict(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                        "required": ["a"]}, disable_any_whitespace=True))


def test_a_repeated_constraint_is_checked_once_and_the_cache_is_bounded(monkeypatch):
    import jengine.structured_output as so_module

    checked = []
    monkeypatch.setattr(so_module, "grammar_text", lambda so, tok: checked.append(so.kind) or f"start: {so.regex!r}")
    compiler = GrammarCompiler(load_tokenizer("jengine/tiny-llama"), V, EOS, cache_size=2)
    first = compiler.grammar(StructuredOutputsParams(regex="a+"))
    assert compiler.grammar(StructuredOutputsParams(regex="a+")) is first and checked == ["regex"]
    # the same schema as a dict in another key order is the same constraint
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    compiler.grammar(StructuredOutputsParams(json=schema))
    compiler.grammar(StructuredOutputsParams(json=dict(reversed(list(schema.items())))))
    assert checked == ["regex", "json"]
    compiler.grammar(StructuredOutputsParams(regex="b+"))  # a third: the least recently used (a+) goes
    compiler.grammar(StructuredOutputsParams(regex="a+"))
    assert checked == ["regex", "json", "regex", "regex"]


def test_many_matchers_advance_on_the_pool_as_one_by_one(compiler):
    grammars = [compiler.grammar(StructuredOutputsParams(**kw)) for kw in _GRAMMARS]
    tokens = [ord(c) for c in "na{zb{"]  # "z": refused by the choices
    one_by_one = [compiler.matcher(g) for g in grammars * 2]
    together = [compiler.matcher(g) for g in grammars * 2]
    stopped = compiler.matcher(grammars[0])
    for ch in "yes":
        consume(stopped, ord(ch))
    assert stopped.is_stopped()
    expected = [consume(m, t) for m, t in zip(one_by_one, tokens)] + [True]
    assert compiler.consume(list(zip(together, tokens)) + [(stopped, ord("x"))]) == expected
    assert expected[:6] == [False, False, False, True, False, False]
    assert [m.is_error() for m in together] == [m.is_error() for m in one_by_one] == [False] * 3 + [True, False, False]
    for a, b in zip(together, one_by_one):
        assert _allowed(compiler, a) == _allowed(compiler, b)


def test_a_step_s_tokens_and_the_next_bitmask_are_handled_on_the_worker_thread(monkeypatch):
    import threading
    from types import SimpleNamespace

    from jengine.structured_output import GuidedRequests

    guided = GuidedRequests(load_tokenizer("jengine/tiny-llama"), V, EOS)
    params = SamplingParams(structured_outputs={"choice": ["ab", "ax"]}, n=2)
    for rid, matcher in zip(("r0", "r1"), guided.new_matchers(params)):
        guided.add(rid, matcher)
    threads = []
    fill = guided._compiler.fill_bitmask
    monkeypatch.setattr(guided._compiler, "fill_bitmask",
                        lambda *a: threads.append(threading.current_thread().name) or fill(*a))
    entry = lambda rid: SimpleNamespace(request_id=rid, produces_token=True,  # noqa: E731
                                        request=SimpleNamespace(is_finished=False))
    entries = [entry("r0"), entry("plain"), entry("r1")]
    ended = guided.advance_many([("r0", ord("a")), ("plain", 5), ("r1", ord("z"))], upcoming=(entries, 4))
    assert ended.result() == {"r1"}  # "z" broke r1's grammar
    table = guided.bitmask(entries, 4)
    assert threads == ["jengine-grammar_0"]  # filled once, on the worker, after the tokens
    assert set(allowed_tokens(table[0], V).tolist()) == {ord("b"), ord("x")}
    assert (table[[1, 3]] == -1).all()  # unguided and padding rows allow everything
    # a step built without that prefetch fills on the engine thread, after the worker is done
    again = guided.bitmask(entries[:1], 2)
    assert threads[-1] == threading.current_thread().name and (again[0] == table[0]).all()


def test_prepare_makes_the_compiler_on_the_worker_and_the_first_request_takes_it(monkeypatch):
    """A server makes the grammar compiler (seconds for a large vocabulary) before requests come, on the worker
    thread; the first guided request then uses that one instead of making its own on the engine thread."""
    import threading

    import jengine.structured_output as so_module
    from jengine.structured_output import GuidedRequests

    made = []
    real = so_module.GrammarCompiler
    monkeypatch.setattr(so_module, "GrammarCompiler",
                        lambda *a, **k: made.append(threading.current_thread().name) or real(*a, **k))
    guided = GuidedRequests(load_tokenizer("jengine/tiny-llama"), V, EOS)
    guided.prepare()
    guided.prepare()  # once is enough
    assert guided._building.result() is not None and made == ["jengine-grammar_0"]
    params = SamplingParams(structured_outputs={"choice": ["ab", "ax"]})
    matchers = guided.new_matchers(params)
    assert made == ["jengine-grammar_0"] and len(matchers) == 1 and not matchers[0].is_error()
    # without prepare, the first guided request makes it (and waits for it)
    lazy = GuidedRequests(load_tokenizer("jengine/tiny-llama"), V, EOS)
    assert lazy.new_matchers(SamplingParams()) == [None] and len(made) == 1  # an unguided request makes nothing
    assert len(lazy.new_matchers(params)) == 1 and len(made) == 2


def test_prepare_without_a_tokenizer_or_an_end_token_leaves_the_error_to_the_request():
    from jengine.structured_output import GuidedRequests

    params = SamplingParams(structured_outputs={"choice": ["ab"]})
    none = GuidedRequests(None, V, EOS)
    none.prepare()  # nothing to make
    with pytest.raises(ValueError, match="needs a tokenizer"):
        none.new_matchers(params)
    tokenizer = copy.deepcopy(load_tokenizer("jengine/tiny-llama"))
    tokenizer.eos_token = None
    no_eos = GuidedRequests(tokenizer, V, (V + 5,))  # the model's end id is past the tokenizer's tokens
    no_eos.prepare()  # fails on the worker, quietly
    for _ in range(2):  # every guided request is refused the same way; the engine goes on
        with pytest.raises(ValueError, match="end-of-sequence"):
            no_eos.new_matchers(params)
