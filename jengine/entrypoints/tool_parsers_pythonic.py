"""The `pythonic` tool-call parser (Llama 3.2, Llama 4): the whole output is a Python list of calls,
`[get_weather(city="Paris", unit="c"), other(x=1)]`, optionally between `<|python_start|>` and `<|python_end|>`;
anything else is text, as in vLLM.

A call takes keyword arguments only, each a Python literal (string, number, True / False / None, list, tuple, dict);
`ast` reads them (nothing is evaluated), and the arguments sent are `json.dumps` of the dict of keyword arguments.
Since that JSON is derived, a stream sends each call whole, name and arguments in one delta, once its closing
parenthesis has been read; until then the call's text is held back. A call of another form (positional arguments,
a value that is not a literal or has no JSON form) breaks the format.
"""

from __future__ import annotations

import ast
import json

from jengine.entrypoints.tool_parsers_base import WS, CallDelta, ParsedDelta, Reader, starts_with

_OPENING = {")": "(", "]": "[", "}": "{"}


def call_of(text: str) -> tuple[str, str]:
    """(name, arguments as JSON text) of a call's text, `name(key=literal, ...)`; ValueError where it is not one."""
    try:
        call = ast.parse(text, mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.args:
            raise ValueError("a call takes keyword arguments only")
        arguments = {}
        for keyword in call.keywords:
            if keyword.arg is None or keyword.arg in arguments:
                raise ValueError("a call's keywords must be named, each once")
            arguments[keyword.arg] = ast.literal_eval(keyword.value)  # ValueError where it is not a literal
        return call.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, TypeError, RecursionError) as e:  # TypeError: a set, bytes, an unhashable dict key
        raise ValueError(f"not a call of literals: {e}") from e


class PythonCallReader:
    """One call `name(...)` as its text streams, with the interface of `CallReader`: it reads the name, then follows
    brackets and string literals (a `)` in a string closes nothing) until the call's `(` closes; `ast` then judges
    the whole call, which goes out in one delta."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.parts: list[str] = []  # the call's text so far, in the pieces it came in (joined once, when whole)
        self.name = ""  # the call's name as it is read
        self.brackets: list[str] = []  # the open brackets, the call's `(` first
        self.closed = False  # the call's `(` has closed
        self.quote = ""  # the open string's delimiter: one quote character or three
        self.opening = 0  # quotes read at the start of a string while it may still be triple-quoted: 1 or 2
        self.escape = False  # after a backslash in a string
        self.closing = 0  # quotes in a row at the end of the open string
        self.named = False  # the call went out
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.named

    def feed(self, text: str) -> tuple[int, list[CallDelta]]:
        """(characters of `text` that belong to the call, the call where it is whole)."""
        for n, ch in enumerate(text):
            if not self._step(ch):
                self.error = f"unexpected {ch!r} in a call"
                return n, []
            if self.closed:
                self.parts.append(text[: n + 1])
                try:
                    name, arguments = call_of("".join(self.parts))
                except ValueError as e:
                    self.error = str(e)
                    return n + 1, []
                self.named = True
                return n + 1, [CallDelta(self.index, name=name, arguments=arguments)]
        self.parts.append(text)
        return len(text), []

    def _step(self, ch: str) -> bool:
        """Read one character; False where it cannot continue the call."""
        if self.quote:
            return self._in_string(ch)
        if not self.brackets:  # the name, until its `(`
            if ch == "(" and self.name:
                self.brackets.append(ch)
                return True
            if not (ch.isidentifier() if not self.name else ("_" + ch).isidentifier()):
                return False
            self.name += ch
            return True
        if ch in "([{":
            self.brackets.append(ch)
        elif ch in _OPENING:
            if self.brackets.pop() != _OPENING[ch]:
                return False
            self.closed = not self.brackets
        elif ch in "'\"":
            self.quote, self.opening = ch, 1
        return True

    def _in_string(self, ch: str) -> bool:
        q = self.quote[0]
        if self.opening:
            if ch == q:  # `''` is empty, or the start of `'''`
                self.opening += 1
                if self.opening == 3:
                    self.quote, self.opening = q * 3, 0
                return True
            opened, self.opening = self.opening, 0
            if opened == 2:  # the string was empty: `ch` follows it
                self.quote = ""
                return self._step(ch)
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == q:
            self.closing += 1
            if self.closing == len(self.quote):
                self.quote, self.closing = "", 0
            return True
        self.closing = 0
        return True


class PythonicToolParser(Reader):
    """States: "start" (where `<|python_start|>` may come), "list" (the list's `[`), "item" (a call, or `]` after a
    trailing comma), "call" (reading one), "next" (`,` or `]`), "after" (where `<|python_end|>` may come), "end",
    "text" and "skip"."""

    keeps_special_tokens = False
    START, END = "<|python_start|>", "<|python_end|>"
    first_state = "start"

    def _step(self, out: ParsedDelta) -> bool:
        """Read some pending text; False when more text is needed."""
        if self._settled(out):
            return False
        if self.state == "call":
            return self._read_call(out, "next")
        self._skip_ws()
        if self.state in ("start", "after"):
            tag = self.START if self.state == "start" else self.END
            found = starts_with(self.pending, tag)
            if found is None:
                return False
            if found:
                self._take(len(tag))
            if self.state == "after" and not found:
                self._broken(out)
            else:
                self.state = "list" if self.state == "start" else "end"
            return True
        if not self.pending:
            return False
        first = self.pending[0]
        if self.state == "list" and first == "[":
            self._take(1)
            self.state = "item"
        elif (self.state == "next" and first in ",]") or (self.state == "item" and first == "]" and self.calls):
            self._take(1)
            self.state = "item" if first == "," else "after"
        elif self.state == "item":
            self.call, self.state = PythonCallReader(self.calls), "call"
        else:
            self._broken(out)
        return True

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.state not in ("after", "end", "text", "skip") or self.pending.strip(WS):  # cut short
            self._take(len(self.pending))
            self._broken(out)
        self._step(out)
        return out
