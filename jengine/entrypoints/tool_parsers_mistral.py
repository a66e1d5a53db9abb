"""The `mistral` tool-call parser: text, then the calls after Mistral models' `[TOOL_CALLS]` token, in either form
their tokenizers have had:

- before v11: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, a JSON array of call objects;
- v11 on: `[TOOL_CALLS]name[ARGS]{...}` for each call, the arguments a JSON object (`[ARGS]` may be missing, and a
  `[CALL_ID]id` before it is passed over: the server makes its own ids).

Either form may follow another `[TOOL_CALLS]`. Text before the first `[TOOL_CALLS]` is content. As in vLLM, text
after the calls (anything but another `[TOOL_CALLS]`) is dropped: vLLM reads the array with `raw_decode`, which
ignores what follows it. Output that breaks the format otherwise (no call after `[TOOL_CALLS]`, a name that is
not a function name, arguments that are not JSON) is text. Arguments are the JSON text the model wrote; vLLM
re-serializes the array form's.
"""

from __future__ import annotations

import string

from jengine.entrypoints.json_scan import ObjectScanner
from jengine.entrypoints.tool_parsers_base import CallDelta, CallReader, ParsedDelta, Reader, starts_with

# What a function name may hold (OpenAI's and mistral-common's rule).
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")


class _ArgumentsReader:
    """A v11 call's arguments, a JSON object, read as it streams; its `name` goes out with the object's first
    character (with the same interface as `CallReader`)."""

    def __init__(self, index: int, name: str) -> None:
        self.index, self.name = index, name
        self.scanner = ObjectScanner()
        self.named = False
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.error is None and self.scanner.end is not None

    def feed(self, text: str) -> tuple[int, list[CallDelta]]:
        sent = len(self.scanner.text)
        used = self.scanner.feed(text)
        self.error = self.scanner.error
        if len(self.scanner.text) == sent:
            return used, []
        delta = CallDelta(self.index, name=None if self.named else self.name, arguments=self.scanner.text[sent:])
        self.named = True
        return used, [delta]


class MistralToolParser(Reader):
    """States: "text" (content until `[TOOL_CALLS]`), "calls" (after it), "name" and "call_id" (a v11 call's name
    and id), "arguments" (after them), "call" (reading a v11 call's arguments), "object" / "item" / "next" (an
    array's call objects and what comes between them), "after" (the calls so far are whole), "skip"."""

    # [TOOL_CALLS] and [ARGS] are special tokens of Mistral's tokenizers: keep them in the detokenized text.
    keeps_special_tokens = True
    CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def __init__(self) -> None:
        super().__init__()
        self.name = ""

    def _step(self, out: ParsedDelta) -> bool:
        """Read some pending text; False when more text is needed."""
        if self.state == "text":
            if not self._text_until(self.CALLS, out):
                return False
            self.state = "calls"
            return True
        if self._settled(out):  # "skip"
            return False
        if self.state in ("call", "item"):
            return self._read_call(out, "after" if self.state == "call" else "next")
        if self.state in ("name", "call_id"):
            return self._name(out)
        self._skip_ws()
        if self.state == "after":
            found = starts_with(self.pending, self.CALLS)
            if found is None:
                return False
            if found:
                self._take(len(self.CALLS))
                self.state = "calls"
            else:  # text after the calls
                self.pending, self.state = "", "skip"
            return True
        if not self.pending:
            return False
        first = self.pending[0]
        if self.state == "calls":
            if first == "[":
                self._take(1)
            self.name, self.state = "", "object" if first == "[" else "name"
        elif self.state == "arguments":
            if first != "{":
                self._broken(out)
            else:
                self.call, self.state = _ArgumentsReader(self.calls, self.name), "call"
        elif self.state == "object":
            if first != "{":
                self._broken(out)
            else:
                self.call, self.state = CallReader(self.calls), "item"
        elif first in ",]":  # "next"
            self._take(1)
            self.state = "object" if first == "," else "after"
        else:
            self._broken(out)
        return True

    def _name(self, out: ParsedDelta) -> bool:
        """Read a v11 call's name (or the id after it) up to `[ARGS]`, `[CALL_ID]` or the arguments' `{`."""
        n = next((i for i, ch in enumerate(self.pending) if ch not in _NAME_CHARS), len(self.pending))
        if self.state == "name":
            self.name += self.pending[:n]
        self._take(n)
        if not self.pending:
            return False
        tags = (self.ARGS, self.CALL_ID) if self.state == "name" else (self.ARGS,)
        found = [(tag, starts_with(self.pending, tag)) for tag in tags]
        if any(f is None for _, f in found):
            return False
        tag = next((tag for tag, f in found if f), None)
        if not self.name or (tag is None and self.pending[0] != "{"):
            self._broken(out)
            return True
        self._take(len(tag or ""))
        self.state = "call_id" if tag == self.CALL_ID else "arguments"
        return True

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.state == "text":
            out.content += self.content.push(self.pending)
        elif self.state not in ("after", "skip"):  # calls cut short
            self._take(len(self.pending))
            self._broken(out)
        self.pending = ""
        return out
