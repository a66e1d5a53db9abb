"""ModelConfig parsed from Hugging Face config.json: old and new spellings, RoPE variants, validation."""

from __future__ import annotations

import json
import os

import pytest

from jengine.config import CheckpointQuantization, ModelConfig, RopeConfig, checkpoint_quantization
from jengine.models import get_model_family

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models")


def fixture_raw(name: str) -> dict:
    with open(os.path.join(FIXTURES_DIR, name, "config.json")) as f:
        return json.load(f)


def llama_raw(**changes) -> dict:
    """A minimal new-style (transformers 5) Llama config.json, with `changes` applied (None deletes)."""
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "dtype": "bfloat16",
        "eos_token_id": 2,
    }
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_minimal_config_fills_derived_fields_and_defaults():
    cfg = ModelConfig.from_hf_dict(llama_raw())
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.head_dim == 8  # hidden_size // num_attention_heads when head_dim is absent
    assert cfg.q_per_kv == 4
    assert cfg.rope == RopeConfig(theta=500000.0)
    assert cfg.dtype == "bfloat16"
    assert cfg.eos_token_ids == (2,)
    assert cfg.bos_token_id is None
    assert cfg.tie_word_embeddings is False
    assert cfg.attention_bias is False and cfg.qk_norm is False and cfg.sliding_window is None


def test_explicit_head_dim_overrides_hidden_over_heads():
    assert ModelConfig.from_hf_dict(llama_raw(head_dim=32)).head_dim == 32


def test_eos_token_id_list_becomes_tuple():
    assert ModelConfig.from_hf_dict(llama_raw(eos_token_id=[2, 7])).eos_token_ids == (2, 7)
    assert ModelConfig.from_hf_dict(llama_raw(eos_token_id=None)).eos_token_ids == ()


# --- old (transformers 4.x) vs new (5.x) spellings ---------------------------------------------

def test_torch_dtype_and_dtype_spellings_give_equal_configs():
    new = ModelConfig.from_hf_dict(llama_raw(dtype="float16"))
    old = ModelConfig.from_hf_dict(llama_raw(dtype=None, torch_dtype="float16"))
    assert old == new
    assert new.dtype == "float16"


def test_missing_dtype_defaults_to_bfloat16():
    assert ModelConfig.from_hf_dict(llama_raw(dtype=None)).dtype == "bfloat16"


@pytest.mark.parametrize("spelling, canonical", [
    ("bf16", "bfloat16"), ("torch.bfloat16", "bfloat16"), ("fp16", "float16"), ("half", "float16"),
    ("float", "float32"), ("FLOAT32", "float32"),
])
def test_dtype_aliases_normalize(spelling, canonical):
    assert ModelConfig.from_hf_dict(llama_raw(dtype=spelling)).dtype == canonical


LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_old_rope_theta_and_rope_scaling_equal_new_rope_parameters(type_key):
    new_raw = fixture_raw("llama3_tied")
    assert new_raw["rope_parameters"] == {**LLAMA3_SCALING, "rope_theta": 10000.0, "rope_type": "llama3"}
    old_raw = {k: v for k, v in new_raw.items() if k not in ("rope_parameters", "dtype")}
    old_raw.update(torch_dtype="float32", rope_theta=10000.0, rope_scaling={**LLAMA3_SCALING, type_key: "llama3"})
    assert ModelConfig.from_hf_dict(old_raw) == ModelConfig.from_hf_dict(new_raw)


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_new_rope_parameters_accept_both_type_keys(type_key):
    cfg = ModelConfig.from_hf_dict(llama_raw(rope_parameters={type_key: "linear", "factor": 4.0, "rope_theta": 1e4}))
    assert cfg.rope == RopeConfig(theta=10000.0, rope_type="linear", factor=4.0)


def test_old_spelling_without_rope_scaling_is_default_rope():
    cfg = ModelConfig.from_hf_dict(llama_raw(rope_parameters=None, rope_theta=1e6, rope_scaling=None))
    assert cfg.rope == RopeConfig(theta=1e6)


def test_missing_rope_settings_default_to_theta_10000():
    assert ModelConfig.from_hf_dict(llama_raw(rope_parameters=None)).rope == RopeConfig()


def test_fixture_old_spelling_llama_parses():
    cfg = ModelConfig.from_hf_dict(fixture_raw("llama"))  # torch_dtype, rope_theta, rope_scaling: null
    assert cfg.dtype == "float32"
    assert cfg.rope == RopeConfig(theta=10000.0)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 16)


# --- RoPE scaling types --------------------------------------------------------------------------

def test_rope_linear_parses_factor():
    cfg = ModelConfig.from_hf_dict(fixture_raw("llama_linear_sharded"))
    assert cfg.rope == RopeConfig(theta=10000.0, rope_type="linear", factor=4.0)


