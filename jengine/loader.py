"""Weights: from Hugging Face safetensors (single or sharded), from an Orbax checkpoint, or random.

Everything is driven by the family's `weight_specs(cfg)`: the loader fetches each spec's HF tensors,
checks their shapes, transposes and fuses them, and casts to the requested dtype on the device.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can read bf16 tensors)
import numpy as np
from safetensors import safe_open

from jengine.config import ModelConfig, normalize_dtype
from jengine.models import WeightSpec, get_model_family
from jengine.presets import resolve_model

LOAD_FORMATS = ("auto", "safetensors", "orbax", "dummy")
ORBAX_DIR = "orbax_params"
_INDEX = "model.safetensors.index.json"


def load_model(model: str, dtype: str | None = None, load_format: str = "auto",
               seed: int = 0) -> tuple[ModelConfig, dict[str, jax.Array]]:
    """Load a model directory (or a built-in preset name) into `(config, params)`.

    `dtype` None or "auto" keeps the checkpoint's dtype from config.json. `load_format="dummy"` makes
    deterministic random weights from `seed` for any config (as vLLM's `--load-format dummy`).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; use one of {', '.join(LOAD_FORMATS)}")
    model_dir, is_preset = resolve_model(model)
    cfg = ModelConfig.from_model_dir(model_dir)
    if dtype not in (None, "auto"):
        cfg = cfg.replace(dtype=normalize_dtype(dtype))
    specs = get_model_family(cfg.architecture).weight_specs(cfg)
    if load_format == "auto":
        load_format = detect_format(model_dir, is_preset)
    if load_format == "dummy":
        return cfg, dummy_params(specs, cfg.dtype, seed)
    if load_format == "orbax":
        return cfg, load_orbax(os.path.join(model_dir, ORBAX_DIR), specs, cfg.dtype)
    return cfg, load_safetensors(model_dir, specs, cfg.dtype)


def detect_format(model_dir: str, is_preset: bool) -> str:
    if os.path.isdir(os.path.join(model_dir, ORBAX_DIR)):
        return "orbax"
    if glob.glob(os.path.join(model_dir, "*.safetensors")):
        return "safetensors"
    if is_preset:
        return "dummy"
    raise ValueError(
        f"no weights found in {model_dir!r}: expected *.safetensors files or an Orbax checkpoint "
        f"({ORBAX_DIR}/ from `jengine convert`); use load_format='dummy' for random weights"
    )


def dummy_params(specs: dict[str, WeightSpec], dtype: str, seed: int) -> dict[str, jax.Array]:
    """Deterministic random weights: each tensor's key depends only on the seed and its name."""
    base = jax.random.PRNGKey(seed)
    params = {}
    for name, spec in specs.items():
        if spec.init == "ones":
            params[name] = jnp.ones(spec.shape, dtype)
        elif spec.init == "zeros":
            params[name] = jnp.zeros(spec.shape, dtype)
        else:
            key = jax.random.fold_in(base, zlib.crc32(name.encode()))
            std = spec.shape[0] ** -0.5 if name != "embed" else 1.0
            params[name] = _normal(key, spec.shape, std, dtype)
    return params


@jax.jit(static_argnums=(1, 3))
def _normal(key, shape, std, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def load_safetensors(model_dir: str, specs: dict[str, WeightSpec], dtype: str) -> dict[str, jax.Array]:
    """Read, check, fuse and cast every tensor the specs name; unused checkpoint tensors are ignored."""
    files = _tensor_files(model_dir)
    handles: dict[str, object] = {}
    params = {}
    try:
        for name, spec in specs.items():
            parts = []
            for hf_name, hf_shape in spec.sources:
                if hf_name not in files:
                    raise ValueError(f"checkpoint in {model_dir!r} is missing tensor {hf_name!r} (for {name})")
                path = files[hf_name]
                if path not in handles:
                    handles[path] = safe_open(path, framework="numpy")
                if hf_name not in handles[path].keys():  # a wrong sharded index; safetensors would raise its own error
                    raise ValueError(f"{_INDEX} in {model_dir!r} maps tensor {hf_name!r} to "
                                     f"{os.path.basename(path)}, which does not hold it")
                array = handles[path].get_tensor(hf_name)
                if tuple(array.shape) != tuple(hf_shape):
                    raise ValueError(
                        f"tensor {hf_name!r} has shape {tuple(array.shape)}, but config.json implies "
                        f"{tuple(hf_shape)}"
                    )
                parts.append(array.T if spec.transpose else array)
            array = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
            params[name] = jnp.asarray(array).astype(dtype)
    finally:
        handles.clear()
    return params


def _tensor_files(model_dir: str) -> dict[str, str]:
    """Map each tensor name to the safetensors file holding it (sharded index or every file)."""
    index = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        missing = {fn for fn in weight_map.values() if not os.path.isfile(os.path.join(model_dir, fn))}
        if missing:
            raise ValueError(f"{_INDEX} in {model_dir!r} names missing shard files: {sorted(missing)}")
        return {name: os.path.join(model_dir, fn) for name, fn in weight_map.items()}
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir!r}")
    mapping = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            mapping.update({name: path for name in f.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return mapping


def load_orbax(path: str, specs: dict[str, WeightSpec], dtype: str) -> dict[str, jax.Array]:
    """Restore params written by `save_orbax`, checked against the specs' shapes, cast to `dtype`."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        tree = getattr(meta, "item_metadata", None) or meta
        stored = set(tree.keys())
        missing = sorted(set(specs) - stored)
        if missing:
            raise ValueError(f"Orbax checkpoint {path!r} is missing params {missing[:5]}")
        for name, spec in specs.items():
            shape = tuple(tree[name].shape)
            if shape != spec.shape:
                raise ValueError(f"Orbax param {name!r} has shape {shape}, but config.json implies {spec.shape}")
        target = {name: jax.ShapeDtypeStruct(spec.shape, tree[name].dtype) for name, spec in specs.items()}
        restored = ckptr.restore(path, target)
    return {name: jnp.asarray(value).astype(dtype) for name, value in restored.items()}


def convert_to_orbax(model: str, out_dir: str, dtype: str | None = None, load_format: str = "auto") -> str:
    """`jengine convert`: load a model and write it as an Orbax checkpoint plus its config/tokenizer files."""
    model_dir, _ = resolve_model(model)
    cfg, params = load_model(model, dtype=dtype, load_format=load_format)
    if os.path.exists(os.path.join(out_dir, ORBAX_DIR)):
        raise ValueError(f"{out_dir!r} already holds an Orbax checkpoint; choose an empty directory")
    os.makedirs(out_dir, exist_ok=True)
    for path in glob.glob(os.path.join(model_dir, "*")):
        base = os.path.basename(path)
        if os.path.isfile(path) and not base.endswith(".safetensors") and base != _INDEX:
            shutil.copy(path, os.path.join(out_dir, base))
    with open(os.path.join(out_dir, "config.json")) as f:
        raw = json.load(f)
    raw.pop("torch_dtype", None)
    raw["dtype"] = cfg.dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(os.path.join(out_dir, ORBAX_DIR)), params)
    return out_dir
