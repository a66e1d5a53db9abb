"""Tensor parallelism on one host: the device mesh, the logical-axis rules and the fused-weight layout.

Model code names logical axes only (`WeightSpec.axes`); `RULES` maps each to a mesh axis. With
`tensor_parallel_size` = tp > 1 the mesh is one axis `"tp"` over the first tp devices:

- attention is split by heads (`qkv` columns, `o` rows), the MLP by its intermediate dimension
  (`gate_up` columns, `down` rows), the embedding and the LM head by vocabulary (logits are gathered);
  norms are replicated. GSPMD inserts the collectives (an all-reduce after `o` and after `down`).
- the KV cache is split by KV heads; attention and the cache write run per shard (`shard_map`).
- when tp exceeds the number of KV heads, each KV head is replicated tp / Hkv times, so every shard
  holds exactly one; this is the same model as one with tp KV heads, each copied from its group's.

Fused weights in the TP layout. A plain column split must hand each shard its own heads, so for
tp > 1 the fused output axis is permuted at load time, shard-major:

    qkv:     [q heads of shard 0 | k heads of shard 0 | v heads of shard 0 | q heads of shard 1 | ...]
    gate_up: [gate cols of shard 0 | up cols of shard 0 | gate cols of shard 1 | ...]

The model reshapes the fused output to `[T, tp, per_shard]` and slices within a shard; with tp = 1
that is exactly the checkpoint's order, so nothing changes for one device.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jengine.config import ModelConfig

if TYPE_CHECKING:  # the model package imports this module, not the reverse
    from jengine.models import WeightSpec

logger = logging.getLogger(__name__)

TP = "tp"
# Logical axis -> mesh axis (None: replicated).
RULES: dict[str | None, str | None] = {
    "vocab": TP, "heads": TP, "kv_heads": TP, "qkv": TP, "mlp": TP, "embed": None, None: None,
}


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise a ValueError naming the model dimension that tp does not divide."""
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the number of query heads "
                         f"({cfg.num_attention_heads})")
    hkv = cfg.num_key_value_heads
    if hkv % tp and tp % hkv:
        raise ValueError(f"tensor_parallel_size={tp} must divide, or be a multiple of, the number of KV heads "
                         f"({hkv})")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size ({cfg.intermediate_size})")


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh | None:
    """A one-axis `("tp",)` mesh over the first tp of `devices` (default: all). None for tp = 1 without
    explicit devices (the single-device path); a data-parallel replica passes its device group."""
    explicit = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    tp = tensor_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0 or len(devices) % tp:
        raise ValueError(f"tensor_parallel_size={tp!r} must be a positive integer dividing the number of "
                         f"devices ({len(devices)})")
    if tp == 1 and not explicit:
        return None
    return Mesh(np.array(devices[:tp]), (TP,))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP]


def sharded_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config of the model the devices hold: KV heads replicated up to tp when tp exceeds them."""
    if tp <= cfg.num_key_value_heads:
        return cfg
    return cfg.replace(num_key_value_heads=tp)


def partition_spec(axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None,
                   mesh: Mesh | None = None) -> PartitionSpec:
    """Logical axes -> PartitionSpec; a dimension the mesh axis does not divide stays replicated."""
    out = []
    for i, axis in enumerate(axes):
        mesh_axis = RULES[axis]
        if mesh_axis is not None and shape is not None and mesh is not None and shape[i] % mesh.shape[mesh_axis]:
            mesh_axis = None
        out.append(mesh_axis)
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, spec: WeightSpec) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(spec.axes, spec.shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """One layer's cache `[2, Hkv, pages, page_size, D]`, split by KV heads."""
    return NamedSharding(mesh, PartitionSpec(None, RULES["kv_heads"]))


def per_head_shard(fn, mesh: Mesh | None, num_split_args: int):
    """Run `fn` once per shard: its first `num_split_args` arguments and all its outputs are split on
    axis 1 (heads: `[T, H, D]` activations, `[2, Hkv, ...]` caches), the other arguments replicated.
    With no mesh (tp = 1) `fn` itself is returned."""
    if mesh is None:
        return fn
    heads = PartitionSpec(None, RULES["kv_heads"])

    def run(*args):
        in_specs = (heads,) * num_split_args + (PartitionSpec(),) * (len(args) - num_split_args)
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(*args)

    return run


def fused_parts(spec: WeightSpec, cfg: ModelConfig, tp: int) -> list[tuple[int, int]] | None:
    """(width, head repeat) of each part of a fused output axis, or None if the weight is not fused."""
    if len(spec.sources) < 2:
        return None
    rep = max(1, tp // cfg.num_key_value_heads) if "qkv" in spec.axes else 1
    return [(shape[0], rep if "qkv" in spec.axes and i > 0 else 1) for i, (_, shape) in enumerate(spec.sources)]


def to_tp_layout(x, parts: list[tuple[int, int]], tp: int, head_dim: int, xp=np):
    """Permute (and for replicated KV heads, widen) the last axis of a fused weight into the TP layout.

    `xp` is numpy (checkpoints, on the host) or jax.numpy (random weights, on the devices).
    """
    lead, pieces, lo = x.shape[:-1], [], 0
    for width, rep in parts:
        part = x[..., lo : lo + width]
        lo += width
        if rep > 1:  # [..., heads, D] -> each head repeated rep times
            part = xp.repeat(part.reshape(*lead, width // head_dim, head_dim), rep, axis=-2)
        pieces.append(part.reshape(*lead, tp, -1))
    assert lo == x.shape[-1], (lo, x.shape)
    return xp.concatenate(pieces, axis=-1).reshape(*lead, -1)


def bytes_per_device(tree) -> dict[str, int]:
    """Bytes each device holds of a pytree of arrays (its own shards only)."""
    totals: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            key = str(shard.device)
            totals[key] = totals.get(key, 0) + shard.data.nbytes
    return totals


def log_memory(what: str, tree) -> dict[str, int]:
    per_device = bytes_per_device(tree)
    logger.info("%s: %s", what, ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in sorted(per_device.items())))
    return per_device
