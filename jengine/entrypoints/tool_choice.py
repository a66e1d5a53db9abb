"""A chat request's `tool_choice`, checked against its `tools`, and the JSON schema that constrains the
output where the choice leaves the model no freedom (vLLM's rules):

- absent or null: "auto" where tools are given, else "none";
- "none": no call is read from the output (the tools still reach the chat template);
- "auto": the model may call tools; the server's `--tool-call-parser` reads its calls;
- "required": the output is a JSON array of at least one `{"name": <a tool's name>, "parameters": <that
  tool's parameters>}` object (exactly one with parallel_tool_calls false); with an empty tools list it is
  "none", as in OpenAI's API;
- `{"type": "function", "function": {"name": NAME}}`: the output is NAME's arguments, a JSON object
  matching its parameters.

Plain Python. Errors a client can cause are ValueErrors that start with the request field at fault.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Literal

_CHOICES = ("none", "auto", "required")
_NAMED = 'a named function is {"type": "function", "function": {"name": "my_function"}}'
# A function without parameters takes none (OpenAI's meaning): its arguments are `{}`.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "function"]
    function: str | None = None  # the named function's name (mode "function")

    @property
    def constrained(self) -> bool:
        """Whether the output is constrained to calls (and read without a parser)."""
        return self.mode in ("required", "function")


def resolve_tool_choice(tools: list[dict] | None, tool_choice: Any) -> ToolChoice:
    """The request's tool choice; `tools` are the request's, each `{"type": "function", "function":
    {"name", "parameters"?, "description"?}}` (their shape already checked)."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice == "none":
        return ToolChoice("none")
    if tools is None:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools: send the functions the model may call")
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(map(repr, _CHOICES))} or a named function "
                             f"({_NAMED}), got {tool_choice!r}")
        return ToolChoice("none" if not tools else tool_choice)  # type: ignore[arg-type]
    if not isinstance(tool_choice, dict):
        raise ValueError(f"tool_choice must be a string or an object; {_NAMED}")
    function = tool_choice.get("function")
    if tool_choice.get("type", "function") != "function" or not isinstance(function, dict):
        raise ValueError(f"tool_choice is not a named function: {_NAMED}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool_choice.function.name must be a non-empty string, got {name!r}")
    if name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the request's tools")
    return ToolChoice("function", name)


def output_schema(tools: list[dict], choice: ToolChoice, parallel: bool = True) -> dict | None:
    """The JSON schema a constrained choice holds the output to; None for "none" and "auto". Without
    `parallel` (the request's parallel_tool_calls) "required" allows one call only."""
    if choice.mode == "function":
        function = next(t["function"] for t in tools if t["function"]["name"] == choice.function)
        return _parameters(function)
    if choice.mode != "required":
        return None
    # `$ref`s point into the root of the schema, so each tool's `$defs` move up to the array's
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters = _parameters(function)
        for def_name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(def_name, definition) != definition:
                raise ValueError(f"tools[{i}].function.parameters defines $defs {def_name!r} unlike another tool's; "
                                 "tool_choice 'required' needs every shared definition to agree")
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters(function: dict) -> dict:
    """A copy of a function's parameters schema (`NO_PARAMETERS` where it has none)."""
    parameters = function.get("parameters")
    return copy.deepcopy(NO_PARAMETERS if parameters is None else parameters)