def test_rope_llama3_parses_its_fields():
    rope = ModelConfig.from_hf_dict(fixture_raw("llama3_tied")).rope
    assert rope == RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=64)


def test_rope_yarn_parses_its_fields():
    params = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
              "attention_factor": 1.5, "original_max_position_embeddings": 128}
    rope = ModelConfig.from_hf_dict(llama_raw(rope_parameters=params)).rope
    assert rope == RopeConfig(theta=1e6, rope_type="yarn", factor=4.0, beta_fast=16.0, beta_slow=2.0,
                              attention_factor=1.5, original_max_position_embeddings=128)


def test_rope_yarn_without_original_length_uses_max_position_embeddings():
    rope = ModelConfig.from_hf_dict(llama_raw(rope_parameters={"rope_type": "yarn", "factor": 2.0})).rope
    assert rope.original_max_position_embeddings == 512
    assert rope.attention_factor is None


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su"])
def test_unsupported_rope_type_is_named(rope_type):
    with pytest.raises(ValueError, match=f"rope_type='{rope_type}' is not supported; supported: default, linear"):
        ModelConfig.from_hf_dict(llama_raw(rope_parameters={"rope_type": rope_type, "factor": 2.0}))


def test_unsupported_rope_type_in_old_rope_scaling_is_named():
    with pytest.raises(ValueError, match="rope_type='dynamic' is not supported"):
        ModelConfig.from_hf_dict(llama_raw(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}))


def test_rope_parameters_that_is_not_an_object_is_rejected():
    with pytest.raises(ValueError, match="rope_parameters / rope_scaling must be JSON objects"):
        ModelConfig.from_hf_dict(llama_raw(rope_parameters=[1, 2]))


def test_partial_rotary_factor_is_rejected():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf_dict(llama_raw(partial_rotary_factor=0.5))


@pytest.mark.parametrize("dtype", ["int8", "float64", "torch.float8_e4m3fn"])
def test_unsupported_dtype_is_named(dtype):
    with pytest.raises(ValueError, match=f"dtype='{dtype}' is not supported; use one of float32, bfloat16, float16"):
        ModelConfig.from_hf_dict(llama_raw(dtype=dtype))


# --- shapes and embeddings -----------------------------------------------------------------------

def test_tied_embeddings_have_no_lm_head_weight():
    cfg = ModelConfig.from_hf_dict(fixture_raw("llama3_tied"))
    assert cfg.tie_word_embeddings is True
    specs = get_model_family(cfg.architecture).weight_specs(cfg)
    assert "lm_head" not in specs and "embed" in specs


def test_untied_embeddings_have_lm_head_weight():
    cfg = ModelConfig.from_hf_dict(fixture_raw("llama"))
    assert cfg.tie_word_embeddings is False
    specs = get_model_family(cfg.architecture).weight_specs(cfg)
    assert specs["lm_head"].shape == (64, 256)  # [H, V]


@pytest.mark.parametrize("kv_heads, ratio", [(8, 1), (2, 4), (1, 8)])
def test_gqa_ratios_are_accepted(kv_heads, ratio):
    cfg = ModelConfig.from_hf_dict(llama_raw(num_key_value_heads=kv_heads))
    assert cfg.q_per_kv == ratio
    qkv = get_model_family(cfg.architecture).weight_specs(cfg)["layers.0.qkv"]
    assert qkv.shape == (64, (8 + 2 * kv_heads) * 8)


def test_missing_num_key_value_heads_means_multi_head_attention():
    assert ModelConfig.from_hf_dict(llama_raw(num_key_value_heads=None)).num_key_value_heads == 8


@pytest.mark.parametrize("kv_heads", [3, 5, 16])
def test_heads_not_divisible_by_kv_heads_is_rejected(kv_heads):
    with pytest.raises(ValueError, match=rf"num_attention_heads \(8\) must be a multiple of num_key_value_heads "
                                         rf"\({kv_heads}\)"):
        ModelConfig.from_hf_dict(llama_raw(num_key_value_heads=kv_heads))


def test_odd_head_dim_is_rejected():
    with pytest.raises(ValueError, match="head_dim must be even for rotary embeddings, got 7"):
        ModelConfig.from_hf_dict(llama_raw(head_dim=7))


@pytest.mark.parametrize("field, value", [("vocab_size", 0), ("num_hidden_layers", -1), ("hidden_size", 6.5),
                                          ("intermediate_size", True)])
def test_non_positive_integer_size_is_named(field, value):
    with pytest.raises(ValueError, match=f"config field {field} must be a positive integer, got {value!r}"):
        ModelConfig.from_hf_dict(llama_raw(**{field: value}))


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads"])
def test_missing_required_field_is_named(field):
    raw = llama_raw()
    del raw[field]
    with pytest.raises(ValueError, match=f"config.json for LlamaForCausalLM is missing required field '{field}'"):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("archs", [None, [], "LlamaForCausalLM"])
