"""EngineConfig's checks at construction: every bad value is a ValueError naming the field, and numpy
scalars (a notebook's `np.int64(256)`) count as the Python values they hold."""

import pathlib

import numpy as np
import pytest

from jengine.engine_config import EngineConfig


@pytest.mark.parametrize(("field", "value", "message"), [
    ("model", 5, "model must be a preset name or a checkpoint directory"),
    ("model", "", "model must be a preset name or a checkpoint directory"),
    ("max_num_seqs", True, "max_num_seqs must be a positive integer"),
    ("max_model_len", 1.5, "max_model_len must be a positive integer"),
    ("swap_space", float("nan"), "swap_space must be >= 0 GiB, got nan"),
    ("swap_space", -1, "swap_space must be >= 0 GiB"),
    ("gpu_memory_utilization", float("nan"), r"gpu_memory_utilization must be in \(0, 1\]"),
    ("seed", True, "seed must be an integer, got True"),
    ("enable_prefix_caching", "yes", "enable_prefix_caching must be True or False, got 'yes'"),
    ("enable_chunked_prefill", 1, "enable_chunked_prefill must be True or False, got 1"),
    ("prefill_first", "no", "prefill_first must be True or False, got 'no'"),
    ("token_buckets", [16, True], "token_buckets must be a non-empty list of positive integers"),
    ("token_buckets", "16", "token_buckets must be a non-empty list of positive integers"),
    ("seq_buckets", 8, "seq_buckets must be a non-empty list of positive integers"),
    ("seq_buckets", [], "seq_buckets must be a non-empty list of positive integers"),
])
def test_bad_values_raise_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"model": "jengine/llama-3.1-8b", field: value})


def test_numpy_scalars_and_paths_are_taken_as_plain_values(tmp_path):
    cfg = EngineConfig(model=pathlib.Path(tmp_path), max_num_seqs=np.int64(64), block_size=np.int32(16),
                       gpu_memory_utilization=np.float32(0.5), seed=np.uint8(3), enable_prefix_caching=np.False_,
                       token_buckets=np.array([64, 16, 64]))
    assert cfg.model == str(tmp_path)
    assert (cfg.max_num_seqs, cfg.block_size, cfg.gpu_memory_utilization, cfg.seed) == (64, 16, 0.5, 3)
    assert type(cfg.max_num_seqs) is int and type(cfg.gpu_memory_utilization) is float
    assert cfg.enable_prefix_caching is False and cfg.token_buckets == (16, 64)


def test_prefill_first_defaults_by_entry_point():
    """Unset, prefill_first is off for an engine built from a config (a server's AsyncLLM) and on for the
    offline LLM (test_engine.py checks that side); a value given stays."""
    from jengine.config import ModelConfig
    from jengine.presets import resolve_model

    cfg = ModelConfig.from_model_dir(resolve_model("jengine/tiny-llama")[0])
    assert EngineConfig(model="jengine/tiny-llama").prefill_first is None
    assert EngineConfig(model="jengine/tiny-llama").resolve(cfg, "cpu", 1).prefill_first is False
    for value in (True, False):
        given = EngineConfig(model="jengine/tiny-llama", prefill_first=value)
        assert given.resolve(cfg, "cpu", 1).prefill_first is value
