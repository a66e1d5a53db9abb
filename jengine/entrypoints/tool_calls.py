"""Tool calls in chat responses: the server's tool-calling options (vLLM's flags), which reader a request's
`tool_choice` needs, and the OpenAI fields built from what it reads, for a whole message and as a stream.

A whole message has `tool_calls` (`{"id": "chatcmpl-tool-<hex>", "type": "function", "function": {"name",
"arguments"}}`, arguments JSON text) beside `content`, the text outside calls. A stream sends, for each call,
first `{"index", "id", "type", "function": {"name", "arguments"}}` and then `{"index", "function":
{"arguments"}}` pieces; text outside calls goes out as `content`. `finish_reason` is "tool_calls" where calls
came from "auto" or "required" and the output stopped by itself; a named function keeps "stop", as in vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Callable
from typing import Any

from jengine.entrypoints.tool_choice import ToolChoice
from jengine.entrypoints.tool_parsers import TOOL_PARSERS, CallDelta, NamedCall, RequiredCalls, extract, tool_parser


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclasses.dataclass(frozen=True)
class ToolCallingConfig:
    """`--enable-auto-tool-choice`, `--tool-call-parser` and `--exclude-tools-when-tool-choice-none`."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)  # a ValueError naming the known parsers
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_PARSERS)}) "
                             "to read the model's calls")

    def excludes_tools(self, choice: ToolChoice) -> bool:
        """Whether the chat template goes without the request's tools (only ever with tool_choice "none")."""
        return choice.mode == "none" and self.exclude_tools_when_tool_choice_none

    def reading(self, choice: ToolChoice, parallel: bool = True) -> ToolCallReading | None:
        """How a request's outputs are read for calls; None where they are not ("none")."""
        if choice.mode == "none":
            return None
        if choice.mode == "auto":
            if not self.enable_auto_tool_choice:
                raise ValueError('tool_choice "auto" (the default when tools are given) requires a server started '
                                 "with --enable-auto-tool-choice and --tool-call-parser; send tool_choice \"none\" to "
                                 "give the tools to the chat template only")
            parser = tool_parser(self.tool_call_parser)
            return ToolCallReading(choice.mode, parser, parallel, parser.keeps_special_tokens)
        if choice.mode == "required":
            return ToolCallReading(choice.mode, RequiredCalls, parallel)
        return ToolCallReading(choice.mode, functools.partial(NamedCall, choice.function), parallel)


@dataclasses.dataclass(frozen=True)
class ToolCallReading:
    """How one request's outputs are read: `new_reader()` makes a reader for one choice (see
    `jengine.entrypoints.tool_parsers`); with `parallel` false only the first call is kept."""

    mode: str
    new_reader: Callable[[], Any]
    parallel: bool = True
    keeps_special_tokens: bool = False  # the parser needs special tokens left in the text

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole output."""
        found = extract(self.new_reader(), text)
        calls = found.calls if self.parallel else found.calls[:1]
        content = found.content
        if calls and self.mode in ("required", "function"):
            content = ""  # vLLM's: constrained output is all calls
        return content, [{"id": new_call_id(), "type": "function",
                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        return "tool_calls" if called and reason == "stop" and self.mode != "function" else reason

    def stream(self) -> StreamedToolCalls:
        return StreamedToolCalls(self.new_reader(), self.parallel)


class StreamedToolCalls:
    """One choice's output as it streams: each piece of text in, the `delta` fields it adds out."""

    def __init__(self, reader, parallel: bool):
        self.reader, self.parallel = reader, parallel
        self.called = False

    def delta(self, text: str, finished: bool) -> dict:
        parsed = self.reader.feed(text)
        if finished:
            parsed.add(self.reader.finish())
        fields: dict = {}
        if parsed.content:
            fields["content"] = parsed.content
        calls = self._calls(parsed.calls)
        if calls:
            fields["tool_calls"] = calls
        return fields

    def _calls(self, news: list[CallDelta]) -> list[dict]:
        """The news as delta entries, one per call (a call's name and first arguments come together)."""
        entries: dict[int, dict] = {}
        for d in news:
            if d.index > 0 and not self.parallel:
                continue
            if d.index in entries:
                entries[d.index]["function"]["arguments"] += d.arguments
            elif d.name is not None:
                self.called = True
                entries[d.index] = {"index": d.index, "id": new_call_id(), "type": "function",
                                    "function": {"name": d.name, "arguments": d.arguments}}
            else:
                entries[d.index] = {"index": d.index, "function": {"arguments": d.arguments}}
        return list(entries.values())
