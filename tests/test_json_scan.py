"""The incremental JSON object scanner the tool-call parsers read calls with."""

from __future__ import annotations

import json

import pytest

from jengine.entrypoints.json_scan import ObjectScanner

VALID = [
    '{}',
    '{"a": 1}',
    '{ "name" : "f" , "arguments" : {"x": [1, -2.5e+3, 0, 0.5E2, true, false, null], "y": {"z": []}} }',
    '{"s": "q\\"uo\\\\te\\/\\b\\f\\n\\r\\t\\u00e9\\uD83D\\uDE00", "k\\u0041": "é😀"}',
    '{"n": -0, "m": 10, "e": 1e5}',
    '{"nested": {"name": "not a member of the root"}, "name": "root"}',
]
INVALID = [
    ('[1]', 0), ('x', 0), ('{a}', 1), ('{"a" 1}', 5), ('{"a": 01}', 7), ('{"a": -}', 7), ('{"a": 1.}', 8),
    ('{"a": 1e}', 8), ('{"a": tru}', 9), ('{"a": [1,]}', 9), ('{"a": 1,}', 8), ('{"a": "\\x"}', 8),
    ('{"a": "\\u12g4"}', 11), ('{"a": "tab\there"}', 10), ('{"a": NaN}', 6), ('{"a": 1]}', 7), ('{"a": {]}', 7),
]


def _scan(pieces: list[str]) -> tuple[ObjectScanner, int]:
    scanner, used = ObjectScanner(), 0
    for piece in pieces:
        used += scanner.feed(piece)
    return scanner, used


@pytest.mark.parametrize("text", VALID)
def test_members_of_a_valid_object_are_its_keys_and_value_spans_whatever_the_pieces(text):
    want = json.loads(text)
    for pieces in ([text], list(text), [text[:len(text) // 3], text[len(text) // 3:]]):
        scanner, used = _scan(pieces + ["trailing text"])
        assert scanner.error is None and scanner.end == used == len(text) and scanner.text == text
        got = {m.key: json.loads(text[m.value_start:m.value_end]) for m in scanner.members}
        assert got == want and len(scanner.members) == len(want)


@pytest.mark.parametrize("text,offset", INVALID)
def test_text_that_cannot_continue_json_stops_at_the_offending_character(text, offset):
    for pieces in ([text], list(text)):
        scanner, used = _scan(pieces)
        assert scanner.error is not None and f"offset {offset}" in scanner.error, scanner.error
        assert used == offset == len(scanner.text) and scanner.end is None
        assert scanner.feed("}") == 0


def test_a_prefix_shows_finished_members_and_the_start_of_the_open_one():
    scanner = ObjectScanner()
    assert scanner.feed('{"name": "get_weather", "arguments": {"city": "Pa') == 49
    name, args = scanner.members
    assert (name.key, scanner.text[name.value_start:name.value_end]) == ("name", '"get_weather"')
    assert args.key == "arguments" and args.value_end is None
    assert scanner.text[args.value_start:] == '{"city": "Pa' and scanner.end is None and scanner.error is None
    scanner.feed('ris"')
    assert args.value_end is None  # the arguments object is still open
    scanner.feed("}")
    assert scanner.text[args.value_start:args.value_end] == '{"city": "Paris"}' and scanner.end is None
    scanner.feed(" 12")  # a value must be followed by ',' or '}'
    assert scanner.error == "unexpected '1' at offset 55"


def test_a_number_ends_only_when_the_next_character_says_so():
    scanner = ObjectScanner()
    scanner.feed('{"n": 12')
    assert scanner.members[0].value_end is None
    scanner.feed("3")
    assert scanner.members[0].value_end is None
    scanner.feed("}")
    assert scanner.text[scanner.members[0].value_start:scanner.members[0].value_end] == "123"
    assert scanner.end == len('{"n": 123}')


def test_a_key_is_known_only_once_its_string_closes():
    scanner = ObjectScanner()
    scanner.feed('{"na')
    assert [m.key for m in scanner.members] == [None]
    scanner.feed('me"')
    assert [m.key for m in scanner.members] == ["name"] and scanner.members[0].value_start is None
