"""A checkpoint's scales for an 8-bit KV cache (`self_attn.k_scale` / `v_scale`, and the older spellings): with
`kv_cache_dtype="fp8"` the cache holds k / k_scale and v / v_scale, so K and V far smaller than e4m3's normal range
keep their precision; a 16- or 32-bit cache does not use them (as in vLLM).

The checks use a checkpoint made from the fixture by exact powers of two: K and V are 2^-10 of the fixture's (below
e4m3's smallest normal value, 2^-6, where the 8-bit cache flushes them), Q and O 2^10 of theirs, so the model is
the fixture's one bit for bit, and with scales of 2^-10 its 8-bit cache holds the very values the fixture's does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file
from test_engine import FIXTURE, HF_CASES

from jengine import LLM, SamplingParams
from jengine.loader import convert_to_orbax, load_model

SHIFT = np.float32(2.0**10)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 64),
              seq_buckets=(4,), use_tqdm_on_load=False, compilation_cache_dir=None, num_gpu_blocks_override=64)
PROMPTS = [list(p) for p, _ in HF_CASES]


def _shifted(out, scales: dict[str, np.ndarray], quantization_config=None) -> str:
    """The fixture with K and V 2^-10 of its own and Q and O 2^10 (the same model), plus `scales` tensors."""
    tensors = {}
    with safe_open(os.path.join(FIXTURE, "model.safetensors"), framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118
            w = f.get_tensor(name)
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                w = w / SHIFT
            elif name.endswith(("q_proj.weight", "o_proj.weight")):
                w = w * SHIFT
            tensors[name] = w
    os.makedirs(out, exist_ok=True)
    save_file({**tensors, **scales}, os.path.join(out, "model.safetensors"))
    shutil.copy(os.path.join(FIXTURE, "config.json"), out)
    if quantization_config is not None:
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**config, "quantization_config": quantization_config}, f)
    return str(out)


def _scales(layers=(0, 1), names=("k_scale", "v_scale")):
    return {f"model.layers.{i}.self_attn.{n}": np.array(1 / SHIFT, np.float32) for i in layers for n in names}


def _run(model, **kw):
    outs = LLM(model, **ENGINE, **kw).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


@pytest.fixture(scope="module")
def fixture_fp8():
    return _run(FIXTURE, kv_cache_dtype="fp8")


def test_the_scales_keep_small_keys_and_values_in_an_8_bit_cache(tmp_path, fixture_fp8):
    kv_only = {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                                         "strategy": "tensor", "dynamic": False}}
    scaled = _shifted(tmp_path / "s", _scales(), kv_only)
    _, params = load_model(scaled, dtype="float32")
    assert params["layers.1.kv_cache_scales"].tolist() == [2.0**-10, 2.0**-10]
    assert params["layers.0.qkv"].dtype == np.float32  # a KV-only scheme leaves the weights plain
    assert _run(scaled, kv_cache_dtype="fp8") == fixture_fp8  # bit for bit the fixture's 8-bit cache
    unscaled = _run(_shifted(tmp_path / "u", {}), kv_cache_dtype="fp8")
    assert [t for t, _ in unscaled] != [t for t, _ in fixture_fp8]  # without them the cache flushes K and V


def test_older_names_and_layers_without_scales(tmp_path):
    both = {f"model.layers.{i}.self_attn.kv_scale": np.array([0.5], np.float32) for i in (0, 1)}
    _, params = load_model(_shifted(tmp_path / "kv", both), dtype="float32")
    assert params["layers.0.kv_cache_scales"].tolist() == [0.5, 0.5]
    auto_fp8 = {"model.layers.1.self_attn.k_proj.output_scale": np.array(0.25, np.float32),
                "model.layers.1.self_attn.v_proj.output_scale": np.array(0.125, np.float32)}
    _, params = load_model(_shifted(tmp_path / "a", auto_fp8), dtype="float32")
    assert params["layers.1.kv_cache_scales"].tolist() == [0.25, 0.125]
    assert params["layers.0.kv_cache_scales"].tolist() == [1.0, 1.0]  # a layer without them: 1, as in vLLM
    _, params = load_model(_shifted(tmp_path / "none", {}), dtype="float32")
    assert not any("kv_cache_scales" in name for name in params)


def test_an_orbax_conversion_keeps_them(tmp_path):
    _, params = load_model(convert_to_orbax(_shifted(tmp_path / "s", _scales()), str(tmp_path / "o")),
                           dtype="bfloat16")
    assert params["layers.1.kv_cache_scales"].dtype == np.float32  # not cast with the weights
    assert params["layers.1.kv_cache_scales"].tolist() == [2.0**-10, 2.0**-10]
    assert params["layers.1.qkv"].dtype == jnp.bfloat16


@pytest.mark.parametrize("value", [np.array([1.0, 2.0], np.float32), np.array(-1.0, np.float32),
                                   np.array(np.nan, np.float32), np.array(0.0, np.float32)])
def test_a_scale_must_be_one_positive_number(tmp_path, value):
    model = _shifted(tmp_path / "bad", {**_scales(), "model.layers.1.self_attn.v_scale": value})
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.v_scale' must be one positive number"):
        load_model(model, dtype="float32")


_TP_SCRIPT = """
import json, sys
from jengine import LLM, SamplingParams
kw = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 64),
          seq_buckets=(4,), use_tqdm_on_load=False, compilation_cache_dir=None, kv_cache_dtype="fp8")
greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
print(json.dumps({tp: [o.outputs[0].token_ids for o in LLM(sys.argv[1], tensor_parallel_size=tp, **kw).generate(
    json.loads(sys.argv[2]), greedy, use_tqdm=False)] for tp in (1, 2)}))
"""


def test_under_tensor_parallelism_every_device_holds_the_scales(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-P", "-c", _TP_SCRIPT, _shifted(tmp_path / "s", _scales()),
                           json.dumps(PROMPTS)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["2"] == report["1"]
