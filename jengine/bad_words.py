"""vLLM's `bad_words`: the token sequences a request's bad words stand for, and which tokens they ban at a
step. Host side, plain Python (no jax).

A request's words are tokenized once, when it is added (`bad_words_token_ids`); each step, the tokens
they ban given the request's outputs so far (`banned_tokens`) enter the sampler's bias table as -inf
entries, as min_tokens suppression does, so nothing runs on the device for them.

vLLM's semantics: each word is encoded without special tokens twice, left-stripped as given and with one
leading space (a word inside a sentence usually starts with a space token); the spaced form counts only
where it starts with another token and has as many tokens as the plain one. A one-token sequence is never
sampled; a longer one's last token is banned at a step whose most recent *output* tokens (never the
prompt's) are its other tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

# vLLM's limits (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS): they also bound the host's
# matching work per request and step.
MAX_BAD_WORD_SEQUENCES = 128
MAX_BAD_WORD_TOKENS = 1024


def bad_words_token_ids(words: Sequence[str], tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words` (validated `SamplingParams.bad_words`); ValueErrors name the field."""
    if not words:
        return ()
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer; this model has none (ban token ids with logit_bias -100 "
                         "instead)")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = _encode(tokenizer, word.lstrip())
        if not plain:
            raise ValueError(f"bad_words entry {word!r} encodes to no tokens")
        sequences.append(plain)
        spaced = _encode(tokenizer, " " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORD_SEQUENCES:
        raise ValueError(f"bad_words encode to {len(sequences)} token sequences; at most "
                         f"{MAX_BAD_WORD_SEQUENCES} are supported")
    total = sum(map(len, sequences))
    if total > MAX_BAD_WORD_TOKENS:
        raise ValueError(f"bad_words encode to {total} tokens; at most {MAX_BAD_WORD_TOKENS} are supported")
    outside = sorted({t for seq in sequences for t in seq if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(f"bad_words encode to token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")
    return tuple(sequences)


def _encode(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))


def last_tokens(sequences: Sequence[Sequence[int]]) -> frozenset[int]:
    """Every token the sequences can ban (their last tokens): what a request can need in the bias table."""
    return frozenset(seq[-1] for seq in sequences)


def needs_history(sequences: Sequence[Sequence[int]]) -> bool:
    """Whether matching needs the outputs so far (some sequence is longer than one token)."""
    return any(len(seq) > 1 for seq in sequences)


def banned_tokens(sequences: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens the sequences ban after `output_ids`: each one-token sequence's token, and the last token
    of each longer one whose other tokens are the last outputs."""
    n = len(output_ids)
    banned = []
    for seq in sequences:
        k = len(seq) - 1
        # the newest output first: most sequences fail on it, before any slice is made
        if k == 0 or (k <= n and output_ids[-1] == seq[-2] and tuple(output_ids[n - k:]) == tuple(seq[:k])):
            banned.append(seq[-1])
    return banned
