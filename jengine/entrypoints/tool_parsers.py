"""Tool-call parsers: a model's output text in, the function calls in it (and the text around them) out,
as vLLM's `--tool-call-parser`s read them. Pure text processing: no server code.

Every reader here works on deltas: `feed(text)` takes the next piece of the output and returns what can
be told so far (`ParsedDelta`: text outside calls, and for each call first its whole name, then pieces of
its arguments); `finish()` releases what was held back. Text that might open a call (a `<tool_call>` cut
short at the end of a delta) is held back until the next delta says. A call's arguments are the JSON text
the model wrote for them, so the pieces streamed add up to exactly the arguments `extract` returns.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text, as
  Hermes, Qwen2.5 and Qwen3 models write them (the closing tag of the last block may be missing);
- `llama3_json`: the whole output is a call `{"name": ..., "parameters": {...}}` (or "arguments"), or
  several separated by `;`, optionally after `<|python_tag|>`; anything else is text;
- `RequiredCalls` and `NamedCall` read output that `tool_choice` "required" / a named function
  constrained: a JSON array of {"name", "parameters"} objects, and one function's arguments.

Text outside calls that is only whitespace is no content (None). Output that breaks a parser's format is
text, as in vLLM: `extract` then returns all of it as content and no calls. A stream cannot take back a
call it has begun (sent its name); it drops the rest of a broken one, and gives back as text a broken one
not begun yet.
"""

from __future__ import annotations

import dataclasses
import json

from jengine.entrypoints.json_scan import ObjectScanner

_WS = " \t\n\r"


@dataclasses.dataclass
class CallDelta:
    """News of call `index` (its place among the output's calls): its whole `name` in its first delta
    only, then `arguments` text to append."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = dataclasses.field(default_factory=list)

    def add(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclasses.dataclass
class ExtractedToolCalls:
    content: str | None  # None where the text outside calls is empty or only whitespace
    calls: list[ToolCall]


def extract(reader, text: str) -> ExtractedToolCalls:
    """The calls in a whole output, read by a fresh `reader`; output that breaks the format is all content."""
    parsed = reader.feed(text).add(reader.finish())
    if reader.failed:
        return ExtractedToolCalls(text if text.strip(_WS) else None, [])
    calls: list[ToolCall] = []
    for d in parsed.calls:
        if d.name is not None:
            calls.append(ToolCall(d.name, ""))
        calls[d.index].arguments += d.arguments
    return ExtractedToolCalls(parsed.content or None, calls)


class _Content:
    """Text outside calls, as it is released: whitespace is held until some other character comes, so
    output whose text outside calls is only whitespace has no content at all."""

    def __init__(self) -> None:
        self.held, self.started = "", False

    def push(self, text: str) -> str:
        if self.started:
            return text
        self.held += text
        if not self.held.strip(_WS):
            return ""
        self.started, text, self.held = True, self.held, ""
        return text


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` might begin `tag` (a proper prefix of it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _CallReader:
    """One call object, `{"name": ..., "arguments" | "parameters": ...}` (other keys are ignored), read
    as it streams: the name once its string has closed and the arguments' key has come (an object without
    both is not a call: `{"name": "Bob", "age": 3}` is an answer), then the arguments' text as it grows (an
    object or array piece by piece; a string, which carries JSON text, decoded once whole; any other value
    once whole)."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self, index: int) -> None:
        self.index = index
        self.scanner = ObjectScanner()
        self.named = False  # the name went out: the call exists for the client
        self.sent = 0  # characters of the arguments sent
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.error is None and self.scanner.end is not None

    def feed(self, text: str) -> tuple[int, list[CallDelta]]:
        """(characters of `text` that belong to the call, news of it). What the text tells is judged as if it
        came one character at a time, so that how the output is cut into deltas changes nothing: a fault
        ends the call where it stands, after whatever came before it."""
        used = self.scanner.feed(text)
        news = self._news()
        if self.error is None and self.scanner.error is not None:
            self.error = self.scanner.error
        return used, news

    def _news(self) -> list[CallDelta]:
        members, text = self.scanner.members, self.scanner.text
        # a second name or arguments is a fault where its key starts: members from there on do not count
        roles = ["name" if m.key == "name" else "arguments" if m.key in self.ARGUMENT_KEYS else None
                 for m in members]
        fault = next((m.key_start for i, (m, role) in enumerate(zip(members, roles)) if role and role in roles[:i]),
                     None)
        if fault is not None:
            members = [m for m in members if m.key_start < fault]
        name = next((m for m in members if m.key == "name"), None)
        args = next((m for m in members if m.key in self.ARGUMENT_KEYS), None)
        news = []
        if name is not None and name.value_end is not None and not self.named:
            value = json.loads(text[name.value_start:name.value_end])
            if not isinstance(value, str):
                self.error = f"a call's name must be a string, got {value!r}"
                return []
            if args is not None:
                self.named = True
                news.append(CallDelta(self.index, name=value))
        if fault is not None:
            self.error = "a call has more than one name or arguments"
        elif self.scanner.end is not None and not self.named:
            self.error = "a call needs a name and arguments"
        if not self.named:
            return news
        available = self._arguments(args, text)
        if len(available) > self.sent:
            if not news:
                news.append(CallDelta(self.index))
            news[0].arguments, self.sent = available[self.sent:], len(available)
        return news

    @staticmethod
    def _arguments(member, text: str) -> str:
        """The arguments' text known so far."""
        if member.value_start is None:
            return ""
        if text[member.value_start] in "{[":
            return text[member.value_start:member.value_end]  # open: all of it so far
        if member.value_end is None:
            return ""
        value = text[member.value_start:member.value_end]
        return json.loads(value) if value.startswith('"') else value


