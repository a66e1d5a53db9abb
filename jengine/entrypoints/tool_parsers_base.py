"""What the tool-call parsers share (the parsers: `jengine.entrypoints.tool_parsers`): the deltas they return,
`extract` for a whole output, the reader of one JSON call object, and the base of the readers.

Every reader works on deltas: `feed(text)` takes the next piece of the output and returns what can be told so far
(`ParsedDelta`: text outside calls, and for each call first its whole name, then pieces of its arguments);
`finish()` releases what was held back. Text that might open a call (a tag cut short at the end of a delta) is held
back until the next delta says.

Text outside calls that is only whitespace is no content (None). Output that breaks a parser's format is text, as
in vLLM: `extract` then returns all of it as content and no calls. A stream cannot take back a call it has begun
(sent its name); it drops the rest of a broken one, and gives back as text a broken one not begun yet.
"""

from __future__ import annotations

import dataclasses
import json

from jengine.entrypoints.json_scan import ObjectScanner

WS = " \t\n\r"


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
        return ExtractedToolCalls(text if text.strip(WS) else None, [])
    calls: list[ToolCall] = []
    for d in parsed.calls:
        if d.name is not None:
            calls.append(ToolCall(d.name, ""))
        calls[d.index].arguments += d.arguments
    return ExtractedToolCalls(parsed.content or None, calls)


class Content:
    """Text outside calls, as it is released: whitespace is held until some other character comes, so
    output whose text outside calls is only whitespace has no content at all."""

    def __init__(self) -> None:
        self.held, self.started = "", False

    def push(self, text: str) -> str:
        if self.started:
            return text
        self.held += text
        if not self.held.strip(WS):
            return ""
        self.started, text, self.held = True, self.held, ""
        return text


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` might begin `tag` (a proper prefix of it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def starts_with(text: str, tag: str) -> bool | None:
    """Whether `text` begins with `tag`; None while it cannot tell (`text` is a proper prefix of `tag`)."""
    if text.startswith(tag):
        return True
    return None if tag.startswith(text) else False


class CallReader:
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


class Reader:
    """What the readers share: the text not yet read (`pending`), what was read since the point a broken call is
    given back from (`read`), the call being read (`call`, with `named` and `done`), and the calls read. Each
    reader's `state` "text" passes text on, and "skip" drops what follows a broken call."""

    first_state = "text"

    def __init__(self) -> None:
        self.pending = ""
        self.read = ""
        self.state = self.first_state
        self.call = None
        self.calls = 0
        self.failed = False  # the text broke the format somewhere
        self.content = Content()

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

    def _take(self, n: int) -> None:
        """Move the first `n` pending characters to `read`."""
        self.read, self.pending = self.read + self.pending[:n], self.pending[n:]

    def _skip_ws(self) -> None:
        self._take(len(self.pending) - len(self.pending.lstrip(WS)))

    def _text_until(self, tag: str, out: ParsedDelta) -> bool:
        """Pass pending text on as content up to `tag` (holding back what may begin it); True once the tag is read,
        which then begins `read`."""
        i = self.pending.find(tag)
        if i < 0:
            keep = held_back(self.pending, tag)
            out.content += self.content.push(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        out.content += self.content.push(self.pending[:i])
        self.read, self.pending = tag, self.pending[i + len(tag):]
        return True

    def _read_call(self, out: ParsedDelta, then: str) -> bool:
        """Feed the pending text to the open call, and go on to state `then` once it is whole; False while it needs
        more text."""
        used, news = self.call.feed(self.pending)
        self._take(used)
        out.calls.extend(news)
        if self.call.error is not None:
            self._broken(out)
        elif self.call.done:
            self.calls += 1
            self.state = then
        else:
            return False
        return True

    def _settled(self, out: ParsedDelta) -> bool:
        """Whether the output's rest is settled: in state "text" (where a reader's output is all text) pending text
        goes out as content, in "skip" it is dropped."""
        if self.state not in ("text", "skip"):
            return False
        if self.state == "text":
            out.content += self.content.push(self.pending)
        self.pending = ""
        return True

    def _begun(self) -> bool:
        """Whether a call the client knows of stands in what was read."""
        return self.calls > 0 or (self.call is not None and self.call.named)

    def _broken(self, out: ParsedDelta) -> None:
        """The text broke the format: drop what follows where a call has begun, else give `read` back as text."""
        self.failed = True
        if self._begun():
            self.state = "skip"
        else:
            out.content += self.content.push(self.read)
            self.state = "text"
        self.call, self.read = None, ""
