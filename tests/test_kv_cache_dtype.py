"""`kv_cache_dtype="fp8"`: K/V kept as 8-bit floats. The engine's greedy output equals the single-sequence
path's with the same cache dtype under every scheduling mode, and stays close to the full-precision cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import FIXTURE, HF_CASES, _assert_no_leak, _greedy_tokens, _make_llm

from jengine.cli import add_engine_args, engine_kwargs
from jengine.engine_config import EngineConfig
from jengine.generate import greedy_generate, prompt_logits
from jengine.loader import load_model

E4M3 = jnp.dtype(jnp.float8_e4m3fn)


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE, dtype="float32")


def _expected(model, prompts, kv_dtype=E4M3):
    cfg, params = model
    return [greedy_generate(cfg, params, p, 16, stop_at_eos=False, kv_dtype=kv_dtype) for p in prompts]


def test_batched_and_prefix_cached_greedy_equals_the_single_sequence_path(model):
    llm = _make_llm(kv_cache_dtype="fp8")
    assert all(c.dtype == E4M3 for c in llm.engine.runner.kv_caches)
    prompts = [p for p, _ in HF_CASES]
    assert _greedy_tokens(llm, prompts) == _expected(model, prompts)
    shared = [(5 * t + 1) % 256 for t in HF_CASES[3][0][:32]]  # two full pages
    prompts = [shared + [9 + i, 4 + i] for i in range(3)]
    before = llm.engine.stats["computed_prompt_tokens"]
    assert _greedy_tokens(llm, prompts) == _expected(model, prompts)
    assert llm.engine.stats["computed_prompt_tokens"] - before < sum(map(len, prompts))  # pages were shared
    _assert_no_leak(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_chunked_prefill_and_swap_preemption_keep_outputs(model, kv_cache_dtype):
    # Tiny step budget (prompts in chunks) and 6 usable pages (requests preempted, swapped out and back).
    llm = _make_llm(kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=7, preemption_mode="swap",
                    swap_space=0.01, max_num_batched_tokens=16, token_buckets=(8, 16))
    base = HF_CASES[3][0]
    prompts = [base[i : i + 32] for i in range(4)]
    kv_dtype = jnp.dtype(jnp.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else jnp.float8_e5m2)
    assert llm.engine.runner.host_pool.pages.dtype == kv_dtype
    assert _greedy_tokens(llm, prompts) == _expected(model, prompts, kv_dtype)
    assert llm.engine.stats["preemptions"] > 0
    _assert_no_leak(llm)


def test_8bit_cache_logits_stay_close_to_the_full_precision_ones(model):
    cfg, params = model
    prompt = HF_CASES[1][0]
    full = prompt_logits(cfg, params, prompt)
    for kv_dtype, tol in ((jnp.float8_e4m3fn, 0.1), (jnp.float8_e5m2, 0.2)):
        fp8 = prompt_logits(cfg, params, prompt, kv_dtype=kv_dtype)
        err = np.abs(fp8 - full).max() / np.abs(full).max()
        assert 0 < err < tol, (kv_dtype, err)  # quantised (not equal), and by about the format's precision


def test_kv_cache_dtype_is_validated_and_sized():
    for bad in ("int8", ["fp8"], None):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(model="m", kv_cache_dtype=bad)
    cfg = EngineConfig(model="m", kv_cache_dtype="fp8")
    assert cfg.cache_dtype(jnp.bfloat16) == E4M3
    assert EngineConfig(model="m").cache_dtype(jnp.bfloat16) == jnp.dtype(jnp.bfloat16)
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]))["kv_cache_dtype"] == "fp8_e5m2"
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        parser.parse_args(["--kv-cache-dtype", "int8"])
    from jengine.kv_cache import page_bytes

    model_cfg = load_model(FIXTURE, dtype="bfloat16", load_format="dummy")[0]
    assert page_bytes(model_cfg, 16, E4M3) * 2 == page_bytes(model_cfg, 16, jnp.bfloat16)  # twice the pages


def test_the_model_hands_attention_f16_queries_where_it_asks_for_them(monkeypatch):
    """Where `attention_q_dtype` says float16 (Hopper with an 8-bit cache), the layer has the RoPE op write Q in
    float16 and asks attention for a result in the model's dtype: on the CPU (reference ops, asked the same way)
    the logits match those of bf16 queries (bf16 values are f16 values, but for f16's subnormals), the attention's
    result rounded once to bf16."""
    import jax

    from jengine.kernels_pallas import ragged_paged_attention as rpa
    from jengine.models import llama

    cfg, params = load_model(FIXTURE, dtype="bfloat16")
    prompt = HF_CASES[1][0]
    jax.clear_caches()
    want = prompt_logits(cfg, params, prompt, kv_dtype=E4M3)
    seen = []

    def q_dtype(dtype, kv_cache, num_q_heads):
        seen.append((jnp.dtype(dtype), kv_cache.dtype))
        return jnp.float16

    def rope(*args, q_dtype=None, **kw):
        seen.append(q_dtype)
        return rpa.rope_and_write_kv(*args, q_dtype=q_dtype, **kw)

    monkeypatch.setattr(llama, "attention_q_dtype", q_dtype)
    monkeypatch.setattr(llama, "rope_and_write_kv", rope)
    jax.clear_caches()
    try:
        got = prompt_logits(cfg, params, prompt, kv_dtype=E4M3)
    finally:
        jax.clear_caches()  # no later test gets the stand-ins' trace from the cache
    assert seen == [(jnp.dtype(jnp.bfloat16), E4M3), jnp.float16]  # traced once: every layer shares `_layer`
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())  # (a result rounded twice: 1.5e-2)
