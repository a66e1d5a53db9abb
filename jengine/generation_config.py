"""A model's Hugging Face `generation_config.json`: its extra EOS ids and its default sampling parameters.

As vLLM's `--generation-config`: "auto" reads the file from the model directory when there is one,
"vllm" ignores it, and any other value is a directory holding the file; as its
`--override-generation-config`, `EngineConfig.override_generation_config` sets sampling keys over the
file's (in any mode; a null unsets one). From it jengine takes
`eos_token_id` (stop tokens on top of config.json's: Llama-3 Instruct's end-of-turn token is only
there) and, as the defaults of fields a request leaves unset, vLLM's choice of sampling fields
(`max_new_tokens` becomes `max_tokens`). Every other key (`do_sample`, `bos_token_id`,
`transformers_version`, ...) is ignored, as vLLM does.

Host side, plain Python (no jax).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jengine.config import ModelConfig
from jengine.presets import resolve_model
from jengine.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
MODES = ("auto", "vllm")  # anything else names a directory
# The file's sampling keys vLLM uses as defaults, each with the SamplingParams field it sets.
SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                   "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
# transformers' own defaults of those keys: vLLM reads the file through `GenerationConfig.to_diff_dict()`,
# which drops a value equal to its default, so e.g. a written `"top_k": 50` sets no top-k there, nor here.
TRANSFORMERS_DEFAULTS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What jengine takes from a generation_config.json (nothing, without one)."""

    path: str | None = None  # the file read
    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # SamplingParams field -> value

    def with_eos_of(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with this file's EOS ids after its own (an order-preserving union)."""
        bad = [t for t in self.eos_token_ids if t >= cfg.vocab_size]
        if bad:
            raise ValueError(f"{self.path}: eos_token_id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        return cfg.replace(eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + self.eos_token_ids)))

    def with_overrides(self, override: dict) -> GenerationConfig:
        """This config with `override`'s sampling keys (the file's names, e.g. `max_new_tokens`) set over
        its own: a value as given (even transformers' default), a null unsetting the key."""
        unknown = sorted(str(k) for k in override if k not in SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"override_generation_config: unknown key(s) {unknown}; it takes "
                             f"{', '.join(SAMPLING_FIELDS)}")
        defaults = dict(self.sampling_defaults)
        for key, value in override.items():
            if value is None:
                defaults.pop(SAMPLING_FIELDS[key], None)
            else:
                defaults[SAMPLING_FIELDS[key]] = _checked("override_generation_config", key, value)
        return dataclasses.replace(self, sampling_defaults=defaults)


def load_generation_config(setting: str, model: str, override: dict | None = None) -> GenerationConfig:
    """The generation config that `setting` ("auto", "vllm" or a directory) selects for `model` (a model
    directory or a preset; presets have none), with `override` (`GenerationConfig.with_overrides`) set
    over it."""
    config = _selected(setting, model)
    return config.with_overrides(override) if override else config


def _selected(setting: str, model: str) -> GenerationConfig:
    if setting == "vllm":
        return GenerationConfig()
    if setting == "auto":
        path = os.path.join(resolve_model(model)[0], FILE_NAME)
        return read_generation_config(path) if os.path.isfile(path) else GenerationConfig()
    if not os.path.isdir(setting):
        raise ValueError(f"generation_config={setting!r} must be 'auto', 'vllm' or a directory holding {FILE_NAME}; "
                         "there is no such directory")
    path = os.path.join(setting, FILE_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"generation_config={setting!r}: that directory holds no {FILE_NAME}")
    return read_generation_config(path)


def read_generation_config(path: str) -> GenerationConfig:
    """Parse and check one generation_config.json; a ValueError names the file and the field."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except ValueError as e:  # bad JSON, or bytes that are not UTF-8
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    eos = raw.get("eos_token_id")
    ids = [eos] if not isinstance(eos, list) and eos is not None else (eos or [])
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id (an int >= 0) or a list of them, got {eos!r}")
    defaults = {}
    for key, field in SAMPLING_FIELDS.items():
        if raw.get(key) is None or (key in TRANSFORMERS_DEFAULTS and raw[key] == TRANSFORMERS_DEFAULTS[key]
                                    and not isinstance(raw[key], bool)):
            continue  # absent, null, or transformers' default: not set, as in vLLM
        defaults[field] = _checked(path, key, raw[key])
    return GenerationConfig(path=path, eos_token_ids=tuple(dict.fromkeys(ids)), sampling_defaults=defaults)


def _checked(source: str, key: str, value):
    """`value` of the generation-config key `key`, checked by SamplingParams (one field at a time)."""
    try:
        SamplingParams(**{SAMPLING_FIELDS[key]: value})
    except ValueError as e:
        raise ValueError(f"{source}: {key} is invalid: {e}") from None
    return value
