"""Tool calls in chat responses: the server's options, and the OpenAI fields built from a given output, whole
and streamed (a random-weight model never writes a call of its own, so auto mode's reading is tested here)."""

from __future__ import annotations

import json
import re

import pytest

from jengine.entrypoints.tool_calls import ToolCallingConfig
from jengine.entrypoints.tool_choice import ToolChoice

HERMES = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
TWO_CALLS = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def _calls(calls: list[dict]) -> list[tuple[str, str]]:
    assert all(CALL_ID.fullmatch(c["id"]) and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_auto_reads_the_calls_and_the_text_around_them_from_a_whole_output():
    reading = HERMES.reading(ToolChoice("auto"))
    content, calls = reading.message(TWO_CALLS)
    assert content == "I will check both.\n\n"
    assert _calls(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]
    assert reading.finish_reason(True, "stop") == "tool_calls"
    assert reading.finish_reason(True, "length") == "length"  # cut short: the client should know
    assert reading.message("Just text.") == ("Just text.", [])
    assert reading.finish_reason(False, "stop") == "stop"
    assert reading.keeps_special_tokens  # hermes: the tags may be special tokens


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = HERMES.reading(ToolChoice("auto"), parallel=False).message(TWO_CALLS)
    assert content == "I will check both.\n\n" and _calls(calls) == [("get_weather", '{"city": "Paris"}')]


def test_output_broken_mid_call_is_all_content():
    cut = TWO_CALLS[:-40]
    assert HERMES.reading(ToolChoice("auto")).message(cut) == (cut, [])


def test_required_and_named_choices_read_constrained_output_without_a_parser():
    plain = ToolCallingConfig()  # no --enable-auto-tool-choice: required and named work all the same
    required = plain.reading(ToolChoice("required"))
    content, calls = required.message('[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert content == "" and _calls(calls) == [("get_time", '{"zone": "UTC"}')]
    assert required.finish_reason(True, "stop") == "tool_calls"
    named = plain.reading(ToolChoice("function", "get_weather"))
    content, calls = named.message('{"city": "Oslo"}')
    assert content == "" and _calls(calls) == [("get_weather", '{"city": "Oslo"}')]
    assert named.finish_reason(True, "stop") == "stop"  # as OpenAI and vLLM do for a named function
    assert plain.reading(ToolChoice("none")) is None


def test_a_stream_sends_each_calls_id_and_name_first_then_argument_pieces_that_add_up():
    whole_content, whole_calls = HERMES.reading(ToolChoice("auto")).message(TWO_CALLS)
    for size in (1, 3, 7, len(TWO_CALLS)):
        stream = HERMES.reading(ToolChoice("auto")).stream()
        pieces = [TWO_CALLS[i:i + size] for i in range(0, len(TWO_CALLS), size)]
        deltas = [stream.delta(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        content = "".join(d.get("content", "") for d in deltas)
        calls: dict[int, dict] = {}
        for entry in (e for d in deltas for e in d.get("tool_calls", [])):
            if entry["index"] not in calls:
                assert set(entry) == {"index", "id", "type", "function"} and set(entry["function"]) == {
                    "name", "arguments"}
                calls[entry["index"]] = {"id": entry["id"], "type": entry["type"], "function": dict(entry["function"])}
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
        assert sorted(calls) == [0, 1] and stream.called
        assert content == whole_content and _calls(list(calls.values())) == _calls(whole_calls)
        assert all(json.loads(c["function"]["arguments"]) for c in calls.values())


def test_a_streamed_delta_carries_one_entry_per_call_and_text_outside_calls_as_content():
    stream = HERMES.reading(ToolChoice("auto")).stream()
    delta = stream.delta('Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> <tool_call>{"name', False)
    assert delta["content"] == "Hi  "
    [entry] = delta["tool_calls"]
    assert entry["index"] == 0 and entry["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert stream.delta('": "g", "arguments": {}}', False)["tool_calls"][0]["function"] == {"name": "g",
                                                                                              "arguments": "{}"}
    assert stream.delta("", True) == {}
    unparallel = HERMES.reading(ToolChoice("auto"), parallel=False).stream()
    delta = unparallel.delta('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", '
                             '"arguments": {}}</tool_call>', True)
    assert [e["function"]["name"] for e in delta["tool_calls"]] == ["f"]


def test_auto_needs_the_servers_flag_and_the_flags_are_checked_at_start_up():
    with pytest.raises(ValueError) as e:
        ToolCallingConfig(tool_call_parser="hermes").reading(ToolChoice("auto"))
    assert str(e.value).startswith('tool_choice "auto" (the default when tools are given) requires a server started '
                                   "with --enable-auto-tool-choice and --tool-call-parser")
    with pytest.raises(ValueError) as e:
        ToolCallingConfig(enable_auto_tool_choice=True)
    assert str(e.value) == ("--enable-auto-tool-choice needs --tool-call-parser (one of hermes, llama3_json, mistral, "
                            "pythonic) to read the model's calls")
    with pytest.raises(ValueError, match="^--tool-call-parser 'granite' is not known; choose one of hermes, "):
        ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="granite")
    assert ToolCallingConfig(exclude_tools_when_tool_choice_none=True).excludes_tools(ToolChoice("none"))
    assert not ToolCallingConfig(exclude_tools_when_tool_choice_none=True).excludes_tools(ToolChoice("required"))
    assert not ToolCallingConfig().excludes_tools(ToolChoice("none"))


def test_serve_refuses_bad_tool_flags_before_building_an_engine(capsys):
    from jengine.cli import main

    assert main(["serve", "jengine/tiny-llama", "--enable-auto-tool-choice"]) == 2
    assert capsys.readouterr().err == ("jengine: error: --enable-auto-tool-choice needs --tool-call-parser (one of "
                                       "hermes, llama3_json, mistral, pythonic) to read the model's calls\n")
    assert main(["serve", "jengine/tiny-llama", "--enable-auto-tool-choice", "--tool-call-parser", "granite"]) == 2
    assert capsys.readouterr().err == ("jengine: error: --tool-call-parser 'granite' is not known; choose one of "
                                       "hermes, llama3_json, mistral, pythonic\n")
