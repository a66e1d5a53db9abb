"""Pre-quantized fp8 checkpoints with static activation scales (`activation_scheme: "static"`, or compressed-tensors'
`input_activations` with `dynamic: false`): each linear layer's input is quantized at the checkpoint's per-tensor
`<module>.input_scale` (the largest of a fused layer's parts), as vLLM does, instead of at a scale per token."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from test_engine import HF_CASES
from test_fp8_checkpoint import COMPRESSED, ENGINE, _names, _read, _set_quantization_config, _write_checkpoint

from jengine import LLM, SamplingParams
from jengine.config import checkpoint_quantization
from jengine.loader import load_model
from jengine.quantization import fp8_linear, fp8_weight

STATIC_ACTS = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
STATIC = copy.deepcopy(COMPRESSED)
STATIC["config_groups"]["group_0"]["input_activations"] = STATIC_ACTS
PROMPTS = [list(p) for p, _ in HF_CASES]
SCORED = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    return _write_checkpoint(tmp_path_factory.mktemp("dyn") / "model", COMPRESSED)


def _static(dynamic: str, out, scales) -> str:
    """`dynamic`'s checkpoint with static activations: `scales(hf_weight_name)` as each layer's input scale."""
    shutil.copytree(dynamic, out)
    tensors = {name: _read(dynamic, name) for name in _names(dynamic)}
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        tensors[name.removesuffix(".weight") + ".input_scale"] = np.asarray(scales(name), np.float32).reshape(1)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    _set_quantization_config(out, STATIC)
    return str(out)


def _scored(model: str, **kw):
    """Greedy tokens and the prompts' logprobs (teacher-forced) of `model`."""
    outs = LLM(model, **ENGINE, **kw).generate(PROMPTS, SCORED, use_tqdm=False)
    logprobs = [lp[t].logprob for o in outs for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
    return [o.outputs[0].token_ids for o in outs], np.asarray(logprobs)


@pytest.mark.parametrize("config, static", [
    ({"quant_method": "fp8", "activation_scheme": "static"}, True),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, False),
    ({"quant_method": "fp8"}, False),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, True),
    (STATIC, True),
    (COMPRESSED, False),
])
def test_the_activation_scheme_is_read_from_the_quantization_config(config, static):
    assert checkpoint_quantization(config).static_inputs is static


def _groups(*acts):
    config = copy.deepcopy(COMPRESSED)
    group = config["config_groups"].pop("group_0")
    config["config_groups"] = {f"g{i}": {**group, "input_activations": a} for i, a in enumerate(acts)}
    return config


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "fp8", "activation_scheme": "per_token"}, "activation_scheme must be 'dynamic' or 'static'"),
    (_groups({**STATIC_ACTS, "strategy": "channel"}), "static input activations 8-bit float, strategy 'channel'"),
    (_groups({**STATIC_ACTS, "num_bits": 4, "type": "int"}), "static input activations 4-bit int"),
    (_groups(STATIC_ACTS, None), "mix static and dynamic input activations"),
    (_groups("tensor"), "input_activations must be an object or null"),
])
def test_activation_schemes_jengine_cannot_read_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization(config)


