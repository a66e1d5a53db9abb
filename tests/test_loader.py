"""load_model: safetensors error paths, dtype casting, dummy weights, presets and the Orbax round trip."""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jengine import loader
from jengine.config import ModelConfig
from jengine.generate import prompt_logits
from jengine.models import get_model_family

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models")
LLAMA = os.path.join(FIXTURES_DIR, "llama")
SHARDED = os.path.join(FIXTURES_DIR, "llama_linear_sharded")
INDEX = "model.safetensors.index.json"


def copy_fixture(src: str, tmp_path) -> str:
    dst = str(tmp_path / os.path.basename(src))
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: str, **changes) -> dict:
    """Apply `changes` to the checkpoint's config.json; returns the config as it was before."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        raw = json.load(f)
    with open(path, "w") as f:
        json.dump({**raw, **changes}, f)
    return raw


@functools.cache
def reference(path: str = LLAMA):
    """The fixture loaded as float32 (cached: several tests compare against it)."""
    return loader.load_model(path, dtype="float32")


def assert_same_params(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def rewrite_tensors(path: str, edit) -> None:
    """Rewrite one safetensors file with `edit(tensors)` applied to its name -> array dict."""
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_fixture_loads_every_spec_with_spec_shape():
    cfg, params = reference()
    specs = get_model_family(cfg.architecture).weight_specs(cfg)
    assert {name: p.shape for name, p in params.items()} == {name: s.shape for name, s in specs.items()}
    assert params["layers.0.qkv"].shape == (64, (4 + 2 * 1) * 16)  # q, k, v fused along out


# --- safetensors error paths ---------------------------------------------------------------------

def test_missing_tensor_is_named(tmp_path):
    model = copy_fixture(LLAMA, tmp_path)
    rewrite_tensors(os.path.join(model, "model.safetensors"),
                    lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                                         r"\(for layers\.1\.gate_up\)"):
        loader.load_model(model)


def test_wrong_shape_tensor_is_named_with_both_shapes(tmp_path):
    model = copy_fixture(LLAMA, tmp_path)

    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)  # wants (16, 64)

    rewrite_tensors(os.path.join(model, "model.safetensors"), shrink)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
                                         r"\(32, 64\), but config\.json implies \(16, 64\)"):
        loader.load_model(model)


def test_config_disagreeing_with_checkpoint_reports_shapes(tmp_path):
    model = copy_fixture(LLAMA, tmp_path)
    edit_config(model, vocab_size=300)
    with pytest.raises(ValueError, match=r"tensor 'model\.embed_tokens\.weight' has shape \(256, 64\), "
                                         r"but config\.json implies \(300, 64\)"):
        loader.load_model(model)


def test_sharded_checkpoint_loads_same_as_merged_single_file(tmp_path):
    cfg, want = reference(SHARDED)
    model = copy_fixture(SHARDED, tmp_path)
    with open(os.path.join(model, INDEX)) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    merged = {}
    for shard in shards:
        merged.update(load_file(os.path.join(model, shard)))
        os.remove(os.path.join(model, shard))
    os.remove(os.path.join(model, INDEX))
    save_file(merged, os.path.join(model, "model.safetensors"))
    assert_same_params(loader.load_model(model, dtype="float32")[1], want)


def test_sharded_index_naming_missing_shard_is_rejected(tmp_path):
    model = copy_fixture(SHARDED, tmp_path)
    os.remove(os.path.join(model, "model-00003-of-00006.safetensors"))
    with pytest.raises(ValueError, match=r"names missing shard files: \['model-00003-of-00006\.safetensors'\]"):
        loader.load_model(model)


def test_sharded_index_mapping_tensor_to_wrong_shard_is_named(tmp_path):
    model = copy_fixture(SHARDED, tmp_path)
    index_path = os.path.join(model, INDEX)
    with open(index_path) as f:
        index = json.load(f)
    name = "model.norm.weight"
    wrong = next(fn for fn in sorted(set(index["weight_map"].values())) if fn != index["weight_map"][name])
    index["weight_map"][name] = wrong
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match=f"maps tensor 'model.norm.weight' to {wrong}, which does not hold it"):
        loader.load_model(model)


def test_directory_with_only_config_has_no_weights(tmp_path):
    shutil.copy(os.path.join(LLAMA, "config.json"), tmp_path / "config.json")
    with pytest.raises(ValueError, match="no weights found in .*load_format='dummy' for random weights"):
        loader.load_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"no \*\.safetensors files in"):
        loader.load_model(str(tmp_path), load_format="safetensors")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json in model directory"):
        loader.load_model(str(tmp_path))


@pytest.mark.parametrize("load_format", ["pt", "gguf", ""])
def test_unsupported_load_format_is_named(load_format):
    with pytest.raises(ValueError, match=f"load_format='{load_format}' is not supported; "
                                         "use one of auto, safetensors, orbax, dummy"):
        loader.load_model(LLAMA, load_format=load_format)


def test_unknown_architecture_fails_before_reading_weights(tmp_path):
    model = copy_fixture(LLAMA, tmp_path)
    edit_config(model, architectures=["FalconForCausalLM"])
    with pytest.raises(ValueError, match="architecture 'FalconForCausalLM' is not supported; supported: Llama"):
        loader.load_model(model)


# --- dtypes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, want", [("bfloat16", jnp.bfloat16), ("bf16", jnp.bfloat16),
                                         ("float16", jnp.float16), ("float32", jnp.float32)])
def test_requested_dtype_casts_every_param(dtype, want):
    _, f32 = reference()
    cfg, params = loader.load_model(LLAMA, dtype=dtype)
    assert cfg.dtype == jnp.dtype(want).name
    for name, p in params.items():
        assert p.dtype == want, name
        np.testing.assert_array_equal(np.asarray(p), np.asarray(f32[name].astype(want)), err_msg=name)


@pytest.mark.parametrize("dtype", [None, "auto"])
def test_auto_dtype_keeps_config_dtype(dtype):
    cfg, params = loader.load_model(LLAMA, dtype=dtype)  # fixture config says torch_dtype float32
    assert cfg.dtype == "float32"
    assert {p.dtype for p in params.values()} == {jnp.dtype(jnp.float32)}


def test_unsupported_requested_dtype_is_named():
    with pytest.raises(ValueError, match="dtype='int4' is not supported"):
        loader.load_model(LLAMA, dtype="int4")


def test_bf16_checkpoint_upcasts_exactly_to_f32(tmp_path):
    _, f32 = reference()
    model = copy_fixture(LLAMA, tmp_path)

    def to_bf16(tensors):
        tensors.update({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()})

    rewrite_tensors(os.path.join(model, "model.safetensors"), to_bf16)
    cfg, params = loader.load_model(model, dtype="float32")
    assert cfg.dtype == "float32"
    for name, p in params.items():
        assert p.dtype == jnp.float32, name
        np.testing.assert_array_equal(np.asarray(p), np.asarray(f32[name].astype(jnp.bfloat16).astype(jnp.float32)),
                                      err_msg=name)


# --- dummy weights and presets -------------------------------------------------------------------

def test_dummy_weights_are_deterministic_per_seed_for_a_config_only_dir(tmp_path):
    shutil.copy(os.path.join(FIXTURES_DIR, "qwen3", "config.json"), tmp_path / "config.json")
    cfg, a = loader.load_model(str(tmp_path), load_format="dummy", seed=3)
    _, b = loader.load_model(str(tmp_path), load_format="dummy", seed=3)
    _, c = loader.load_model(str(tmp_path), load_format="dummy", seed=4)
    specs = get_model_family(cfg.architecture).weight_specs(cfg)
    assert {n: p.shape for n, p in a.items()} == {n: s.shape for n, s in specs.items()}
    assert_same_params(b, a)
    for name, spec in specs.items():
        if spec.init == "normal":
            assert not np.array_equal(np.asarray(a[name]), np.asarray(c[name])), name
        else:  # norms are ones, biases zeros, whatever the seed
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(c[name]), err_msg=name)
    assert float(a["layers.0.q_norm"][0]) == 1.0


def test_dummy_weights_ignore_checkpoint_and_follow_dtype():
    cfg, params = loader.load_model(LLAMA, dtype="bfloat16", load_format="dummy", seed=0)
    _, real = reference()
    assert {p.dtype for p in params.values()} == {jnp.dtype(jnp.bfloat16)}
    assert not np.array_equal(np.asarray(params["embed"], np.float32), np.asarray(real["embed"]))


def test_builtin_preset_loads_random_weights_without_files():
    cfg, params = loader.load_model("jengine/tiny-llama")
    assert (cfg.architecture, cfg.vocab_size, cfg.num_hidden_layers, cfg.dtype) == (
        "LlamaForCausalLM", 384, 4, "float32")
    assert cfg.eos_token_ids == (257, 260)
    assert params["embed"].shape == (384, 256)
    _, again = loader.load_model("jengine/tiny-llama")
    assert_same_params(again, params)


def test_unknown_model_path_mentions_presets():
    with pytest.raises(ValueError, match=r"model '/no/such/model' is neither a local directory nor a built-in "
                                         r"preset \(presets: .*jengine/tiny-llama"):
        loader.load_model("/no/such/model")
    with pytest.raises(ValueError, match="model 'jengine/no-such-preset' is neither"):
        loader.load_model("jengine/no-such-preset")


# --- Orbax ---------------------------------------------------------------------------------------

def test_orbax_round_trip_gives_identical_params_and_logits(tmp_path):
    cfg, params = reference()
    out = str(tmp_path / "orbax_model")
    assert loader.convert_to_orbax(LLAMA, out) == out
    assert os.path.isdir(os.path.join(out, loader.ORBAX_DIR))
    assert not any(f.endswith(".safetensors") for f in os.listdir(out))
    assert loader.detect_format(out, is_preset=False) == "orbax"
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    assert raw["dtype"] == "float32" and "torch_dtype" not in raw

    cfg2, params2 = loader.load_model(out)
    assert cfg2 == cfg
    assert_same_params(params2, params)
    ids = [1, 17, 200, 3, 255, 42, 9]
    np.testing.assert_array_equal(prompt_logits(cfg2, params2, ids), prompt_logits(cfg, params, ids))

    with pytest.raises(ValueError, match="already holds an Orbax checkpoint; choose an empty directory"):
        loader.convert_to_orbax(LLAMA, out)


def test_orbax_checkpoint_with_other_shapes_is_rejected(tmp_path):
    out = str(tmp_path / "orbax_model")
    loader.convert_to_orbax(LLAMA, out, dtype="bfloat16")
    _, params = loader.load_model(out, dtype="float32")  # stored bf16, cast on load
    assert params["embed"].dtype == jnp.float32
    assert edit_config(out, intermediate_size=96)["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=r"Orbax param 'layers\.0\.gate_up' has shape \(64, 256\), "
                                         r"but config\.json implies \(64, 192\)"):
        loader.load_model(out)


def test_config_from_model_dir_matches_load_model():
    cfg, _ = reference()
    assert cfg == ModelConfig.from_model_dir(LLAMA).replace(dtype="float32")
