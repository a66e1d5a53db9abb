"""Pre-quantized fp8 checkpoints (config.json's `quantization_config`): 8-bit e4m3 linear weights with per-channel
or per-tensor scales load as they are, into the params `quantization="fp8"` makes (values `[out, in]`, f32 scales
per output column), fused and split over a mesh the same way. Schemes jengine cannot read are refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file
from test_engine import FIXTURE, HF_CASES
from test_quantization import _quantized, assert_split_as_one_device

from jengine import LLM, SamplingParams, quantization
from jengine.loader import convert_to_orbax, load_model

E4M3 = ml_dtypes.float8_e4m3fn
COMPRESSED = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"],
                                            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                        "symmetric": True, "dynamic": False},
                                            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                  "dynamic": True}}}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# (a fixed page count: on a GPU the engines alive at once would otherwise each size their cache to the free memory)
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 64),
              seq_buckets=(4,), use_tqdm_on_load=False, compilation_cache_dir=None, num_gpu_blocks_override=64)


def _write_checkpoint(out, quantization_config, per_tensor=False, keep=(), scale_shape=None):
    """The test fixture's f32 checkpoint with its linear layers (but those named in `keep`) as e4m3 values and
    scales, as an FP8 checkpoint tool writes them: per channel `[out, 1]`, here rounded as `quantization.fp8_weight`
    rounds (or one per tensor)."""
    tensors = {}
    with safe_open(os.path.join(FIXTURE, "model.safetensors"), framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118
            w = f.get_tensor(name)
            if not name.endswith("_proj.weight") or any(k in name for k in keep):
                tensors[name] = w
                continue
            if per_tensor:
                scale = np.float32(np.max(np.abs(w)) / np.float32(448))
                tensors[name] = np.clip(w / scale, -448, 448).astype(E4M3)
            else:  # as the engine quantizes (its rounding of the scales too), for tokens to compare exactly
                q, scale = quantization.fp8_weight(jnp.asarray(w.T))
                tensors[name], scale = np.asarray(q), np.asarray(scale)[:, None]
            tensors[name + "_scale"] = np.asarray(scale, np.float32).reshape(scale_shape or np.shape(scale))
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(FIXTURE, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f)
    return str(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _write_checkpoint(tmp_path_factory.mktemp("fp8") / "model", COMPRESSED)


def test_an_fp8_checkpoint_loads_as_the_engine_quantizes_the_full_one(checkpoint):
    qcfg, qparams = _quantized(load_model(FIXTURE, dtype="float32"))
    cfg, params = load_model(checkpoint, dtype="float32")
    assert cfg == qcfg and set(params) == set(qparams)
    for name, value in qparams.items():  # the same per-channel e4m3 rounding, the same fused layout
        assert params[name].dtype == value.dtype and params[name].shape == value.shape, name
        assert np.array_equal(np.asarray(params[name].astype(jnp.float32)), np.asarray(value.astype(jnp.float32))), name


def test_the_engine_generates_from_it_what_quantization_fp8_generates(checkpoint):
    prompts = [list(p) for p, _ in HF_CASES]
    from_checkpoint = LLM(checkpoint, **ENGINE)
    assert from_checkpoint.engine.runner.params["layers.0.qkv"].dtype == jnp.float8_e4m3fn
    quantized_here = LLM(FIXTURE, quantization="fp8", **ENGINE)
    tokens = [o.outputs[0].token_ids for o in from_checkpoint.generate(prompts, GREEDY, use_tqdm=False)]
    assert tokens == [o.outputs[0].token_ids for o in quantized_here.generate(prompts, GREEDY, use_tqdm=False)]
    # asking for fp8 over an fp8 checkpoint changes nothing
    again = LLM(checkpoint, quantization="fp8", **ENGINE)
    assert [o.outputs[0].token_ids for o in again.generate(prompts, GREEDY, use_tqdm=False)] == tokens


def test_per_tensor_scales_and_layers_left_in_full_precision(tmp_path):
    per_tensor = _write_checkpoint(tmp_path / "t", {"quant_method": "fp8", "activation_scheme": "dynamic"},
                                   per_tensor=True, scale_shape=())
    _, params = load_model(per_tensor, dtype="float32")
    scale = np.asarray(params["layers.0.o_scale"])
    assert scale.shape == (params["layers.0.o"].shape[0],) and np.all(scale == scale[0])  # one per tensor, broadcast
    qkv = np.asarray(params["layers.0.qkv_scale"])  # q, k and v each had its own
    assert len(np.unique(qkv)) == 3
    _, dummy = load_model(per_tensor, load_format="dummy")  # random weights, quantized as the checkpoint's are
    assert dummy["layers.0.qkv"].dtype == jnp.float8_e4m3fn and "layers.0.qkv_scale" in dummy
    mixed = _write_checkpoint(tmp_path / "m", COMPRESSED, keep=("layers.1.mlp.down_proj",))
    _, params = load_model(mixed, dtype="float32")
    assert params["layers.1.down"].dtype == jnp.float32 and "layers.1.down_scale" not in params
    assert params["layers.0.down"].dtype == jnp.float8_e4m3fn
    prompts = [list(HF_CASES[0][0])]
    as_is = LLM(mixed, **ENGINE)  # runs with one layer in full precision
    assert as_is.engine.runner.params["layers.1.down"].dtype == jnp.float32
    assert len(as_is.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12
    requantized = LLM(mixed, quantization="fp8", **ENGINE)  # quantizes what the checkpoint left
    assert requantized.engine.runner.params["layers.1.down"].dtype == jnp.float8_e4m3fn


_TP_SCRIPT = """
import json, sys
from jengine import LLM, SamplingParams
kw = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 64),
          seq_buckets=(4,), use_tqdm_on_load=False, compilation_cache_dir=None)
