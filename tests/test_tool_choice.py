"""tool_choice against the request's tools, and the schema a constrained choice holds the output to."""

from __future__ import annotations

import copy

import pytest

from jengine.entrypoints.tool_choice import NO_PARAMETERS, ToolChoice, output_schema, resolve_tool_choice
from jengine.structured_output import StructuredOutputsParams, grammar_text

CITY = {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}, "required": ["city"],
        "$defs": {"city": {"type": "string", "maxLength": 20}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}},
         {"type": "function", "function": {"name": "now", "description": None, "parameters": None}}]


@pytest.mark.parametrize("tools,given,want", [
    (TOOLS, None, ToolChoice("auto")),
    (None, None, ToolChoice("none")),
    ([], None, ToolChoice("none")),
    (TOOLS, "none", ToolChoice("none")),
    (None, "none", ToolChoice("none")),
    (TOOLS, "auto", ToolChoice("auto")),
    (TOOLS, "required", ToolChoice("required")),
    ([], "required", ToolChoice("none")),  # OpenAI's: nothing to require
    ([], "auto", ToolChoice("none")),
    (TOOLS, {"type": "function", "function": {"name": "now"}}, ToolChoice("function", "now")),
    (TOOLS, {"function": {"name": "get_weather"}}, ToolChoice("function", "get_weather")),
])
def test_tool_choice_resolves_as_in_vllm(tools, given, want):
    assert resolve_tool_choice(tools, given) == want


@pytest.mark.parametrize("tools,given,message", [
    (None, "auto", "tool_choice 'auto' needs tools: send the functions the model may call"),
    (None, {"type": "function", "function": {"name": "now"}}, "tool_choice {'type': 'function', 'function': "
     "{'name': 'now'}} needs tools: send the functions the model may call"),
    (TOOLS, "always", "tool_choice must be one of 'none', 'auto', 'required' or a named function (a named function "
     "is {\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}), got 'always'"),
    (TOOLS, 3, "tool_choice must be a string or an object; a named function is {\"type\": \"function\", "
     "\"function\": {\"name\": \"my_function\"}}"),
    (TOOLS, {"type": "code", "function": {"name": "now"}}, "tool_choice is not a named function: a named function "
     "is {\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}"),
    (TOOLS, {"type": "function", "function": {"name": ""}}, "tool_choice.function.name must be a non-empty string, "
     "got ''"),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}, "tool_choice names the function 'get_time', "
     "which is not among the request's tools"),
])
def test_a_tool_choice_that_does_not_fit_the_tools_is_refused_naming_tool_choice(tools, given, message):
    with pytest.raises(ValueError) as e:
        resolve_tool_choice(tools, given)
    assert str(e.value) == message


def test_required_is_an_array_of_at_least_one_call_of_a_given_tool_with_its_parameters():
    before = copy.deepcopy(TOOLS)
    schema = output_schema(TOOLS, ToolChoice("required"))
    assert TOOLS == before  # the request's schemas are not changed
    city = {k: v for k, v in CITY.items() if k != "$defs"}
    assert schema == {
        "type": "array", "minItems": 1, "$defs": CITY["$defs"],
        "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": city},
             "required": ["name", "parameters"], "additionalProperties": False},
            {"type": "object", "properties": {"name": {"type": "string", "enum": ["now"]}, "parameters": NO_PARAMETERS},
             "required": ["name", "parameters"], "additionalProperties": False}]}}
    grammar_text(StructuredOutputsParams(json=schema))  # llguidance compiles it, $refs and all
    assert output_schema(TOOLS, ToolChoice("required"), parallel=False) == {**schema, "maxItems": 1}


def test_a_named_function_is_constrained_to_its_parameters_and_one_without_them_to_an_empty_object():
    assert output_schema(TOOLS, ToolChoice("function", "get_weather")) == CITY
    assert output_schema(TOOLS, ToolChoice("function", "now")) == NO_PARAMETERS
    assert output_schema(TOOLS, ToolChoice("auto")) is None and output_schema(TOOLS, ToolChoice("none")) is None


def test_required_refuses_tools_whose_shared_definitions_disagree():
    other = {"type": "object", "properties": {"c": {"$ref": "#/$defs/city"}}, "$defs": {"city": {"type": "integer"}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": other}}]
    with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters defines \$defs 'city' unlike another"):
        output_schema(tools, ToolChoice("required"))
    same = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": copy.deepcopy(CITY)}}]
    assert output_schema(same, ToolChoice("required"))["$defs"] == CITY["$defs"]
