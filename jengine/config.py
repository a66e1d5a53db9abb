"""Model configuration: one frozen dataclass parsed from a Hugging Face `config.json`.

Both transformers spellings are accepted: `dtype` / `torch_dtype`, and RoPE settings either as
top-level `rope_theta` + `rope_scaling` (transformers 4.x) or as `rope_parameters` (5.x).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def normalize_dtype(name: Any, field: str = "dtype") -> str:
    """Map a dtype spelling ('bf16', 'torch.bfloat16', 'bfloat16') to a canonical name."""
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"{field}={name!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")
    return _DTYPE_ALIASES[key]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `rope_type` selects how inverse frequencies are scaled."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.partial_rotary_factor != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported for the Llama family")


# Pre-quantized checkpoints jengine reads (config.json's `quantization_config`): 8-bit e4m3 weights with a scale
# per output channel or per tensor, `w = weight * weight_scale`, as vLLM's "fp8" serialization and the
# compressed-tensors "float-quantized" FP8 checkpoints (e.g. the FP8-dynamic Llamas) store them; or with a scale per
# block of the weight `[out, in]` (`weight_block_size` / `block_structure`, DeepSeek-V3's and the Qwen3 FP8
# checkpoints' form), which the loader folds into one scale per output channel. Activations are quantized to e4m3
# too: with the checkpoint's static per-tensor `input_scale`s where it says so (`activation_scheme: "static"`, or
# compressed-tensors' `input_activations` with `dynamic: false`), as vLLM does, else with a scale per token computed
# at run time (also for weight-only checkpoints).


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """What a pre-quantized checkpoint's linear weights hold: e4m3 values and f32 scales, named
    `<module>.weight<scale_suffix>`, one per output channel or per tensor (`block` None) or one per `block` =
    (rows, columns) tile of the weight `[out, in]`."""

    block: tuple[int, int] | None = None
    scale_suffix: str = "_scale"
    method: str = "fp8"  # the `quantization` whose params the weights load into
    static_inputs: bool = False  # activations scaled by the checkpoint's `<module>.input_scale` (one per tensor)


def checkpoint_quantization(config) -> CheckpointQuantization | None:
    """What a checkpoint's `quantization_config` (None or a dict) says its tensors hold. A ValueError names what
    jengine cannot read (another method, integer or 4-bit weights, malformed blocks) instead of letting those
    tensors load as plain weights."""
    if not config:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {type(config).__name__}")
    method = config.get("quant_method")
    refused = (f"config.json's quantization_config (quant_method {method!r}) is not one jengine reads: it loads "
               "8-bit float (e4m3) weights with per-channel, per-tensor or block-wise scales (quant_method 'fp8', "
               "or 'compressed-tensors' in its float-quantized format); load the unquantized model with "
               "quantization='fp8' instead")
    if method == "fp8":
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"config.json's quantization_config: activation_scheme must be 'dynamic' or 'static', "
                             f"got {scheme!r}")
        block, static = config.get("weight_block_size"), scheme == "static"
        if block is None:
            return CheckpointQuantization(static_inputs=static)
        # vLLM's name for block-wise scales (they multiply all the same)
        return CheckpointQuantization(_block(block, "weight_block_size"), "_scale_inv", static_inputs=static)
    if method != "compressed-tensors":
        raise ValueError(refused)
    groups = config.get("config_groups")
    if not groups and config.get("kv_cache_scheme"):
        return None  # only the 8-bit KV cache's scales (the loader reads them); the weights are plain
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{refused} (no config_groups)")
    blocks, static = set(), set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"{refused} (config group {name!r} has no weights scheme)")
        scheme = (weights.get("num_bits"), weights.get("type"), weights.get("strategy"))
        if (scheme[:2] != (8, "float") or scheme[2] not in ("channel", "tensor", "block")
                or weights.get("symmetric") is False):
            raise ValueError(f"{refused} (config group {name!r}: weights {scheme[0]}-bit {scheme[1]}, "
                             f"strategy {scheme[2]!r})")
        blocks.add(_block(weights.get("block_structure"), f"config group {name!r}'s block_structure")
                   if scheme[2] == "block" else None)
        static.add(_static_inputs(group.get("input_activations"), name, refused))
    if len(blocks) > 1:
        raise ValueError(f"{refused} (config groups mix block-wise and other scales, or blocks of different "
                         f"sizes: {sorted(map(str, blocks))})")
    if len(static) > 1:
        raise ValueError(f"{refused} (config groups mix static and dynamic input activations)")
    return CheckpointQuantization(blocks.pop(), static_inputs=static.pop())


def _static_inputs(acts, group: str, refused: str) -> bool:
    """Whether a compressed-tensors group's `input_activations` are static (an e4m3 scale per tensor, stored as
    `input_scale`); None (weight-only) and dynamic ones are quantized per token at run time."""
    if acts is None:
        return False
    if not isinstance(acts, dict):
        raise ValueError(f"{refused} (config group {group!r}: input_activations must be an object or null)")
    if acts.get("dynamic", True) is not False:
        return False
    scheme = (acts.get("num_bits"), acts.get("type"), acts.get("strategy"))
    if scheme != (8, "float", "tensor"):
        raise ValueError(f"{refused} (config group {group!r}: static input activations {scheme[0]}-bit "
                         f"{scheme[1]}, strategy {scheme[2]!r}; jengine reads 8-bit float ones, one scale per tensor)")
    return True


def _block(value, field: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"config.json's quantization_config: {field} must be two positive integers "
                         f"[rows, columns], got {value!r}")
    return int(value[0]), int(value[1])


def read_config_json(model_dir: str) -> dict[str, Any]:
    """A model directory's parsed `config.json`; a ValueError if it is missing or not JSON."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no config.json in model directory {model_dir!r}")
    return _json_file(path)


