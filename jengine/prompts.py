"""A request's prompt as token ids: text through the tokenizer, token ids checked against the vocabulary,
prompt dicts unwrapped, and `truncate_prompt_tokens` applied. Host side, plain Python (no jax)."""

from __future__ import annotations

import numbers

import numpy as np


def token_ids(prompt, vocab: int) -> list[int]:
    """A prompt's token ids (a list, tuple or 1-D array) as a list of ints in [0, vocab); a ValueError
    for anything else: floats (1.5 would pass int()), bools, nested lists. Lists of plain ints, the usual
    case, are checked at C speed (a per-token isinstance against numbers.Integral took 80 ms for 256
    prompts of 512 tokens, all before the first step)."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got a {prompt.ndim}-D array")
        prompt = prompt.tolist()  # Python ints (or floats, bools, objects: checked below)
    if set(map(type, prompt)) <= {int}:  # (a bool's type is bool, not int)
        ids = list(prompt)
    elif any(isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral) for t in prompt):
        ids = None
    else:  # numpy integers and other integral types
        ids = [int(t) for t in prompt]
    if ids is None or (ids and (min(ids) < 0 or max(ids) >= vocab)):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    return ids


def tokenize_prompt(prompt, tokenizer, vocab: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text, a list of token ids, or {"prompt": ...} /
    {"prompt_token_ids": ...} (with "prompt" beside it: ids already made from that text, which is kept);
    text needs `tokenizer`."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            return (text if isinstance(text, str) else None), token_ids(prompt["prompt_token_ids"], vocab)
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompt token ids instead of text")
        return prompt, list(tokenizer.encode(prompt))
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return None, token_ids(prompt, vocab)
    raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (SamplingParams.truncate_prompt_tokens; -1: max_model_len)."""
    if keep is None:
        return ids
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} is more than max_model_len={max_model_len}")
    return ids[-(max_model_len if keep == -1 else keep):]
