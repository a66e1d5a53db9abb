"""Tool-call parsers: each on whole outputs, and on every split of them into streamed deltas, which must add
up to what the whole output gives."""

from __future__ import annotations

import functools
import random

import pytest

from jengine.entrypoints.tool_parsers import (
    CallDelta,
    ExtractedToolCalls,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedCall,
    ParsedDelta,
    PythonicToolParser,
    RequiredCalls,
    ToolCall,
    extract,
    tool_parser,
)

WEATHER = '{"city": "Paris", "unit": "celsius"}'
M, P = MistralToolParser, PythonicToolParser
# (reader, output, content, calls): well-formed outputs, streamed or whole alike
WELL_FORMED = [
    (HermesToolParser, "Hello, how can I help?", "Hello, how can I help?", []),
    (HermesToolParser, f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None,
     [("get_weather", WEATHER)]),
    (HermesToolParser, 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "b", "arguments": {"y": [true, null, -2.5e3]}}\n</tool_call>',
     "Let me look.\n\n", [("a", '{"x": 1}'), ("b", '{"y": [true, null, -2.5e3]}')]),
    (HermesToolParser, '<tool_call>{"arguments": {"q": "</tool_call> <tool_call>", "n": [1, {"a": null}]}, '
                       '"id": 7, "name": "search"}</tool_call>', None,
     [("search", '{"q": "</tool_call> <tool_call>", "n": [1, {"a": null}]}')]),
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": {"s": "Zürich 😀 \\"q\\" \\u00e9"}}', None,
     [("f", '{"s": "Zürich 😀 \\"q\\" \\u00e9"}')]),  # the last block's closing tag may be missing
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),
    (HermesToolParser, "a < b and <tools> are not calls <tool", "a < b and <tools> are not calls <tool", []),
    (HermesToolParser, '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call> Done.', " Done.", [("f", '{"x":1}')]),
    (HermesToolParser, '\n \n<tool_call> {"name": "f", "parameters": {}} </tool_call>\n', None, [("f", "{}")]),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {}}</tool_', None, [("f", "{}")]),
    (HermesToolParser, "", None, []),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": ' + WEATHER + "}", None,
     [("get_weather", WEATHER)]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", '{"x": 1}'), ("b", "{}")]),
    (Llama3JsonToolParser, ' \n{"name": "a", "parameters": {"x": [1, 2]}} ;{"parameters":{"s":";"},"name":"b"};', None,
     [("a", '{"x": [1, 2]}'), ("b", '{"s":";"}')]),
    (Llama3JsonToolParser, "The weather is nice.", "The weather is nice.", []),
    (Llama3JsonToolParser, ' {"answer": 42}', ' {"answer": 42}', []),  # JSON, but not a call: text
    (Llama3JsonToolParser, '{"name": 42}', '{"name": 42}', []),
    (Llama3JsonToolParser, "<|python_tag|>", "<|python_tag|>", []),
    (Llama3JsonToolParser, "<|py", "<|py", []),
    (Llama3JsonToolParser, "", None, []),
    (RequiredCalls, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', None,
     [("a", '{"x": 1}'), ("b", "{}")]),
    (RequiredCalls, ' [ {"parameters": {"q": "]"}, "name": "s"} ] ', None, [("s", '{"q": "]"}')]),
    (functools.partial(NamedCall, "get_weather"), WEATHER, None, [("get_weather", WEATHER)]),
    (functools.partial(NamedCall, "get_weather"), "", None, [("get_weather", "")]),
    (M, "Hello, how can I help?", "Hello, how can I help?", []),
    (M, f'Let me check. [TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]', "Let me check. ",
     [("get_weather", WEATHER)]),
    (M, '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}},\n {"arguments": {"q": "]"}, "name": "b"}]', None,
     [("a", '{"x": 1}'), ("b", '{"q": "]"}')]),
    (M, f'[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]add[ARGS]{{"a": 1, "b": [2, "[TOOL_CALLS]x"]}}', None,
     [("get_weather", WEATHER), ("add", '{"a": 1, "b": [2, "[TOOL_CALLS]x"]}')]),
    (M, "\n[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS] {}\n", None, [("f", "{}")]),
    (M, 'Sure.[TOOL_CALLS]f{"s": "Zürich 😀 \\"q\\""}', "Sure.", [("f", '{"s": "Zürich 😀 \\"q\\""}')]),  # no [ARGS]
    (M, '[TOOL_CALLS][{"name": "f", "arguments": {}}] and text after', None, [("f", "{}")]),  # dropped, as vLLM
    (M, "Arrays [1, 2] and [TOOL_CALL] are text [TOOL", "Arrays [1, 2] and [TOOL_CALL] are text [TOOL", []),
    (M, "", None, []),
    (P, "The weather is nice.", "The weather is nice.", []),
    (P, '[get_weather(city="Paris", unit="celsius")]', None, [("get_weather", WEATHER)]),
    (P, '<|python_start|>[a(x=1), b(y=[True, None, -2.5e3], z={"k": (1, 2)})]<|python_end|>', None,
     [("a", '{"x": 1}'), ("b", '{"y": [true, null, -2500.0], "z": {"k": [1, 2]}}')]),
    (P, " [f(q=\")]\\\"'\", r='''a 'b) ''c''', u=\"Zürich 😀\"),\n g(e='')] \n", None,
     [("f", '{"q": ")]\\"\'", "r": "a \'b) \'\'c", "u": "Zürich 😀"}'), ("g", '{"e": ""}')]),
    (P, "[f(a=1),]", None, [("f", '{"a": 1}')]),
    (P, '[f(s="\\")")]', None, [("f", '{"s": "\\")"}')]),
    (P, "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    (P, "[Note] see above", "[Note] see above", []),
    (P, "<|python_sta", "<|python_sta", []),
    (P, "", None, []),
]
# (reader, output, what a stream of it gives): outputs that break the format after a call began; whole,
# each is all content and no calls (as vLLM reads them)
BROKEN_AFTER_A_CALL = [
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1}} extra</tool_call>ok <tool_call>{"name": "g"}',
     ('ok <tool_call>{"name": "g"}', [("f", '{"a": 1}')])),
    (HermesToolParser, 'Hi <tool_call>{"name": "f", "arguments": {"a": [1, 2', ("Hi ", [("f", '{"a": [1, 2')])),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {}}</tool_call>x',
     ("x", [("f", '{"a": 1}')])),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1, }}</tool_call>', (None, [("f", '{"a": 1, ')])),
    (Llama3JsonToolParser, '{"name": "a", "parameters": {}} and then text', (None, [("a", "{}")])),
    (Llama3JsonToolParser, '{"name": "a", "parameters": {}}; {"x": 1}', (None, [("a", "{}")])),
    (Llama3JsonToolParser, '{"name": "a", "parameters": {"x": 1}', (None, [("a", '{"x": 1}')])),
    (RequiredCalls, '[{"name": "a", "parameters": {"x": 1', (None, [("a", '{"x": 1')])),
    (RequiredCalls, '[{"name": "a", "parameters": {}}] [', (None, [("a", "{}")])),
    (M, 'Hi [TOOL_CALLS]f[ARGS]{"a": [1, 2', ("Hi ", [("f", '{"a": [1, 2')])),
    (M, '[TOOL_CALLS]f[ARGS]{"a": 1, }', (None, [("f", '{"a": 1, ')])),
    (M, '[TOOL_CALLS][{"name": "a", "arguments": {}}, 5]', (None, [("a", "{}")])),
    (M, "[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]not a call", (None, [("f", "{}")])),
    (P, "[f(a=1), g(b=x)]", (None, [("f", '{"a": 1}')])),
    (P, "[f(a=1)] and then text", (None, [("f", '{"a": 1}')])),
    (P, "[f(a=1), g(b=2", (None, [("f", '{"a": 1}')])),
    (P, "[f(a=1)", (None, [("f", '{"a": 1}')])),
    (P, "<|python_start|>[f(a=1)]<|python_end|>[g()]", (None, [("f", '{"a": 1}')])),
]
# Outputs that break the format before any call began: text, streamed or whole
BROKEN_BEFORE_A_CALL = [
    (HermesToolParser, "<tool_call>not json</tool_call> hi"),
    (HermesToolParser, 'I will call <tool_call>{"arguments": {}}</tool_call> now'),
    (HermesToolParser, '<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
    (HermesToolParser, '<tool_call>{"name": "now"}</tool_call>'),
    (HermesToolParser, '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>'),
    (HermesToolParser, '<tool_call>{"arguments": {}, "parameters": {}, "name": "f"}'),
    (HermesToolParser, "<tool_call>  "),
    (Llama3JsonToolParser, '{"x": 1, "y": [1, 2'),
    (Llama3JsonToolParser, '{"x": 1, "name": "a", "x": 2} text'),
    (M, "[TOOL_CALLS] I cannot call tools."),
    (M, 'Sure. [TOOL_CALLS][{"arguments": {}}]'),
    (M, "[TOOL_CALLS]f[ARGS] nope"),
    (M, "[TOOL_CALLS][ARGS]{}"),
    (M, "[TOOL_CALLS][]"),
    (M, "[TOOL_CALLS]"),
    (P, "[f(1)]"),
    (P, "[f(a=1, a=2)]"),
    (P, "[f(a={1, 2})]"),
    (P, "[f(a=1e999)]"),
    (P, "[f(a=x)]"),
    (P, "[f(**kw)]"),
    (P, "[os.system(cmd='ls')]"),
    (P, "[f(a=(1])]"),
    (P, "Hello [f()]"),
    (P, "[f(a=1"),
    (P, "[]"),
    (P, "<|python_start|>"),
]


def _streamed(reader, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client makes of a stream: the content, and each call's name and arguments; checks that each call
    is named once, in its first delta, and that calls come in order."""
    out = ParsedDelta()
    for piece in pieces:
        out.add(reader.feed(piece))
    out.add(reader.finish())
    calls: list[list[str]] = []
    for d in out.calls:
        assert d.index <= len(calls)
        if d.index == len(calls):
            assert d.name, d
            calls.append([d.name, ""])
        else:
            assert d.name is None, d
        calls[d.index][1] += d.arguments
    return out.content or None, [tuple(c) for c in calls]


def _splits(text: str) -> list[list[str]]:
    """Every split in two, one character at a time, and some random splits in many pieces."""
    rng = random.Random(len(text))
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return splits


@pytest.mark.parametrize("reader,text,content,calls", WELL_FORMED)
def test_a_whole_output_gives_its_content_and_calls(reader, text, content, calls):
    assert extract(reader(), text) == ExtractedToolCalls(content, [ToolCall(n, a) for n, a in calls])


@pytest.mark.parametrize("reader,text,content,calls", WELL_FORMED)
def test_every_split_of_an_output_into_deltas_streams_what_the_whole_output_gives(reader, text, content, calls):
    for pieces in _splits(text):
        assert _streamed(reader(), pieces) == (content, calls), pieces


@pytest.mark.parametrize("reader,text,stream", BROKEN_AFTER_A_CALL)
def test_output_broken_after_a_call_began_is_all_text_whole_and_keeps_its_calls_streamed(reader, text, stream):
    assert extract(reader(), text) == ExtractedToolCalls(text, [])
    for pieces in _splits(text):
        assert _streamed(reader(), pieces) == stream, pieces


@pytest.mark.parametrize("reader,text", BROKEN_BEFORE_A_CALL)
def test_output_broken_before_any_call_is_text_streamed_or_whole(reader, text):
    assert extract(reader(), text) == ExtractedToolCalls(text, [])
    for pieces in _splits(text):
        assert _streamed(reader(), pieces) == (text, []), pieces


def test_text_that_may_open_a_call_is_held_back_until_the_next_delta_says():
    p = HermesToolParser()
    assert p.feed("Hi <tool_") == ParsedDelta("Hi ")
    assert p.feed("cal") == ParsedDelta()
    assert p.feed("x") == ParsedDelta("<tool_calx")
    assert p.feed(" <") == ParsedDelta(" ")
    assert p.finish() == ParsedDelta("<")


def test_a_calls_name_goes_out_whole_then_its_arguments_as_they_grow():
    p = HermesToolParser()
    assert p.feed('<tool_call>\n{"name": "get_wea') == ParsedDelta()
    assert p.feed('ther", "argu') == ParsedDelta()
    assert p.feed('ments"') == ParsedDelta(calls=[CallDelta(0, name="get_weather")])
    assert p.feed(': {"city": "Pa') == ParsedDelta(calls=[CallDelta(0, arguments='{"city": "Pa')])
    assert p.feed('ris"}}\n</tool_call>\n<tool_call>{"parameters": [], "name": "b"}') == ParsedDelta(
        calls=[CallDelta(0, arguments='ris"}'), CallDelta(1, name="b", arguments="[]")])  # "\n" waits for text
    assert p.finish() == ParsedDelta()


def test_leading_whitespace_waits_for_text_and_is_dropped_when_only_calls_follow():
    p = HermesToolParser()
    assert p.feed("\n ") == ParsedDelta()
    assert p.feed("Sure") == ParsedDelta("\n Sure")
    q = Llama3JsonToolParser()
    assert q.feed("  ") == ParsedDelta() and q.feed('{"name"') == ParsedDelta()


def test_a_named_call_streams_the_output_as_its_arguments():
    p = NamedCall("f")
    assert p.feed("") == ParsedDelta()
    assert p.feed('{"a"') == ParsedDelta(calls=[CallDelta(0, name="f", arguments='{"a"')])
    assert p.feed(": 1}") == ParsedDelta(calls=[CallDelta(0, arguments=": 1}")])
    assert p.finish() == ParsedDelta()


def test_mistral_holds_back_what_may_be_its_token_and_sends_a_name_with_the_first_of_its_arguments():
    p = MistralToolParser()
    assert p.feed("Hi [1] [TOOL") == ParsedDelta("Hi [1] ")
    assert p.feed("_CALLS]get") == ParsedDelta()
    assert p.feed("_weather[AR") == ParsedDelta()
    assert p.feed('GS]{"city"') == ParsedDelta(calls=[CallDelta(0, name="get_weather", arguments='{"city"')])
    assert p.feed(': "Paris"}[TOOL_CALLS]b[ARGS]') == ParsedDelta(calls=[CallDelta(0, arguments=': "Paris"}')])
    assert p.feed("{}") == ParsedDelta(calls=[CallDelta(1, name="b", arguments="{}")])
    assert p.finish() == ParsedDelta()


def test_pythonic_sends_each_call_whole_once_its_parenthesis_closes():
    p = PythonicToolParser()
    assert p.feed('<|python_start|>[get_weather(city="Pa') == ParsedDelta()
    assert p.feed('ris", unit="celsius")') == ParsedDelta(calls=[CallDelta(0, name="get_weather", arguments=WEATHER)])
    assert p.feed(", ot") == ParsedDelta()
    assert p.feed("her(x=[1])]") == ParsedDelta(calls=[CallDelta(1, name="other", arguments='{"x": [1]}')])
    assert p.feed("<|python_end|>") == ParsedDelta()
    assert p.finish() == ParsedDelta()


def test_pythonic_passes_text_on_as_soon_as_it_cannot_be_a_list_of_calls():
    p = PythonicToolParser()
    assert p.feed(" [") == ParsedDelta()
    assert p.feed("1,") == ParsedDelta(" [1,")
    assert p.feed(" 2]") == ParsedDelta(" 2]")
    assert PythonicToolParser().feed("Sure") == ParsedDelta("Sure")


def test_an_unknown_parser_name_lists_the_known_ones():
    assert tool_parser("hermes") is HermesToolParser and tool_parser("llama3_json") is Llama3JsonToolParser
    assert tool_parser("mistral") is MistralToolParser and tool_parser("pythonic") is PythonicToolParser
    with pytest.raises(ValueError) as e:
        tool_parser("granite")
    assert str(e.value) == ("--tool-call-parser 'granite' is not known; choose one of hermes, llama3_json, mistral, "
                            "pythonic")


def test_mistral_keeps_special_tokens_in_the_text_as_its_tags_are_special_tokens():
    assert MistralToolParser.keeps_special_tokens and not PythonicToolParser.keeps_special_tokens