prompts = json.loads(sys.argv[2])
out = {}
for tp in (1, 2, 4):
    llm = LLM(sys.argv[1], tensor_parallel_size=tp, **kw)
    params = llm.engine.runner.params
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    out[tp] = dict(tokens=[o.outputs[0].token_ids for o in outs],
                   specs={n: list(getattr(params[n].sharding, "spec", [])) for n in (
                       "layers.0.qkv", "layers.0.qkv_scale", "layers.0.down", "layers.0.down_scale")})
llm = LLM(sys.argv[1], data_parallel_size=2, **kw)
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
out["dp2"] = [o.outputs[0].token_ids for o in outs]
print(json.dumps(out))
"""


def test_an_fp8_checkpoint_under_tensor_parallelism_generates_what_one_device_does(checkpoint):
    """The fixture has 2 kv heads: at TP 4 its fused qkv weight repeats them, values and scales alike. Two
    data-parallel replicas read the checkpoint alike too."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    prompts = [list(p) for p, _ in HF_CASES]
    proc = subprocess.run([sys.executable, "-P", "-c", _TP_SCRIPT, checkpoint, json.dumps(prompts)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_split_as_one_device(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({**COMPRESSED, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "4-bit int"),
    ({"quant_method": "compressed-tensors"}, "config_groups"),
    ("fp8", "must be an object"),
])
def test_schemes_jengine_cannot_read_are_refused_by_name(tmp_path, config, message):
    shutil.copytree(FIXTURE, tmp_path / "m")
    with open(tmp_path / "m" / "config.json") as f:
        raw = json.load(f)
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump({**raw, "quantization_config": config}, f)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "m"))


def test_missing_or_block_shaped_scales_and_orbax_are_refused(tmp_path):
    block = _write_checkpoint(tmp_path / "b", COMPRESSED, scale_shape=None)
    with safe_open(os.path.join(block, "model.safetensors"), framework="numpy") as f:
        names = list(f.keys())
    tensors = {}
    for name in names:
        tensors[name] = _read(block, name)
    tensors.pop("model.layers.0.self_attn.k_proj.weight_scale")
    save_file(tensors, os.path.join(block, "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.self_attn.k_proj.weight_scale'"):
        load_model(block, dtype="float32")
    tensors["model.layers.0.self_attn.k_proj.weight_scale"] = np.ones((2, 2), np.float32)  # block-wise
    save_file(tensors, os.path.join(block, "model.safetensors"))
    with pytest.raises(ValueError, match="not block-wise"):
        load_model(block, dtype="float32")
    fp8 = _write_checkpoint(tmp_path / "o", COMPRESSED)
    with pytest.raises(ValueError, match="Orbax"):
        load_model(fp8, load_format="orbax")
    with pytest.raises(ValueError, match="does not convert it to Orbax"):
        convert_to_orbax(fp8, str(tmp_path / "converted"))
    assert not os.path.exists(tmp_path / "converted")


def _read(path, name):
    from jengine.loader import _Tensors

    return _Tensors(os.path.join(path, "model.safetensors")).get(name, path)
