"""Incremental detokenization: multi-byte characters split over tokens, stop strings, special tokens."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jengine.detokenizer import IncrementalDetokenizer, check_stop_strings
from jengine.sampling_params import SamplingParams as P


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is a special <eos>. Invalid UTF-8 decodes to U+FFFD."""

    EOS = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        out, text = bytearray(), ""
        for i in ids:
            if i == self.EOS:
                text += out.decode("utf-8", errors="replace")
                out = bytearray()
                text += "" if skip_special_tokens else "<eos>"
            else:
                out.append(i)
        return text + out.decode("utf-8", errors="replace")


class LeadingSpaceTokenizer:
    """SentencePiece-like: '▁' marks a space, and a decode drops its own leading space."""

    vocab = ["▁hello", "▁world", "!", "▁again"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


@pytest.fixture(scope="module")
def bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(["hello world, the stop here. hello again"] * 10, trainer)
    return tok


def stream(detok, ids):
    deltas = []
    for i in ids:
        detok.update([i])
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    return deltas


TEXT = "hello é 😀 world, 中文 done"


def test_byte_level_bpe_stream_equals_full_decode_without_partial_characters(bpe):
    ids = bpe.encode(TEXT).ids
    assert len(ids) > len(TEXT.split())  # multi-byte characters really are split over tokens
    deltas = stream(IncrementalDetokenizer(bpe), ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_byte_tokenizer_emits_multibyte_character_only_when_complete():
    tok = ByteTokenizer()
    deltas = stream(IncrementalDetokenizer(tok), tok.encode("a😀b"))
    assert deltas == ["a", "", "", "", "😀", "b"]


def test_invalid_bytes_are_emitted_instead_of_stalling():
    tok = ByteTokenizer()
    deltas = stream(IncrementalDetokenizer(tok), [0xFF] * 6 + tok.encode("ok"))
    assert "".join(deltas).endswith("ok")


def test_prompt_context_keeps_the_leading_space_of_the_first_output_token():
    tok = LeadingSpaceTokenizer()
    detok = IncrementalDetokenizer(tok, prompt_ids=[0])
    assert stream(detok, [1, 2, 3]) == [" world", "!", " again"]
    assert stream(IncrementalDetokenizer(tok), [1, 2]) == ["world", "!"]


def test_stop_string_spanning_tokens_truncates_before_it():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, P(stop=["STOP"]))
    ids = tok.encode("abcSTOPxyz")
    results = [detok.update([i]) for i in ids[:7]]
    assert results == [None] * 6 + ["STOP"]
    assert detok.output_text == "abc"


def test_stop_string_kept_when_include_stop_str_in_output():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, P(stop=["ST", "é!"], include_stop_str_in_output=True))
    assert detok.update(tok.encode("xé")) is None
    assert detok.update(tok.encode("!tail")) == "é!"
    assert detok.output_text == "xé!"


def test_earliest_stop_string_wins_within_one_update():
    assert check_stop_strings("ab<end>cd\n", 10, ["\n", "<end>"], False) == ("<end>", 2)


def test_streaming_never_emits_a_partial_stop_string():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, P(stop=["STOP"]))
    sent = "".join(stream(detok, tok.encode("hi STO")))
    assert sent == "hi "  # "STO" is held back: it may become "STOP"
    detok.update(tok.encode("X"))
    assert detok.get_next_output_text(finished=True, delta=True) == "STOX"
    assert detok.get_next_output_text(finished=True, delta=False) == "hi STOX"


def test_stop_strings_are_ignored_before_min_tokens():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, P(stop=["a"], min_tokens=2))
    # as vLLM: the first min_tokens tokens are always kept; the next one may stop
    assert [detok.update(tok.encode("a")) for _ in range(3)] == [None, None, "a"]
    assert detok.output_text == "aa"


def test_special_tokens_skipped_or_shown(bpe):
    eos = bpe.token_to_id("<eos>")
    ids = bpe.encode("hello").ids + [eos] + bpe.encode(" world").ids
    assert "".join(stream(IncrementalDetokenizer(bpe), ids)) == "hello world"
    shown = IncrementalDetokenizer(bpe, P(skip_special_tokens=False))
    assert "".join(stream(shown, ids)) == "hello<eos> world"


def test_stop_token_text_is_left_out_unless_include_stop_str_in_output():
    tok = ByteTokenizer()
    params = dict(skip_special_tokens=False, stop_token_ids=[ByteTokenizer.EOS])
    detok = IncrementalDetokenizer(tok, P(**params))
    detok.update(tok.encode("ok") + [ByteTokenizer.EOS], stop_terminated=True)
    assert detok.output_text == "ok"
    assert detok.output_token_ids[-1] == ByteTokenizer.EOS
    kept = IncrementalDetokenizer(tok, P(include_stop_str_in_output=True, **params))
    kept.update(tok.encode("ok") + [ByteTokenizer.EOS], stop_terminated=True)
    assert kept.output_text == "ok<eos>"


class WindowOnly:
    """A Rust tokenizer behind a plain `decode`, so the detokenizer takes its window path."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip", [True, False])
def test_rust_stream_gives_the_window_paths_text(bpe, skip):
    import random

    rng = random.Random(0)
    eos, n = bpe.token_to_id("<eos>"), bpe.get_vocab_size()
    streamed = 0
    for trial in range(40):
        prompt = [rng.randrange(n) for _ in range(rng.randrange(0, 8))]
        ids = [eos if rng.random() < 0.05 else rng.randrange(n) for _ in range(30)]
        fast = IncrementalDetokenizer(bpe, P(skip_special_tokens=skip), prompt)
        slow = IncrementalDetokenizer(WindowOnly(bpe), P(skip_special_tokens=skip), prompt)
        assert slow._stream is None  # noqa: SLF001 - which path runs
        streamed += fast._stream is not None  # noqa: SLF001 - not for prompts that end inside a character
        for i in ids:
            fast.update([i])
            slow.update([i])
            assert fast.output_text == slow.output_text, (trial, prompt, ids)
    assert streamed >= 20


def test_rust_stream_keeps_the_leading_space_of_the_first_output_token():
    tok = Tokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "!": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    detok = IncrementalDetokenizer(tok, prompt_ids=[0])
    assert detok._stream is not None  # noqa: SLF001
    assert stream(detok, [1, 2]) == [" world", "!"]
    assert stream(IncrementalDetokenizer(tok), [1, 2]) == ["world", "!"]


def test_rust_stream_emits_invalid_bytes_instead_of_stalling(bpe):
    from jengine.tokenizer import _byte_to_unicode

    bad = bpe.token_to_id(_byte_to_unicode()[0xFF])
    detok = IncrementalDetokenizer(bpe)
    deltas = stream(detok, [bad] * 6 + bpe.encode("ok").ids)
    assert "".join(deltas).endswith("ok") and "\ufffd" in "".join(deltas)
