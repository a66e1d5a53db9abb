"""An incremental scanner of one JSON object: fed a piece of text at a time, it says where the object's
top-level members lie (key, start and end of each value) before the object is complete, and when the
text stops being a prefix of valid JSON.

Tool-call parsers read a model's output as it streams: they need a function call's name as soon as its
string closes, and the text of its arguments as it grows, without waiting for the whole object (which
`json.loads` would). Plain Python; one pass over each character.
"""

from __future__ import annotations

import dataclasses
import json

_WS = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
_LITERALS = {"t": "true", "f": "false", "n": "null"}

# What the scanner expects next, outside strings, numbers and literals.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE = range(6)
# Number states; those in _NUMBER_ENDS may end the number.
_SIGN, _ZERO, _INT, _DOT, _FRAC, _E, _E_SIGN, _EXP = range(8)
_NUMBER_ENDS = frozenset({_ZERO, _INT, _FRAC, _EXP})


@dataclasses.dataclass
class Member:
    """A top-level member of the object: offsets into the scanner's text. `key` is None until the key's
    string has closed; `value_end` None until the value is complete."""

    key_start: int
    key: str | None = None
    value_start: int | None = None
    value_end: int | None = None


class ObjectScanner:
    """Reads one JSON object (the first character fed must be `{`) and nothing after it."""

    def __init__(self) -> None:
        self.text = ""
        self.members: list[Member] = []
        self.end: int | None = None  # len(text) once the object has closed
        self.error: str | None = None
        self._stack: list[str] = []  # open containers, "{" or "["
        self._expect = _VALUE
        self._string: int | None = None  # start of the open string
        self._escape = 0  # 0: none; -1: after a backslash; n > 0: hex digits of \u still to come
        self._number: int | None = None  # state of the open number
        self._literal = ""  # the rest of an open true/false/null

    def feed(self, chunk: str) -> int:
        """Scan `chunk`; returns how many of its characters belong to the object. Fewer than all when the
        object closed within it, or when a character cannot continue valid JSON (`error` says which; that
        character is not counted, nor is anything after it)."""
        if self.end is not None or self.error is not None:
            return 0
        base = len(self.text)
        self.text += chunk
        for n, ch in enumerate(chunk):
            pos = base + n
            if not self._step(ch, pos):
                self.error = f"unexpected {ch!r} at offset {pos}"
                self.text = self.text[:pos]
                return n
            if self.end is not None:
                self.text = self.text[:pos + 1]
                return n + 1
        return len(chunk)

    # ------------------------------------------------------------------ one character

    def _step(self, ch: str, pos: int) -> bool:
        if self._string is not None:
            return self._in_string(ch, pos)
        if self._literal:
            if ch != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._value_done(pos + 1)
            return True
        if self._number is not None:
            if self._in_number(ch):
                return True
            if self._number not in _NUMBER_ENDS:
                return False
            self._number = None
            self._value_done(pos)  # `ch` follows the number: read it below
        if ch in _WS:
            return True
        expect = self._expect
        if expect in (_VALUE, _VALUE_OR_CLOSE):
            if expect == _VALUE_OR_CLOSE and ch == "]":
                return self._close(ch, pos)
            return self._start_value(ch, pos)
        if expect in (_KEY, _KEY_OR_CLOSE):
            if expect == _KEY_OR_CLOSE and ch == "}":
                return self._close(ch, pos)
            if ch != '"':
                return False
            if len(self._stack) == 1:
                self.members.append(Member(key_start=pos))
            self._string = pos
            return True
        if expect == _COLON:
            if ch != ":":
                return False
            self._expect = _VALUE
            return True
        if ch == ",":  # _COMMA_OR_CLOSE
            self._expect = _KEY if self._stack[-1] == "{" else _VALUE
            return True
        return self._close(ch, pos)

    def _start_value(self, ch: str, pos: int) -> bool:
        if not self._stack and ch != "{":
            return False  # the scanned value is an object
        if len(self._stack) == 1:
            self.members[-1].value_start = pos
        if ch in "{[":
            self._stack.append(ch)
            self._expect = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
        elif ch == '"':
            self._string = pos
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self._number = _SIGN if ch == "-" else _ZERO if ch == "0" else _INT
        elif ch in _LITERALS:
            self._literal = _LITERALS[ch][1:]
        else:
            return False
        return True

    def _close(self, ch: str, pos: int) -> bool:
        if ch != {"{": "}", "[": "]"}[self._stack[-1]]:
            return False
        self._stack.pop()
        if not self._stack:
            self.end = pos + 1
        else:
            self._value_done(pos + 1)
        return True

    def _value_done(self, end: int) -> None:
        """A value (or a key) ended at `end`, inside the innermost open container."""
        if len(self._stack) == 1:
            self.members[-1].value_end = end
        self._expect = _COMMA_OR_CLOSE

    def _in_string(self, ch: str, pos: int) -> bool:
        if ord(ch) < 0x20:
            return False  # control characters must be escaped
        if self._escape == -1:
            if ch not in _ESCAPES and ch != "u":
                return False
            self._escape = 4 if ch == "u" else 0
        elif self._escape > 0:
            if ch not in _HEX:
                return False
            self._escape -= 1
        elif ch == "\\":
            self._escape = -1
        elif ch == '"':
            start, self._string = self._string, None
            if self._expect in (_KEY, _KEY_OR_CLOSE):
                if len(self._stack) == 1:
                    self.members[-1].key = json.loads(self.text[start:pos + 1])
                self._expect = _COLON
            else:
                self._value_done(pos + 1)
        return True

    def _in_number(self, ch: str) -> bool:
        """Advance the open number by `ch`; False when `ch` cannot continue it."""
        digit = ch.isdigit() and ch.isascii()
        state = self._number
        if state in (_SIGN, _DOT, _E_SIGN) and digit:
            self._number = {_SIGN: _ZERO if ch == "0" else _INT, _DOT: _FRAC, _E_SIGN: _EXP}[state]
        elif state == _E and (digit or ch in "+-"):
            self._number = _EXP if digit else _E_SIGN
        elif state in (_INT, _FRAC, _EXP) and digit:
            pass
        elif state in (_ZERO, _INT) and ch == ".":
            self._number = _DOT
        elif state in (_ZERO, _INT, _FRAC) and ch in "eE":
            self._number = _E
        else:
            return False
        return True