def _json_file(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only transformer of the Llama family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    sliding_window: int | None = None
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or null, got {self.sliding_window}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed contents of a Hugging Face `config.json`."""
        if not isinstance(raw, dict):
            raise ValueError("config.json must hold a JSON object")
        archs = raw.get("architectures") or []
        if not archs or not isinstance(archs, list):
            raise ValueError("config.json has no 'architectures' list; cannot tell which model to build")
        arch = archs[0]
        checkpoint_quantization(raw.get("quantization_config"))  # a scheme jengine cannot read fails here

        def need(key):
            if key not in raw:
                raise ValueError(f"config.json for {arch} is missing required field {key!r}")
            return raw[key]

        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = raw.get("head_dim") or (hidden // num_heads if isinstance(num_heads, int) and num_heads else 0)
        sliding = raw.get("sliding_window")
        if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size but leave it switched off
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch.startswith("Qwen2"))),
            qk_norm=arch.startswith("Qwen3"),
            sliding_window=sliding,
            dtype=dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: str) -> ModelConfig:
        return cls.from_hf_dict(_json_file(path))

    @classmethod
    def from_model_dir(cls, model_dir: str) -> ModelConfig:
        return cls.from_hf_dict(read_config_json(model_dir))


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either `rope_parameters` (new) or `rope_theta`/`rope_scaling` (old)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ValueError("rope_parameters / rope_scaling must be JSON objects")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    kwargs: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                "attention_factor", "partial_rotary_factor"):
        if merged.get(key) is not None:
            kwargs[key] = float(merged[key])
    if merged.get("original_max_position_embeddings") is not None:
        kwargs["original_max_position_embeddings"] = int(merged["original_max_position_embeddings"])
    elif rope_type == "yarn":
        kwargs["original_max_position_embeddings"] = int(raw.get("max_position_embeddings", 4096))
    if raw.get("partial_rotary_factor") is not None:
        kwargs["partial_rotary_factor"] = float(raw["partial_rotary_factor"])
    return RopeConfig(**kwargs)