class _Reader:
    """What the readers share: the text not yet read (`pending`), the call being read, and the calls read."""

    def __init__(self) -> None:
        self.pending = ""
        self.call: _CallReader | None = None
        self.calls = 0
        self.failed = False  # the text broke the format somewhere
        self.content = _Content()

    def feed(self, text: str) -> ParsedDelta:
        """What `text`, the output's next piece, adds: content and call pieces (text that may be the start of a
        call is held back)."""
        self.pending += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Read some pending text into `out`; False when more text is needed."""
        raise NotImplementedError

    def _read_call(self, out: ParsedDelta) -> bool:
        """Feed the pending text to the open call; True when the call is whole."""
        used, news = self.call.feed(self.pending)
        self.pending = self.pending[used:]
        out.calls.extend(news)
        if self.call.done:
            self.calls += 1
            return True
        return False

    def _skip_ws(self) -> str:
        stripped = self.pending.lstrip(_WS)
        ws, self.pending = self.pending[:len(self.pending) - len(stripped)], stripped
        return ws


class HermesToolParser(_Reader):
    """`<tool_call>` JSON `</tool_call>` blocks among text. A block that breaks before its call's name is
    out is text again; after that, the rest of it up to `</tool_call>` is dropped."""

    # The tags are special tokens in some tokenizers (Hermes): keep them in the detokenized text.
    keeps_special_tokens = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "text"
        self.block = ""  # the open block's text so far, given back as content if it breaks early

    def _step(self, out: ParsedDelta) -> bool:
        """Read some pending text; False when more text is needed."""
        if self.state == "text":
            i = self.pending.find(self.OPEN)
            if i < 0:
                keep = _held_back(self.pending, self.OPEN)
                out.content += self.content.push(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return False
            out.content += self.content.push(self.pending[:i])
            self.pending, self.block, self.state = self.pending[i + len(self.OPEN):], self.OPEN, "open"
        elif self.state == "open":
            self.block += self._skip_ws()
            if not self.pending:
                return False
            if self.pending[0] != "{":
                self._broken(out)
            else:
                self.call, self.state = _CallReader(self.calls), "call"
        elif self.state == "call":
            before = self.pending
            whole = self._read_call(out)
            self.block += before[:len(before) - len(self.pending)]
            if self.call.error is not None:
                self._broken(out)
            elif not whole:
                return False
            else:
                self.state = "closing"
        elif self.state == "closing":
            self._skip_ws()
            if self.pending.startswith(self.CLOSE):
                self.pending, self.state = self.pending[len(self.CLOSE):], "text"
            elif self.CLOSE.startswith(self.pending):
                return False
            else:
                self._broken(out)
        else:  # "skip": a broken call, until its closing tag
            i = self.pending.find(self.CLOSE)
            if i < 0:
                self.pending = self.pending[len(self.pending) - _held_back(self.pending, self.CLOSE):]
                return False
            self.pending, self.state = self.pending[i + len(self.CLOSE):], "text"
        return True

    def _broken(self, out: ParsedDelta) -> None:
        self.failed = True
        if self.call is not None and self.call.named:
            self.state = "skip"
        else:
            out.content += self.content.push(self.block)
            self.state = "text"
        self.call, self.block = None, ""

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.state == "text":
            out.content += self.content.push(self.pending)
        elif self.state in ("open", "call"):  # a block cut short
            self.block += self.pending
            self._broken(out)
        self.pending = ""
        return out


class Llama3JsonToolParser(_Reader):
    """Output that is one or more call objects separated by `;` (after an optional `<|python_tag|>`), or
    else text. Output that breaks the format before a call's name is out is all text."""

    keeps_special_tokens = False
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"
        self.read = ""  # everything read as calls, given back as content if they break early

    def _step(self, out: ParsedDelta) -> bool:
        if self.state == "text":
            out.content += self.content.push(self.pending)
            self.pending = ""
            return False
        if self.state == "skip":
            self.pending = ""
            return False
        if self.state == "call":
            before = self.pending
            whole = self._read_call(out)
            self.read += before[:len(before) - len(self.pending)]
            if self.call.error is not None:
                self._broken(out)
                return True
            self.state = "after" if whole else "call"
            return whole
        self.read += self._skip_ws()
        if not self.pending:
            return False
        if self.state == "start":
            if self.pending.startswith(self.TAG):
                self.read, self.pending, self.state = self.read + self.TAG, self.pending[len(self.TAG):], "object"
            elif self.TAG.startswith(self.pending):
                return False
            else:
                self.state = "object"
        elif self.state == "object":
            if self.pending[0] != "{":
                self._broken(out)
            else:
                self.call, self.state = _CallReader(self.calls), "call"
        elif self.pending[0] == ";":  # "after" a call
            self.read, self.pending, self.state = self.read + ";", self.pending[1:], "object"
        else:
            self._broken(out)
        return True

    def _broken(self, out: ParsedDelta) -> None:
        self.failed = True
        if self.calls or (self.call is not None and self.call.named):
            self.state = "skip"
        else:
            out.content += self.content.push(self.read)
            self.state = "text"
        self.call = None

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.state == "start" or (self.state == "object" and not self.calls) or self.state == "call":
            self.read += self.pending
            self.pending = ""
            self._broken(out)
        self._step(out)
        return out


class RequiredCalls(_Reader):
    """Output constrained by tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`."""

    keeps_special_tokens = False

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"

    def feed(self, text: str) -> ParsedDelta:
        self.pending += text
        out = ParsedDelta()
        while not self.failed and self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        if self.state == "call":
            whole = self._read_call(out)
            if self.call.error is not None:
                self.failed = True
            self.state = "after" if whole else "call"
            return whole
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
            self.call, self.state = _CallReader(self.calls), "call"
        else:
            self.pending, self.state = self.pending[1:], "object" if self.pending[0] == "," else "end"
        return True

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


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def tool_parser(name: str):
    """The parser class `--tool-call-parser NAME` names."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