def test_missing_architectures_is_rejected(archs):
    with pytest.raises(ValueError, match="config.json has no 'architectures' list"):
        ModelConfig.from_hf_dict(llama_raw(architectures=archs))


def test_config_that_is_not_an_object_is_rejected():
    with pytest.raises(ValueError, match="config.json must hold a JSON object"):
        ModelConfig.from_hf_dict([1, 2])


# --- architecture-specific fields ------------------------------------------------------------------

def test_qwen_sliding_window_is_off_unless_use_sliding_window():
    qwen = llama_raw(architectures=["Qwen2ForCausalLM"], sliding_window=64)
    assert ModelConfig.from_hf_dict(qwen).sliding_window is None
    assert ModelConfig.from_hf_dict({**qwen, "use_sliding_window": False}).sliding_window is None
    assert ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True}).sliding_window == 64


def test_mistral_sliding_window_is_kept():
    assert ModelConfig.from_hf_dict(fixture_raw("mistral")).sliding_window == 4096


def test_qwen2_has_qkv_bias_by_default_and_qwen3_has_qk_norm():
    qwen2 = ModelConfig.from_hf_dict(fixture_raw("qwen2"))  # no attention_bias key
    assert (qwen2.attention_bias, qwen2.qk_norm, qwen2.sliding_window) == (True, False, None)
    qwen3 = ModelConfig.from_hf_dict(fixture_raw("qwen3"))
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    assert qwen3.rope == RopeConfig(theta=1e6)


def test_unknown_architecture_lists_supported_ones():
    cfg = ModelConfig.from_hf_dict(llama_raw(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported; supported: "
                                         "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        get_model_family(cfg.architecture)


# --- files -----------------------------------------------------------------------------------------

def test_bad_json_file_is_rejected(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ValueError, match="is not valid JSON"):
        ModelConfig.from_json_file(str(path))


def test_model_dir_without_config_json_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json in model directory"):
        ModelConfig.from_model_dir(str(tmp_path))


def test_from_model_dir_reads_fixture():
    assert ModelConfig.from_model_dir(os.path.join(FIXTURES_DIR, "qwen2")) == ModelConfig.from_hf_dict(
        fixture_raw("qwen2"))


def test_config_is_frozen_and_replace_revalidates():
    cfg = ModelConfig.from_hf_dict(llama_raw())
    with pytest.raises(AttributeError):
        cfg.dtype = "float32"
    assert cfg.replace(dtype="f16").dtype == "float16"
    with pytest.raises(ValueError, match="must be a multiple of"):
        cfg.replace(num_key_value_heads=3)


def test_prequantized_checkpoints_jengine_cannot_read_are_refused_by_name():
    """Their tensors are quantized values with scales beside them: read as plain weights they would be wrong. 8-bit
    float weights with per-channel, per-tensor or block-wise scales load (tests/test_fp8_checkpoint.py); others fail
    here."""
    for method in ("awq", "gptq", "bitsandbytes"):
        with pytest.raises(ValueError, match=f"quantization_config.*'{method}'.*quantization='fp8'"):
            ModelConfig.from_hf_dict(llama_raw(quantization_config={"quant_method": method, "bits": 4}))
    for block in ([128], [128, 0], "128x128", [128.0, 128]):
        with pytest.raises(ValueError, match="weight_block_size must be two positive integers"):
            ModelConfig.from_hf_dict(llama_raw(quantization_config={"quant_method": "fp8", "weight_block_size": block}))
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_hf_dict(llama_raw(quantization_config=["odd"]))
    raw = llama_raw(quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert ModelConfig.from_hf_dict(raw).architecture == "LlamaForCausalLM"


def test_what_a_prequantized_checkpoint_holds():
    assert checkpoint_quantization(None) is None and checkpoint_quantization({}) is None
    assert checkpoint_quantization({"quant_method": "fp8"}) == CheckpointQuantization(None, "_scale")
    assert checkpoint_quantization({"quant_method": "fp8", "weight_block_size": [128, 64]}) == CheckpointQuantization(
        (128, 64), "_scale_inv")  # DeepSeek-V3 / Qwen3 FP8: `weight_scale_inv`, multiplied all the same
    group = {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}
    channel = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    compressed = {"quant_method": "compressed-tensors", "config_groups": {"g": group}}
    assert checkpoint_quantization(compressed) == CheckpointQuantization((128, 128), "_scale")
    with pytest.raises(ValueError, match="mix block-wise and other scales"):
        checkpoint_quantization({**compressed, "config_groups": {"g": group, "h": channel}})
    with pytest.raises(ValueError, match="block_structure must be two positive integers"):
        checkpoint_quantization({**compressed, "config_groups": {"g": {"weights": {**group["weights"],
                                                                                  "block_structure": None}}}})
    assert ModelConfig.from_hf_dict(llama_raw(quantization_config=None)).architecture == "LlamaForCausalLM"
