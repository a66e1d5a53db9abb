"""Embeddings: warm-up makes one program per padded length, and embedding then runs those, never jit."""

from __future__ import annotations

import numpy as np
import pytest

from jengine import generate
from jengine.engine import LLMEngine
from jengine.engine_config import EngineConfig
from jengine.entrypoints import pooling


def test_warmed_up_programs_serve_every_length_and_equal_the_jit_path(monkeypatch):
    engine = LLMEngine(EngineConfig(model="jengine/tiny-llama", max_model_len=64, max_num_seqs=4,
                                    max_num_batched_tokens=32, token_buckets=(32,), seq_buckets=(4,)), progress=False)
    inputs = [[1], [3, 1, 4, 1, 5], list(range(2, 40)), list(range(5, 69))]
    before = [pooling.embed(engine, ids) for ids in inputs]  # no programs yet: jax.jit
    assert pooling.warmup(engine) == len(generate.padded_lengths(64)) == len(engine.runner.embedding_programs)

    def no_jit(*args, **kwargs):
        raise AssertionError("embedding compiled a program after warm-up")

    monkeypatch.setattr(generate, "_hidden", no_jit)
    for ids, want in zip(inputs, before):
        got = pooling.embed(engine, ids)
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-5)
        assert got == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="longer than max_model_len"):
        pooling.embed(engine, list(range(65)))