def test_a_static_product_quantizes_x_at_the_one_scale_and_saturates():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    x[0, 0] = 1e4  # past 448 x the scale: saturates, as vLLM's static quantization does
    q, scale = fp8_weight(jnp.asarray(rng.standard_normal((32, 16)), jnp.float32))
    s = np.float32(0.05)
    got = np.asarray(fp8_linear(jnp.asarray(x), q, scale, jnp.asarray(s)))
    xq = np.clip(x / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = (xq @ np.asarray(q.astype(jnp.float32)).T) * s * np.asarray(scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    dynamic = np.asarray(fp8_linear(jnp.asarray(x), q, scale))
    assert not np.allclose(got[0], dynamic[0], rtol=1e-2)  # the saturated row is not what a per-token scale gives


def test_each_layer_takes_the_largest_input_scale_of_its_parts(dynamic, tmp_path):
    # a different power of two per module: q 2^-3, k 2^-2, v 2^-4, o 2^-5, gate 2^-6, up 2^-3, down 2^-1
    exponent = {"q_proj": -3, "k_proj": -2, "v_proj": -4, "o_proj": -5, "gate_proj": -6, "up_proj": -3,
                "down_proj": -1}
    model = _static(dynamic, tmp_path / "s", lambda name: 2.0 ** exponent[name.split(".")[-2]])
    _, params = load_model(model, dtype="float32")
    assert float(params["layers.1.qkv_input_scale"]) == 2.0**-2
    assert float(params["layers.1.o_input_scale"]) == 2.0**-5
    assert float(params["layers.1.gate_up_input_scale"]) == 2.0**-3
    assert float(params["layers.1.down_input_scale"]) == 2.0**-1
    assert params["layers.1.qkv_input_scale"].shape == () and params["layers.1.qkv_input_scale"].dtype == jnp.float32
    _, plain = load_model(dynamic, dtype="float32")  # a dynamic checkpoint has none
    assert not any(name.endswith("_input_scale") for name in plain)
    _, dummy = load_model(model, load_format="dummy")  # random weights: placeholders of 1 (for benchmarks)
    scales = {name for name in params if name.endswith("_input_scale")}
    assert {name for name in dummy if name.endswith("_input_scale")} == scales
    assert float(dummy["layers.0.down_input_scale"]) == 1.0


def test_the_engine_quantizes_activations_at_the_checkpoints_scales(dynamic, tmp_path):
    """At a scale that fits the fixture's activations the model stays within fp8's own noise of the per-token one
    (each is ~10-20% RMS from full precision); at 2^10 the activations fall below e4m3's normal range and it
    degrades, so the scales are what quantizes them."""
    _, dynamic_lp = _scored(dynamic)
    tokens, fitting = _scored(_static(dynamic, tmp_path / "a", lambda _: 0.5))
    _, huge = _scored(_static(dynamic, tmp_path / "c", lambda _: 2.0**10))
    assert np.mean(np.abs(fitting - dynamic_lp)) < 0.3
    assert np.mean(np.abs(huge - fitting)) > 1.0
    assert all(len(t) == SCORED.max_tokens for t in tokens)


def test_missing_or_bad_input_scales_are_refused_by_name(dynamic, tmp_path):
    model = _static(dynamic, tmp_path / "s", lambda _: 0.5)
    tensors = {name: _read(model, name) for name in _names(model)}
    tensors.pop("model.layers.0.mlp.up_proj.input_scale")
    save_file(tensors, os.path.join(model, "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.up_proj.input_scale'"):
        load_model(model, dtype="float32")
    for bad in (np.zeros(1), np.full(1, np.nan), np.ones(2)):
        tensors["model.layers.0.mlp.up_proj.input_scale"] = bad.astype(np.float32)
        save_file(tensors, os.path.join(model, "model.safetensors"))
        with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.input_scale' must be one positive"):
            load_model(model, dtype="float32")


_TP_SCRIPT = """
import json, sys
from jengine import LLM, SamplingParams
kw = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 64),
          seq_buckets=(4,), use_tqdm_on_load=False, compilation_cache_dir=None, num_gpu_blocks_override=64)
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
out = {}
for tp in (1, 2):
    llm = LLM(sys.argv[1], tensor_parallel_size=tp, **kw)
    assert tp == 1 or llm.engine.runner.params["layers.0.o_input_scale"].sharding.is_fully_replicated
    out[tp] = [o.outputs[0].token_ids for o in llm.generate(json.loads(sys.argv[2]), greedy, use_tqdm=False)]
print(json.dumps(out))
"""


def test_static_scales_under_tensor_parallelism_give_one_devices_tokens(dynamic, tmp_path):
    model = _static(dynamic, tmp_path / "s", lambda _: 2.0**-3)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-P", "-c", _TP_SCRIPT, model, json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["1"] == out["2"]

