"""Embeddings from a generative model: the mean of one sequence's final hidden states, L2-normalised.

A pure function of (config, params, token ids): the model's forward over one sequence with its own
small scratch KV cache, padded to a power-of-two length so few shapes are compiled. It must run on the
engine thread (it uses the engine's params and the device).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jengine.config import ModelConfig
from jengine.generate import PAGE_SIZE, make_kv_caches
from jengine.models import ModelInput, get_model_family


def _padded_len(n: int) -> int:
    return max(PAGE_SIZE, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg",))
def _hidden_states(params, kv_caches, inp: ModelInput, cfg: ModelConfig):
    _, hidden = get_model_family(cfg.architecture).forward(params, cfg, inp, kv_caches)
    return hidden  # [T, H]


def mean_pooled_embedding(cfg: ModelConfig, params: dict, token_ids: list[int]) -> np.ndarray:
    """`[H]` float32: mean of the final-normed hidden states over the tokens, unit length."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("cannot embed an empty input")
    if any(not 0 <= t < cfg.vocab_size for t in token_ids):
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
    padded = _padded_len(n)
    num_pages = padded // PAGE_SIZE
    ids = np.zeros(padded, np.int32)
    ids[:n] = token_ids
    positions = np.zeros(padded, np.int32)
    positions[:n] = np.arange(n, dtype=np.int32)
    slots = np.full(padded, -1, np.int32)
    slots[:n] = positions[:n]
    inp = ModelInput(token_ids=ids, positions=positions, slot_mapping=slots,
                     cu_q_lens=np.array([0, n], np.int32), kv_lens=np.array([n], np.int32),
                     page_indices=np.arange(num_pages, dtype=np.int32)[None, :], num_seqs=np.array([1], np.int32))
    hidden = np.asarray(_hidden_states(params, make_kv_caches(cfg, num_pages), inp, cfg=cfg), np.float32)[:n]
    pooled = hidden.mean(axis=0)
    norm = float(np.linalg.norm(pooled))
    return pooled / norm if norm > 0 else pooled


def embed(engine, token_ids: list[int]) -> list[float]:
    """Embedding of one tokenized input with an `LLMEngine`'s model (call on the engine thread)."""
    if len(token_ids) > engine.config.max_model_len:
        raise ValueError(f"input of {len(token_ids)} tokens is longer than max_model_len={engine.config.max_model_len}")
    return mean_pooled_embedding(engine.model_config, engine.runner.params, token_ids).tolist()
