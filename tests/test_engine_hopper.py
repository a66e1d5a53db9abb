"""On a Hopper GPU the engine's decode attention runs the Mosaic GPU kernel (bf16, head_dim 128).

The tiny f32 models of test_engine.py take the Triton kernel, so this file serves a bf16 model with
8B-like heads through the engine under batching, chunked prefill (mixed buckets), prefix caching and
preemption, and holds every greedy token to an f32 forward pass of the same weights over the same
tokens: the token must be the f32 argmax, or within bf16 noise of it. Skipped elsewhere; on CPU the
kernel is lowered for CUDA in test_attention_mosaic.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine import LLM, SamplingParams
from jengine.generate import prompt_logits
from jengine.kernels_pallas.ragged_paged_attention import gpu_mosaic
from jengine.loader import load_model

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu" or not gpu_mosaic.on_hopper(),
                                reason="needs a Hopper GPU")

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384, "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 128, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 256, "eos_token_id": 257,
    "jengine_tokenizer": "bytes",
}
TOLERANCE = 0.15  # f32 logit units: a greedy token may lose to the f32 argmax by bf16 noise only
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hopper_llama")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    cfg, params = load_model(model_dir, load_format="dummy")
    cfg32 = cfg.replace(dtype="float32")
    params32 = {k: v.astype(jnp.float32) for k, v in params.items()}
    return lambda ids: prompt_logits(cfg32, params32, ids)


def _prompts(n, length, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length + 7 * i).tolist() for i in range(n)]


def _assert_greedy_within_noise(llm, reference, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == GREEDY.max_tokens
        logits = reference(prompt + tokens[:-1])[len(prompt) - 1:]
        picked = logits[np.arange(len(tokens)), tokens]
        worst = max(worst, float((logits.max(axis=1) - picked).max()))
    assert worst <= TOLERANCE, worst
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.mark.parametrize("mode", ["batched", "chunked_prefill", "prefix_caching", "preemption"])
def test_greedy_tokens_match_an_f32_forward_pass(model_dir, reference, mode):
    kw = dict(dtype="bfloat16", load_format="dummy", max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=256, token_buckets=(16, 256), seq_buckets=(8,), use_tqdm_on_load=False)
    prompts = _prompts(6, 40, seed=1)
    if mode == "chunked_prefill":  # 32-token steps: prompts are cut into chunks beside running decodes
        kw.update(max_num_batched_tokens=32, token_buckets=(16, 32), prefill_first=False)
        prompts = _prompts(4, 90, seed=2)
    elif mode == "prefix_caching":
        shared = _prompts(1, 64, seed=3)[0]
        prompts = [shared + p[:5] for p in _prompts(5, 1, seed=4)]
    elif mode == "preemption":  # 9 usable 16-token pages: the batch cannot all decode at once
        kw.update(num_gpu_blocks_override=10, block_size=16)
        prompts = _prompts(4, 40, seed=5)
    llm = LLM(model_dir, **kw)
    if mode == "prefix_caching":
        _assert_greedy_within_noise(llm, reference, prompts[:1])
    _assert_greedy_within_noise(llm, reference, prompts)
    if mode == "preemption":
        assert llm.engine.stats["preemptions"] > 0


@pytest.mark.parametrize("mode", ["batched", "chunked_prefill"])
def test_8bit_cache_greedy_tokens_match_the_single_sequence_path(model_dir, mode):
    """kv_cache_dtype="fp8": the Mosaic kernel reads e4m3 pages. The reference is the single-sequence
    path of the same bf16 weights with an e4m3 cache (the same K/V rounding), so only the kernels'
    summation order and bucket shapes differ."""
    cfg, params = load_model(model_dir, load_format="dummy")
    kw = dict(dtype="bfloat16", load_format="dummy", max_model_len=512, max_num_seqs=8, kv_cache_dtype="fp8",
              max_num_batched_tokens=256, token_buckets=(16, 256), seq_buckets=(8,), use_tqdm_on_load=False)
    prompts = _prompts(6, 40, seed=6)
    if mode == "chunked_prefill":  # chunks beside running decodes, as above
        kw.update(max_num_batched_tokens=32, token_buckets=(16, 32), prefill_first=False)
        prompts = _prompts(4, 90, seed=7)
    llm = LLM(model_dir, **kw)
    assert llm.engine.runner.kv_caches[0].dtype == jnp.float8_e4m3fn
    _assert_greedy_within_noise(llm, lambda ids: prompt_logits(cfg, params, ids, kv_dtype=jnp.float8_e4m3fn),
                                prompts)
