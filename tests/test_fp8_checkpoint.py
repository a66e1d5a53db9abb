"""Pre-quantized fp8 checkpoints (config.json's `quantization_config`): 8-bit e4m3 linear weights with per-channel
or per-tensor scales load as they are, into the params `quantization="fp8"` makes (values `[out, in]`, f32 scales
per output column), fused and split over a mesh the same way; block-wise scales are folded into per-channel ones.
Schemes jengine cannot read are refused by name."""

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


def _write_checkpoint(out, quantization_config, per_tensor=False, keep=(), scale_shape=None, block=None,
                      suffix="_scale"):
    """The test fixture's f32 checkpoint with its linear layers (but those named in `keep`) as e4m3 values and
    scales `<name><suffix>`, as an FP8 checkpoint tool writes them: per channel `[out, 1]`, here rounded as
    `quantization.fp8_weight` rounds (or one per tensor, or one per `block` tile)."""
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
            elif block:
                tensors[name], scale = _block_quantized(w, block)
            else:  # as the engine quantizes (its rounding of the scales too), for tokens to compare exactly
                q, scale = quantization.fp8_weight(jnp.asarray(w.T))
                tensors[name], scale = np.asarray(q), np.asarray(scale)[:, None]
            tensors[name + suffix] = np.asarray(scale, np.float32).reshape(scale_shape or np.shape(scale))
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(FIXTURE, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f)
    return str(out)


def _block_quantized(w, block):
    """`w [out, in]` as e4m3 values and one scale per `block` tile (the last ones cut short), each tile's largest
    value at 448, as DeepSeek-V3's and the Qwen3 FP8 checkpoints are made."""
    per_value = _tiled(_tile_amax(w, block) / np.float32(448), block, w.shape)
    return np.clip(w / per_value, -448, 448).astype(E4M3), _tile_amax(w, block) / np.float32(448)


def _tile_amax(w, block):
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    return np.array([[np.max(np.abs(w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]))
                      for j in range(cols)] for i in range(rows)], np.float32)


def _tiled(scales, block, shape):
    return np.repeat(np.repeat(scales, block[0], axis=0), block[1], axis=1)[:shape[0], :shape[1]]


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


def test_block_wise_scales_fold_into_one_per_output_channel(tmp_path, checkpoint):
    """A row's tiles of one scale are the per-channel checkpoint again, bit for bit; tiles of different scales (48 x
    24, the last ones cut short) round once more at the row's scale, within half an e4m3 step."""
    tensors = {name: _read(checkpoint, name) for name in _names(checkpoint)}
    for name in [n for n in tensors if n.endswith("_proj.weight")]:  # each row's scale over tiles of 1 x 24
        tensors[name + "_scale_inv"] = np.repeat(tensors.pop(name + "_scale"), -(-tensors[name].shape[1] // 24), axis=1)
    repeated = shutil.copytree(checkpoint, tmp_path / "r")
    save_file(tensors, os.path.join(repeated, "model.safetensors"))
    _set_quantization_config(repeated, {"quant_method": "fp8", "weight_block_size": [1, 24]})
    _, params = load_model(checkpoint, dtype="float32")
    _, from_blocks = load_model(str(repeated), dtype="float32")
    assert set(from_blocks) == set(params)
    for name, value in params.items():
        assert np.array_equal(np.asarray(from_blocks[name].astype(jnp.float32)), np.asarray(value.astype(jnp.float32)))

    block = (48, 24)
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                 "block_structure": list(block), "symmetric": True}}
    tiles = _write_checkpoint(tmp_path / "t", {**COMPRESSED, "config_groups": {"group_0": group}}, block=block)
    cfg, params = load_model(tiles, dtype="float32")
    hf = "model.layers.1.mlp.gate_proj.weight"  # [128, 64]: 3 x 3 tiles, the last row and column of tiles cut short
    assert _read(tiles, hf + "_scale").shape == (3, 3)
    exact = _read(tiles, hf).astype(np.float32) * _tiled(_read(tiles, hf + "_scale"), block, (128, 64))
    values, scales = np.asarray(params["layers.1.gate_up"][:128]).astype(np.float32), np.asarray(
        params["layers.1.gate_up_scale"][:128])
    assert np.allclose(scales, np.max(np.abs(exact), axis=1) / 448, rtol=1e-6)
    # half an e4m3 step: 1/16 of a normal value, 2^-10 of the scale below 2^-6 (subnormals)
    assert np.all(np.abs(values * scales[:, None] - exact) <= np.maximum(np.abs(exact) / 16, scales[:, None] / 1024))
    assert not np.array_equal(values * scales[:, None], exact)  # rounded again: the test sees the requantizing
    tokens = LLM(tiles, **ENGINE).generate([list(HF_CASES[0][0])], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(tokens) == 12

    tensors = {name: _read(tiles, name) for name in _names(tiles)}
    tensors["model.layers.0.mlp.down_proj.weight_scale"] = np.ones((2, 5), np.float32)  # [64, 128] needs 2 x 6
    save_file(tensors, os.path.join(tiles, "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight_scale'.*expected \(2, 6\)"):
        load_model(tiles, dtype="float32")


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128, 1]}, "two positive integers"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({**COMPRESSED, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "4-bit int"),
    ({"quant_method": "compressed-tensors"}, "config_groups"),
    ("fp8", "must be an object"),
])
def test_schemes_jengine_cannot_read_are_refused_by_name(tmp_path, config, message):
    shutil.copytree(FIXTURE, tmp_path / "m")
    _set_quantization_config(tmp_path / "m", config)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "m"))


def _set_quantization_config(model_dir, config):
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({**raw, "quantization_config": config}, f)


def _names(model_dir):
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="numpy") as f:
        return list(f.keys())


def test_missing_or_block_shaped_scales_and_orbax_are_refused(tmp_path):
    block = _write_checkpoint(tmp_path / "b", COMPRESSED, scale_shape=None)
    tensors = {name: _read(block, name) for name in _names(block)}
    tensors.pop("model.layers.0.self_attn.k_proj.weight_scale")
    save_file(tensors, os.path.join(block, "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.self_attn.k_proj.weight_scale'"):
        load_model(block, dtype="float32")
    tensors["model.layers.0.self_attn.k_proj.weight_scale"] = np.ones((2, 2), np.float32)  # block-wise
    save_file(tensors, os.path.join(block, "model.safetensors"))
    with pytest.raises(ValueError, match="implies per-channel"):
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
