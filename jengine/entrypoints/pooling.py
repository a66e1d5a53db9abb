"""Embeddings from a generative model: the mean of one sequence's final hidden states, L2-normalised.

Runs the single-sequence path of `jengine.generate` on the engine thread (it uses the engine's params
and the device). `warmup` compiles every padded length up front, so serving embeddings never compiles.
"""

from __future__ import annotations

import numpy as np

from jengine.generate import hidden_states, padded_lengths


def embed(engine, token_ids: list[int]) -> list[float]:
    """Unit-length mean-pooled embedding `[H]` of one tokenized input with an `LLMEngine`'s model."""
    if not token_ids:
        raise ValueError("cannot embed an empty input")
    if len(token_ids) > engine.config.max_model_len:
        raise ValueError(f"input of {len(token_ids)} tokens is longer than max_model_len={engine.config.max_model_len}")
    pooled = hidden_states(engine.model_config, engine.runner.params, token_ids).mean(axis=0)
    norm = float(np.linalg.norm(pooled))
    return (pooled / norm if norm > 0 else pooled).tolist()


def warmup(engine) -> int:
    """Compile the embedding program for every padded input length; returns how many."""
    lengths = padded_lengths(engine.config.max_model_len)
    for n in lengths:
        hidden_states(engine.model_config, engine.runner.params, [0] * n)
    return len(lengths)
