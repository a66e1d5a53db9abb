"""bad_words (vLLM's semantics): the token sequences a request's words stand for, and the tokens they ban."""

import pytest

from jengine.bad_words import (
    MAX_BAD_WORD_SEQUENCES,
    bad_words_token_ids,
    banned_tokens,
    last_tokens,
    needs_history,
)
from jengine.tokenizer import byte_tokenizer


class TableTokenizer:
    """Encodes the texts of a fixed table, as a BPE tokenizer would (a leading space starts another token)."""

    def __init__(self, table: dict[str, list[int]]):
        self.table = table

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return list(self.table[text])


TABLE = TableTokenizer({
    "hello": [10], " hello": [11],  # the spaced form is another token: both banned
    "New York": [20, 21], " New York": [22, 21],  # same length, another first token: both
    "abc": [1, 2, 3], " abc": [4, 1, 2, 3],  # the spaced form is longer: plain only
    "x": [5], " x": [5],  # the same first token: plain only
    "lead": [30], " lead": [31],  # "  lead" is left-stripped first
    "sp": [40], " sp": [],  # a spaced form of no tokens is skipped
    "zz": [], " zz": [50],
})


def test_each_word_stands_for_its_plain_and_spaced_encodings_as_vllm_keeps_them():
    words = ["hello", "New York", "abc", "x", "  lead", "sp"]
    assert bad_words_token_ids(words, TABLE, 100) == (
        (10,), (11,), (20, 21), (22, 21), (1, 2, 3), (5,), (30,), (31,), (40,))
    assert bad_words_token_ids([], None, 100) == ()
    # the limit counts sequences: 65 words whose spaced forms repeat their first token are 65
    same = TableTokenizer({p + f"w{i}": [i] for i in range(65) for p in ("", " ")})
    assert len(bad_words_token_ids([f"w{i}" for i in range(65)], same, 100)) == 65


def test_the_byte_tokenizer_keeps_the_plain_form_only():
    assert bad_words_token_ids(["hi", " ok"], byte_tokenizer(), 256) == ((104, 105), (111, 107))


@pytest.mark.parametrize(("words", "tokenizer", "vocab", "message"), [
    (["hello"], None, 100, "bad_words need a tokenizer"),
    (["zz"], TABLE, 100, "bad_words entry 'zz' encodes to no tokens"),
    (["New York"], TABLE, 21, r"bad_words encode to token ids outside the vocabulary \[0, 21\): \[21, 22\]"),
    ([f"w{i}" for i in range(65)], TableTokenizer({p + f"w{i}": [2 * i + (p == " ")] for i in range(65)
                                                   for p in ("", " ")}), 200,
     f"bad_words encode to 130 token sequences; at most {MAX_BAD_WORD_SEQUENCES}"),
    (["long", "longer"], TableTokenizer({"long": [1] * 600, " long": [], "longer": [2] * 600, " longer": []}), 100,
     "bad_words encode to 1200 tokens; at most 1024"),
])
def test_words_that_cannot_be_banned_are_value_errors_naming_the_field(words, tokenizer, vocab, message):
    with pytest.raises(ValueError, match=message):
        bad_words_token_ids(words, tokenizer, vocab)


SEQUENCES = ((7,), (1, 2), (3, 1, 2), (4, 5, 6))


@pytest.mark.parametrize(("outputs", "banned"), [
    ([], {7}),  # a one-token word from the first step on; longer ones need their other tokens in the output
    ([1], {7, 2}),
    ([9, 3, 1], {7, 2}),  # (1, 2) and (3, 1, 2) both ban 2
    ([1, 9], {7}),  # only the most recent outputs count
    ([4, 5], {7, 6}),
    ([5], {7}),  # a partial prefix bans nothing
    ([4, 6], {7}),
])
def test_a_words_last_token_is_banned_only_after_its_other_tokens(outputs, banned):
    assert set(banned_tokens(SEQUENCES, outputs)) == banned


def test_what_the_engine_reads_from_the_sequences():
    assert last_tokens(SEQUENCES) == {7, 2, 6}
    assert needs_history(SEQUENCES) and not needs_history(((7,), (8,))) and not needs_history(())
