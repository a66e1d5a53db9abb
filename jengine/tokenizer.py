"""Tokenizers: a model directory's own (through transformers), or the built-in byte-level one.

The built-in tokenizer maps each UTF-8 byte to one id (0-255) and adds a few special tokens, so the
default preset runs on a fresh machine with nothing to download. transformers is imported only when a
tokenizer is built: where torch is installed, importing it takes seconds of start-up (H200 host,
benchmarks/startup.py), which a model without a tokenizer should not pay.
"""

from __future__ import annotations

import json
import os

from jengine.presets import resolve_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTE_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header|>", "<|end_header|>", "<|eot|>")
_BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header|>{{ m['role'] }}<|end_header|>"
    "{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header|>assistant<|end_header|>{% endif %}"
)


def load_tokenizer(model: str):
    """The tokenizer for a model directory or preset; None when the directory ships none."""
    model_dir, _ = resolve_model(model)
    with open(os.path.join(model_dir, "config.json")) as f:
        if json.load(f).get("jengine_tokenizer") == "bytes":
            return byte_tokenizer()
    if any(os.path.exists(os.path.join(model_dir, name)) for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return None


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_tokenizer():
    """Byte-level tokenizer (a transformers `PreTrainedTokenizerFast`): ids 0-255 are bytes, 256.. the
    special tokens in BYTE_SPECIALS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BYTE_SPECIALS[0],
        eos_token=BYTE_SPECIALS[1],
        additional_special_tokens=list(BYTE_SPECIALS[2:]),
    )
    fast.chat_template = _BYTE_CHAT_TEMPLATE
    return fast
