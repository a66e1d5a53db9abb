"""Tool-call parsers: a model's output text in, the function calls in it (and the text around them) out,
as vLLM's `--tool-call-parser`s read them. Pure text processing: no server code. How the readers stream (deltas,
text held back, broken output) is told in `jengine.entrypoints.tool_parsers_base`. A call's arguments are the JSON
text the model wrote for them (but for `pythonic`, whose are derived from Python literals), and the pieces streamed
add up to exactly the arguments `extract` returns.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text, as
  Hermes, Qwen2.5 and Qwen3 models write them (the closing tag of the last block may be missing);
- `llama3_json`: the whole output is a call `{"name": ..., "parameters": {...}}` (or "arguments"), or
  several separated by `;`, optionally after `<|python_tag|>`; anything else is text;
- `mistral`: text, then calls after a `[TOOL_CALLS]` token (`jengine.entrypoints.tool_parsers_mistral`);
- `pythonic`: the whole output is a Python list of calls `[f(a=1), g(b="x")]`
  (`jengine.entrypoints.tool_parsers_pythonic`);
- `RequiredCalls` and `NamedCall` read output that `tool_choice` "required" / a named function
  constrained: a JSON array of {"name", "parameters"} objects, and one function's arguments.
"""

from __future__ import annotations

from jengine.entrypoints.tool_parsers_base import (
    CallDelta,
    CallReader,
    ExtractedToolCalls,
    ParsedDelta,
    Reader,
    ToolCall,
    extract,
    held_back,
    starts_with,
)
from jengine.entrypoints.tool_parsers_mistral import MistralToolParser
from jengine.entrypoints.tool_parsers_pythonic import PythonicToolParser

__all__ = ["TOOL_PARSERS", "CallDelta", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "NamedCall", "ParsedDelta", "PythonicToolParser", "RequiredCalls", "ToolCall",
           "extract", "tool_parser"]


class HermesToolParser(Reader):
    """`<tool_call>` JSON `</tool_call>` blocks among text. A block that breaks before its call's name is
    out is text again; after that, the rest of it up to `</tool_call>` is dropped."""

    # The tags are special tokens in some tokenizers (Hermes): keep them in the detokenized text.
    keeps_special_tokens = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _step(self, out: ParsedDelta) -> bool:
        """Read some pending text; False when more text is needed."""
        if self.state == "text":
            if not self._text_until(self.OPEN, out):
                return False
            self.state = "open"
        elif self.state == "open":
            self._skip_ws()
            if not self.pending:
                return False
            if self.pending[0] != "{":
                self._broken(out)
            else:
                self.call, self.state = CallReader(self.calls), "call"
        elif self.state == "call":
            return self._read_call(out, "closing")
        elif self.state == "closing":
            self._skip_ws()
            found = starts_with(self.pending, self.CLOSE)
            if found is None:
                return False
            if found:
                self.pending, self.state = self.pending[len(self.CLOSE):], "text"
            else:
                self._broken(out)
        else:  # "skip": a broken call, until its closing tag
            i = self.pending.find(self.CLOSE)
            if i < 0:
                self.pending = self.pending[len(self.pending) - held_back(self.pending, self.CLOSE):]
                return False
            self.pending, self.state = self.pending[i + len(self.CLOSE):], "text"
        return True

    def _begun(self) -> bool:
        """Calls of earlier blocks do not count: a block is given back or dropped on its own."""
        return self.call is not None and self.call.named

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.state == "text":
            out.content += self.content.push(self.pending)
        elif self.state in ("open", "call"):  # a block cut short
            self._take(len(self.pending))
            self._broken(out)
        self.pending = ""
        return out


class Llama3JsonToolParser(Reader):
    """Output that is one or more call objects separated by `;` (after an optional `<|python_tag|>`), or
    else text. Output that breaks the format before a call's name is out is all text."""

    keeps_special_tokens = False
    TAG = "<|python_tag|>"
    first_state = "start"

    def _step(self, out: ParsedDelta) -> bool:
        if self._settled(out):
            return False
        if self.state == "call":
            return self._read_call(out, "after")
        self._skip_ws()
        if not self.pending:
            return False
        if self.state == "start":
            found = starts_with(self.pending, self.TAG)
            if found is None:
                return False
            if found:
                self._take(len(self.TAG))
            self.state = "object"
        elif self.state == "object":
            if self.pending[0] != "{":
                self._broken(out)
            else:
                self.call, self.state = CallReader(self.calls), "call"
        elif self.pending[0] == ";":  # "after" a call
            self._take(1)
            self.state = "object"
        else:
            self._broken(out)
        return True

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.state == "start" or (self.state == "object" and not self.calls) or self.state == "call":
            self._take(len(self.pending))
            self._broken(out)
        self._step(out)
        return out


class RequiredCalls(Reader):
    """Output constrained by tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`."""

    keeps_special_tokens = False
    first_state = "start"

    def feed(self, text: str) -> ParsedDelta:
        self.pending += text
        out = ParsedDelta()
        while not self.failed and self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        if self.state == "call":
            return self._read_call(out, "after")
        self._skip_ws()
        if not self.pending:
            return False
        expected = {"start": "[", "object": "{", "after": ",]", "end": ""}[self.state]
        if not expected or self.pending[0] not in expected:
            self.failed = True
            return False
        if self.state == "start":
            self.pending, self.state = self.pending[1:], "object"
        elif self.state == "object":
            self.call, self.state = CallReader(self.calls), "call"
        else:
            self.pending, self.state = self.pending[1:], "object" if self.pending[0] == "," else "end"
        return True

    def _broken(self, out: ParsedDelta) -> None:
        self.failed = True  # no text: the output was held to calls

    def finish(self) -> ParsedDelta:
        if self.state != "end":
            self.failed = True
        return ParsedDelta()


class NamedCall:
    """Output constrained by a named tool_choice: the whole text is that function's arguments."""

    keeps_special_tokens = False
    failed = False

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        delta = CallDelta(0, name=None if self.started else self.name, arguments=text)
        self.started = True
        return ParsedDelta(calls=[delta])

    def finish(self) -> ParsedDelta:
        """The call's name, where no text came at all."""
        if self.started:
            return ParsedDelta()
        self.started = True
        return ParsedDelta(calls=[CallDelta(0, name=self.name)])


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
                "pythonic": PythonicToolParser}


def tool_parser(name: str):
    """The parser class `--tool-call-parser NAME` names."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
