"""Model families for jengine (installed as `jengine.models`).

A registry maps the `architectures` field of `config.json` to the pure functions of a family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jengine.models import llama
from jengine.models.common import ModelInput, WeightSpec


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    weight_specs: Callable  # (cfg) -> dict[str, WeightSpec]
    forward: Callable  # (params, cfg, ModelInput, kv_caches) -> (kv_caches, hidden [T, H])
    compute_logits: Callable  # (params, cfg, hidden [N, H]) -> logits [N, V] f32


_LLAMA = ModelFamily("llama", llama.weight_specs, llama.forward, llama.compute_logits)

REGISTRY: dict[str, ModelFamily] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
}


def get_model_family(architecture: str) -> ModelFamily:
    """The implementation of an HF architecture name; unknown names list what is supported."""
    if architecture not in REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[architecture]


__all__ = ["REGISTRY", "ModelFamily", "ModelInput", "WeightSpec", "get_model_family"]
