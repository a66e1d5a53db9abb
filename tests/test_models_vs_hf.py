"""jengine's models held to Hugging Face transformers on tiny random-weight checkpoints.

The checkpoints and the reference outputs of transformers (f32, eager attention) live in
tests/fixtures/models/<name>/ and are made by tests/fixtures/make_fixtures.py; see its README.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest

from jengine import generate, loader

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models")
MODEL_NAMES = ["llama", "llama3_tied", "llama_linear_sharded", "mistral", "qwen2", "qwen3"]
NUM_PROMPTS = 4
MAX_NEW_TOKENS = 16
# Max |jengine - transformers| relative to max |transformers logit|. Two independent f32
# implementations agree to ~1e-6 here; a wrong RoPE frequency or a missing bias costs ~1e-1.
REL_TOL = 1e-5


def model_dir(name: str) -> str:
    return os.path.join(FIXTURES_DIR, name)


@functools.cache
def load(name: str):
    return loader.load_model(model_dir(name), dtype="float32")


@functools.cache
def expected(name: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(model_dir(name), "expected.npz")) as data:
        return dict(data)


def assert_logits_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape}, transformers {want.shape}"
    scale = float(np.max(np.abs(want)))
    rel_err = float(np.max(np.abs(got.astype(np.float64) - want))) / scale
    assert rel_err < REL_TOL, f"{what}: max |logit error| / max |logit| = {rel_err:.3g} (tolerance {REL_TOL})"
    # Rows whose top two logits are closer than the tolerance may legitimately swap.
    top2 = np.sort(want, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * REL_TOL * scale
    got_top, want_top = np.argmax(got, axis=-1), np.argmax(want, axis=-1)
    bad = np.nonzero(decided & (got_top != want_top))[0]
    assert bad.size == 0, (
        f"{what}: argmax differs at positions {bad.tolist()}: {got_top[bad]} (transformers {want_top[bad]})"
    )


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_prompt_logits_match_transformers(name):
    cfg, params = load(name)
    ref = expected(name)
    for i in range(NUM_PROMPTS):
        prompt = ref[f"prompt_{i}"].tolist()
        got = np.asarray(generate.prompt_logits(cfg, params, prompt))
        assert_logits_close(got, ref[f"logits_{i}"], f"{name} prompt {i} (len {len(prompt)})")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_greedy_generation_matches_transformers_token_for_token(name):
    cfg, params = load(name)
    ref = expected(name)
    for i in range(NUM_PROMPTS):
        prompt = ref[f"prompt_{i}"].tolist()
        got = [int(t) for t in generate.greedy_generate(cfg, params, prompt, max_new_tokens=MAX_NEW_TOKENS)]
        want = ref[f"greedy_{i}"].tolist()
        assert got == want, f"{name} prompt {i} (len {len(prompt)}): jengine {got} != transformers {want}"


def test_fixtures_cover_both_config_spellings_and_sharding():
    def config(name):
        with open(os.path.join(model_dir(name), "config.json")) as f:
            return json.load(f)

    old, new = config("llama"), config("qwen3")
    assert "torch_dtype" in old and "rope_theta" in old and "rope_parameters" not in old
    assert "dtype" in new and "rope_parameters" in new and "rope_theta" not in new
    assert config("llama3_tied")["rope_parameters"]["rope_type"] == "llama3"
    assert config("llama_linear_sharded")["rope_parameters"]["rope_type"] == "linear"
    files = os.listdir(model_dir("llama_linear_sharded"))
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_logits_match_live_transformers_on_fresh_prompt(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir(name), attn_implementation="eager", dtype=torch.float32
    ).eval()
    cfg, params = load(name)
    # A prompt not in expected.npz, longer than any stored one.
    prompt = np.random.default_rng(7).integers(3, hf_model.config.vocab_size, size=41).tolist()
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor([prompt])).logits[0].float().numpy()
    got = np.asarray(generate.prompt_logits(cfg, params, prompt))
    assert_logits_close(got, want, f"{name} live prompt (len {len(prompt)})")
