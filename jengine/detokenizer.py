"""Incremental detokenization and stop-string detection for one request (host side, no jax).

With a fast (Rust) tokenizer, a Hugging Face `PreTrainedTokenizerFast` or a raw `tokenizers.Tokenizer`,
text comes from the tokenizers library's `DecodeStream`, one Rust call per token, primed with the prompt's
last tokens (as vLLM's fast detokenizer does): with 256 sequences an H200 host's update phase took 1.2-1.4
ms a step against 2.33 ms with the window below (RESULTS.md, session 35), which can leave a batch-256
decode step waiting on the host. Any other tokenizer (or a stream that fails) uses a short sliding window, as
vLLM's `detokenize_incrementally` does, with only `tokenizer.decode(ids, skip_special_tokens=...)`.

Why a window with two offsets rather than decoding each new token alone: many tokenizers decode a
token differently in context (SentencePiece drops the leading space of the first token of a decode;
byte-level BPE can split one UTF-8 character over several tokens). We decode
`ids[prefix_offset:read_offset]` (already emitted) and `ids[prefix_offset:]` (with the new tokens) and
emit the difference; while the result ends in U+FFFD (an incomplete multi-byte character) we emit
nothing and wait for the next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a dependency; toy tokenizers work without it
    _RustTokenizer = DecodeStream = None

from jengine.sampling_params import SamplingParams

# Prompt tokens kept as decode context for the first output token (vLLM uses 5).
INITIAL_CONTEXT_TOKENS = 5
# An incomplete UTF-8 character has at most 3 bytes, so with room for a skipped special token at most
# 4 pending tokens can be waiting for one; past that a trailing U+FFFD is real (invalid bytes) and is
# emitted rather than held forever.
MAX_PENDING_TOKENS = 4
_REPLACEMENT = "\ufffd"


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends within the last `new_char_count` characters.

    Returns (stop_str, truncate_to), truncate_to = -1 meaning keep all text, or None. Only the tail
    that could contain a new match is searched, so a stop string split across tokens is found the step
    its last character arrives. If several stop strings match, the earliest in the text wins.
    """
    if not new_char_count or not stop:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        idx = output_text.find(stop_str, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop_str)
    if best is None:
        return None
    idx, stop_str = best
    if include_in_output:
        idx += len(stop_str)
        if idx >= len(output_text):
            return stop_str, -1
    return stop_str, idx


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, step by step, and detects stop strings.

    Use: `stop_str = detok.update(new_ids, stop_terminated)` after each step; then
    `detok.get_next_output_text(finished, delta)` for what to send to the caller. `output_text` holds
    the text so far (truncated at a stop string unless include_stop_str_in_output).
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams | None = None,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        params = params or SamplingParams()
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Hold back the chars that might be the start of a stop string still arriving (streaming).
        self.stop_buffer_length = (
            params.max_stop_str_len - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        context = list(prompt_ids)[-INITIAL_CONTEXT_TOKENS:]
        self._ids: list[int] = context  # decode window source: prompt tail + output tokens
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._last_output_text_offset = 0
        self._rust, self._stream = _stream_for(tokenizer, context, self.skip_special_tokens)
        self._pending = 0  # tokens the stream holds back (an incomplete character)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self) -> str:
        """Text added by the tokens past read_offset, or "" while a character is incomplete."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        pending = len(self._ids) - self._read_offset
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token; keep it in the window
        if new_text.endswith(_REPLACEMENT) and pending <= MAX_PENDING_TOKENS:
            return ""  # incomplete multi-byte character: wait for its remaining bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _stream_next(self, token: int) -> str:
        """The stream's text for one more token. Past MAX_PENDING_TOKENS held back (invalid bytes, not an
        incomplete character), or if the stream fails, the request goes on with the window from the last
        token whose text was emitted."""
        try:
            text = self._stream.step(self._rust, token)
        except Exception:  # noqa: BLE001 - e.g. a prefix the stream cannot decode: fall back, never fail a step
            text = None
            self._pending = MAX_PENDING_TOKENS
        if text is not None:
            self._pending = 0
            return text
        self._pending += 1
        if self._pending <= MAX_PENDING_TOKENS:
            return ""
        self._stream = None
        self._read_offset = len(self._ids) - self._pending
        self._prefix_offset = max(0, self._read_offset - INITIAL_CONTEXT_TOKENS)
        return self._decode_next()

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append this step's tokens; return the stop string that finished the request, if any.

        `stop_terminated`: the last token is EOS or a stop_token_id; as in vLLM its text is left out
        unless include_stop_str_in_output, and stop strings are then not checked.
        """
        new_token_ids = list(new_token_ids)
        self.output_token_ids.extend(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        added = 0
        for tok in new_token_ids:
            self._ids.append(tok)
            delta = self._stream_next(tok) if self._stream is not None else self._decode_next()
            self.output_text += delta
            added += len(delta)
        if stop_terminated or len(self.output_token_ids) <= self.min_tokens:
            return None
        found = check_stop_strings(self.output_text, added, self.stop, self.include_stop_str_in_output)
        if found is None:
            return None
        stop_str, truncate_to = found
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the caller: all of it, or (delta) only what is new since the last call.

        Until finished, the last `max stop length - 1` chars are held back, so a stop string that is
        still arriving is never streamed and then taken back.
        """
        hold = 0 if finished else self.stop_buffer_length
        length = max(0, len(self.output_text) - hold)
        if not delta:
            return self.output_text[:length]
        start = self._last_output_text_offset
        if start >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[start:length]


def _stream_for(tokenizer: Any, context: list[int], skip_special_tokens: bool):
    """(rust tokenizer, DecodeStream primed with `context`), or (None, None) for a tokenizer without one."""
    rust = tokenizer if _RustTokenizer is not None and isinstance(tokenizer, _RustTokenizer) else getattr(
        tokenizer, "_tokenizer", None)
    if DecodeStream is None or not isinstance(rust, _RustTokenizer):
        return None, None
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    text = ""
    try:
        for token in context:  # the prompt's tail, so the first output token decodes in context
            text = stream.step(rust, token)
    except Exception:  # noqa: BLE001 - a context the stream cannot take: the window handles this request
        return None, None
    if text is None:  # the prompt ends inside a character, whose bytes the stream would put in the output
        return None, None
    return rust, stream
