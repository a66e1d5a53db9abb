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
from jengine.sampling_params import check_bool

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTE_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header|>", "<|end_header|>", "<|eot|>")
_BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header|>{{ m['role'] }}<|end_header|>"
    "{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header|>assistant<|end_header|>{% endif %}"
)
# What jengine passes to `apply_chat_template` itself, and its arguments that would change what it returns
# (a string); `messages` is the conversation's name inside the template.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
    "max_length", "sanitize_control_tokens"})


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


def render_chat(tokenizer, conversation: list[dict], *, add_generation_prompt: bool,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict | None = None, add_special_tokens: bool = False,
                documents: list[dict] | None = None, tools: list[dict] | None = None) -> list[int]:
    """The prompt token ids of one conversation rendered with `chat_template` (else the tokenizer's own),
    `chat_template_kwargs` as extra template variables, and `documents` (RAG) and `tools` (the functions the
    model may call, OpenAI's tool dicts) for templates that read them.
    The template writes every special token it wants, so by default none are added in encoding
    (`add_special_tokens`, vLLM's, adds the tokenizer's on top). Options a caller can get wrong are
    ValueErrors naming them."""
    check_bool("add_generation_prompt", add_generation_prompt)
    check_bool("continue_final_message", continue_final_message)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true (add_generation_prompt "
                         "defaults to true: set it to false to continue the final message)")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError("chat_template must be a Jinja template string or None, got "
                         f"{type(chat_template).__name__}")
    check_bool("add_special_tokens", add_special_tokens)
    kwargs = {} if chat_template_kwargs is None else chat_template_kwargs
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict or None, got {type(kwargs).__name__}")
    bad_keys = [k for k in kwargs if not isinstance(k, str)]
    if bad_keys:
        raise ValueError(f"chat_template_kwargs keys must be strings, got {bad_keys[0]!r}")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: jengine sets those "
                         "arguments of the rendering itself")
    given = {name: value for name, value in (("documents", documents), ("tools", tools)) if value is not None}
    both = sorted(set(given).intersection(kwargs))
    if both:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, both))}: the request gives "
                         f"{'it' if len(both) == 1 else 'them'} already")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat_template must be given: this model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             chat_template=chat_template, **given, **kwargs)
    except Exception as e:  # a template that rejects the conversation (roles, order) or fails to compile
        raise ValueError(f"the chat template rejected the messages: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
