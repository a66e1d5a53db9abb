"""Single-sequence prefill + greedy decode straight on the model functions.

The smallest path from weights to tokens: one sequence, pages laid out in order. It exists to hold
models to transformers (logits of a whole prompt, greedy continuations) without the engine's
scheduler in between.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from jengine.config import ModelConfig
from jengine.kv_cache import allocate, specs
from jengine.models import ModelInput, get_model_family
from jengine.sharding import kv_cache_sharding, replicated
from jengine.step_input import build_step_input

PAGE_SIZE = 16


def _caches(cfg: ModelConfig, num_pages: int, mesh=None, kv_dtype=None) -> list:
    return allocate(cfg, num_pages, PAGE_SIZE, kv_dtype or cfg.dtype, None if mesh is None else kv_cache_sharding(mesh))


def _bucket(n: int) -> int:
    """Power-of-two padding (at least one page) so few shapes get compiled."""
    return max(PAGE_SIZE, 1 << (n - 1).bit_length())


def _pages(n: int) -> int:
    """The scratch cache's pages for n tokens (their padded length)."""
    return _bucket(n) // PAGE_SIZE


def _sequence_input(token_ids, start: int, num_pages: int) -> ModelInput:
    """The engine's input builder for one sequence at positions start.. owning pages 0..num_pages-1,
    padded to a power-of-two token count (padding tokens write nowhere)."""
    row = (list(token_ids), start, list(range(num_pages)), -1, None)
    return build_step_input([row], _bucket(len(token_ids)), 1, num_pages, PAGE_SIZE, sampling=None).model


@functools.partial(jax.jit, static_argnames=("cfg", "all_logits"), donate_argnames=("kv_caches",))
def _step(params, kv_caches, inp: ModelInput, cfg: ModelConfig, all_logits: bool):
    family = get_model_family(cfg.architecture)
    kv_caches, hidden = family.forward(params, cfg, inp, kv_caches)
    if not all_logits:  # only the last real token's logits
        hidden = jax.lax.dynamic_slice_in_dim(hidden, inp.cu_q_lens[1] - 1, 1)
    return kv_caches, family.compute_logits(params, cfg, hidden)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def _hidden(params, kv_caches, inp: ModelInput, cfg: ModelConfig, mesh=None):
    hidden = get_model_family(cfg.architecture).forward(params, cfg, inp, kv_caches, mesh=mesh)[1]  # [T, H]
    # replicated, so every process (multi-host) can read it whole
    return hidden if mesh is None else jax.lax.with_sharding_constraint(hidden, replicated(mesh))


def padded_lengths(max_len: int) -> list[int]:
    """Every token count `hidden_states` pads to for inputs of up to `max_len` tokens (for warm-up)."""
    return sorted({_bucket(n) for n in [1, max_len] + [1 << i for i in range(max_len.bit_length())] if n <= max_len})


def hidden_states(cfg: ModelConfig, params: dict, token_ids, mesh=None, programs: dict | None = None) -> np.ndarray:
    """Final-normed hidden states `[len, H]` (f32) of one sequence, with its own scratch cache.

    `mesh`: the tensor-parallel mesh the params are sharded over (then `cfg` is the model the devices
    hold, `sharding.sharded_model_config`). `programs`: compiled ones by padded length
    (`hidden_states_program`), used where they hold the length."""
    ids = _check_ids(cfg, token_ids)
    args = _hidden_args(cfg, params, ids, mesh)
    program = (programs or {}).get(_bucket(len(ids)))
    hidden = program(*args) if program is not None else _hidden(*args, cfg=cfg, mesh=mesh)
    return np.asarray(hidden, np.float32)[: len(ids)]


def hidden_states_program(cfg: ModelConfig, params: dict, length: int, mesh=None) -> tuple[tuple, Callable]:
    """The `hidden_states` program of one padded length, to compile ahead of time: its arguments (the
    scratch cache as shapes only), and a function that traces it over them."""
    num_pages = _pages(length)
    caches = specs(cfg, num_pages, PAGE_SIZE, cfg.dtype, None if mesh is None else kv_cache_sharding(mesh))
    args = (params, caches, _sequence_input([0] * length, 0, num_pages))
    return args, lambda: _hidden.trace(*args, cfg=cfg, mesh=mesh)


def _hidden_args(cfg: ModelConfig, params: dict, ids: list[int], mesh) -> tuple:
    num_pages = _pages(len(ids))
    return params, _caches(cfg, num_pages, mesh), _sequence_input(ids, 0, num_pages)


def _check_ids(cfg: ModelConfig, token_ids) -> list[int]:
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("token_ids must not be empty")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    return ids


def prompt_logits(cfg: ModelConfig, params: dict, token_ids, kv_dtype=None) -> np.ndarray:
    """f32 logits `[len, V]` of every position of one prompt (`kv_dtype`: the cache's, default the model's)."""
    ids = _check_ids(cfg, token_ids)
    num_pages = _pages(len(ids))
    _, logits = _step(params, _caches(cfg, num_pages, kv_dtype=kv_dtype), _sequence_input(ids, 0, num_pages),
                      cfg=cfg, all_logits=True)
    return np.asarray(logits)[: len(ids)]


def greedy_generate(cfg: ModelConfig, params: dict, token_ids, max_new_tokens: int,
                    stop_at_eos: bool = True, kv_dtype=None) -> list[int]:
    """Greedy continuation of one prompt: the new token ids (ending at an EOS id when it comes).
    `kv_dtype`: the cache's dtype (default the model's; an 8-bit float as `kv_cache_dtype="fp8"`)."""
    ids = _check_ids(cfg, token_ids)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    num_pages = _pages(len(ids) + max_new_tokens)
    caches = _caches(cfg, num_pages, kv_dtype=kv_dtype)
    caches, logits = _step(params, caches, _sequence_input(ids, 0, num_pages), cfg=cfg, all_logits=False)
    out = []
    while True:
        token = int(np.argmax(np.asarray(logits[-1])))
        out.append(token)
        if len(out) == max_new_tokens or (stop_at_eos and token in cfg.eos_token_ids):
            return out
        pos = len(ids) + len(out) - 1
        caches, logits = _step(params, caches, _sequence_input([token], pos, num_pages), cfg=cfg,
                               all_logits=False)
