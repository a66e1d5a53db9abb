"""Embeddings from a generative model: the mean of one sequence's final hidden states, L2-normalised.

Runs the single-sequence path of `jengine.generate` on the engine thread (it uses the engine's params
and the device). `warmup` compiles every padded length up front, so serving embeddings never compiles,
through the engine's executable cache: a warm start loads them, untraced (traced and lowered, with JAX's
cache serving the compiles, they took 1.3-2.0 s each on an H200: RESULTS.md, session 29).
Engines made of other engines provide `embed(token_ids)` themselves: data-parallel replicas embed on
replica 0, a multi-host leader first tells its followers to run the same program.
"""

from __future__ import annotations

import numpy as np

from jengine.generate import hidden_states, hidden_states_program, padded_lengths


def embed(engine, token_ids: list[int]) -> list[float]:
    """Unit-length mean-pooled embedding `[H]` of one tokenized input with an `LLMEngine`'s model."""
    if hasattr(engine, "embed"):
        return engine.embed(token_ids)
    if not token_ids:
        raise ValueError("cannot embed an empty input")
    if len(token_ids) > engine.config.max_model_len:
        raise ValueError(f"input of {len(token_ids)} tokens is longer than max_model_len={engine.config.max_model_len}")
    runner = engine.runner
    pooled = hidden_states(runner.cfg, runner.params, token_ids, runner.mesh, runner.embedding_programs).mean(axis=0)
    norm = float(np.linalg.norm(pooled))
    return (pooled / norm if norm > 0 else pooled).tolist()


def warmup(engine) -> int:
    """Compile (or load) the embedding program for every padded input length, kept on the engine's
    runner; returns how many."""
    runner = engine.runner
    runner.embedding_programs = engine.builder.compile_programs({
        n: ("hidden_states", *hidden_states_program(runner.cfg, runner.params, n, runner.mesh))
        for n in padded_lengths(engine.config.max_model_len)})
    return len(runner.embedding_programs)
