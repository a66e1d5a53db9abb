"""Weights: from Hugging Face safetensors (single or sharded), from an Orbax checkpoint, or random.

Everything is driven by the family's `weight_specs(cfg)`: the loader fetches each spec's HF tensors,
checks their shapes, transposes and fuses them, and casts to the requested dtype on the device.
With a tensor-parallel `mesh`, each weight goes straight into its shards (`jengine.sharding`): from
host numpy slices for safetensors, generated per shard for dummy weights, restored per shard from Orbax;
fused weights are put in the TP layout on the way. No device ever holds a full copy of a split weight.
A pre-quantized fp8 checkpoint's 8-bit linear weights load as they are, with their scales
(`load_safetensors`); block-wise scales are folded into one per output channel.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can read bf16 tensors)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open

from jengine.config import (
    CheckpointQuantization,
    ModelConfig,
    checkpoint_quantization,
    normalize_dtype,
    read_config_json,
)
from jengine.models import WeightSpec, get_model_family
from jengine.models.common import KV_CACHE_SCALES
from jengine.presets import resolve_model
from jengine.quantization import (
    FP8_DTYPE,
    fp8_from_blocks,
    fp8_shardings,
    input_scale_name,
    linear_weights,
    quantize,
    scale_name,
)
from jengine.sharding import (
    TP,
    check_tensor_parallel,
    fused_parts,
    named_sharding,
    sharded_model_config,
    to_tp_layout,
    tp_size,
)

LOAD_FORMATS = ("auto", "safetensors", "orbax", "dummy")
ORBAX_DIR = "orbax_params"
_INDEX = "model.safetensors.index.json"


def load_model(model: str, dtype: str | None = None, load_format: str = "auto",
               seed: int = 0, mesh=None) -> tuple[ModelConfig, dict[str, jax.Array]]:
    """Load a model directory (or a built-in preset name) into `(config, params)`.

    `dtype` None or "auto" keeps the checkpoint's dtype from config.json. `load_format="dummy"` makes
    deterministic random weights from `seed` for any config (as vLLM's `--load-format dummy`).
    `mesh`: a tensor-parallel mesh (`sharding.make_mesh`); params come back sharded, in the TP layout,
    shaped as `weight_specs(sharded_model_config(cfg, tp))`. The returned config is the checkpoint's.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; use one of {', '.join(LOAD_FORMATS)}")
    model_dir, is_preset = resolve_model(model)
    raw = read_config_json(model_dir)
    cfg = ModelConfig.from_hf_dict(raw)
    if dtype not in (None, "auto"):
        cfg = cfg.replace(dtype=normalize_dtype(dtype))
    specs = get_model_family(cfg.architecture).weight_specs(cfg)
    layout = None
    if mesh is not None:
        check_tensor_parallel(cfg, tp_size(mesh))
        layout = TensorParallelLayout(cfg, specs, mesh)
    if load_format == "auto":
        load_format = detect_format(model_dir, is_preset)
    quantized = checkpoint_quantization(raw.get("quantization_config"))
    if load_format == "dummy":  # random weights quantized as the checkpoint's would be
        params = dummy_params(specs, cfg.dtype, seed, layout)
        if not quantized:
            return cfg, params
        params = quantize(params, linear_weights(specs), quantized.method)
        if quantized.static_inputs:  # placeholders of 1: random weights have no calibration (the work is the same)
            params.update({input_scale_name(name): jax.device_put(np.float32(1.0), _everywhere(layout))
                           for name in linear_weights(specs)})
        return cfg, params
    if load_format == "orbax":
        if quantized:
            raise ValueError(f"{model_dir!r} holds a pre-quantized ({quantized.method}) model: it loads from its "
                             "safetensors files, not from an Orbax checkpoint")
        return cfg, load_orbax(os.path.join(model_dir, ORBAX_DIR), specs, cfg.dtype, layout)
    return cfg, load_safetensors(model_dir, specs, cfg.dtype, layout, quantized)


class TensorParallelLayout:
    """Where each weight lives under TP: its fused-column permutation and its sharding."""

    def __init__(self, cfg: ModelConfig, specs: dict[str, WeightSpec], mesh):
        self.cfg, self.specs, self.mesh, self.tp = cfg, specs, mesh, tp_size(mesh)
        self.targets = get_model_family(cfg.architecture).weight_specs(sharded_model_config(cfg, self.tp))

    def parts(self, name: str):
        return fused_parts(self.specs[name], self.cfg, self.tp)

    def sharding(self, name: str):
        return named_sharding(self.mesh, self.targets[name])

    def from_host(self, name: str, array: np.ndarray, dtype: str) -> jax.Array:
        """A logical-layout numpy weight -> its TP layout, each device receiving only its slice."""
        parts = self.parts(name)
        if parts:
            array = to_tp_layout(array, parts, self.tp, self.cfg.head_dim)
        np_dtype = jnp.dtype(dtype)
        return jax.make_array_from_callback(array.shape, self.sharding(name),
                                            lambda index: np.asarray(array[index]).astype(np_dtype))


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


def dummy_params(specs: dict[str, WeightSpec], dtype: str, seed: int,
                 layout: TensorParallelLayout | None = None) -> dict[str, jax.Array]:
    """Deterministic random weights: each tensor's key depends only on the seed and its name.

    Under TP each device generates only its shards (the partitionable threefry PRNG gives the same
    values as one device), then fused weights are permuted into the TP layout on the devices."""
    base = jax.random.PRNGKey(seed)
    params = {}
    for name, spec in specs.items():
        if layout is not None:
            key = jax.random.fold_in(base, zlib.crc32(name.encode()))
            std = spec.shape[0] ** -0.5 if name != "embed" else 1.0
            parts = tuple(layout.parts(name) or ())
            params[name] = _sharded_init(spec.init, spec.shape, dtype, parts, layout.tp, layout.cfg.head_dim,
                                         layout.sharding(name))(key, std)
        elif spec.init == "ones":
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


@functools.cache
def _sharded_init(init, shape, dtype, parts, tp, head_dim, sharding):
    """A program making one weight straight into its shards (one per distinct shape and layout)."""

    def make(key, std):
        if init == "ones":
            x = jnp.ones(shape, dtype)
        elif init == "zeros":
            x = jnp.zeros(shape, dtype)
        else:
            x = (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)
        return to_tp_layout(x, list(parts), tp, head_dim, xp=jnp) if parts else x

    return jax.jit(make, out_shardings=sharding)


def load_safetensors(model_dir: str, specs: dict[str, WeightSpec], dtype: str,
                     layout: TensorParallelLayout | None = None,
                     quantized: CheckpointQuantization | None = None) -> dict[str, jax.Array]:
    """Read, check, fuse and cast every tensor the specs name; unused checkpoint tensors are ignored.

    A linear layer's 8-bit (e4m3) tensor, in a pre-quantized checkpoint (`quantized`), loads as it is with its scale
    beside it (`<module>.weight_scale`, per output channel or per tensor), in `jengine.quantization`'s layout: values
    `[out, in]` and f32 scales `[out]` (`scale_name`), fused and split over a mesh as that module's quantized
    weights are. Block-wise scales (`<module>.weight_scale_inv` or `.weight_scale`, one per tile) are folded into one
    per output channel first (`quantization.fp8_from_blocks`). Where the checkpoint's activations are static, each
    layer's `<module>.input_scale` loads as `input_scale_name(name)` (the largest of a fused layer's parts)."""
    quantized = quantized or CheckpointQuantization()
    files = _tensor_files(model_dir)
    handles: dict[str, _Tensors] = {}

    def read(hf_name: str, for_name: str, shape=None) -> np.ndarray:
        if hf_name not in files:
            raise ValueError(f"checkpoint in {model_dir!r} is missing tensor {hf_name!r} (for {for_name})")
        path = files[hf_name]
        if path not in handles:
            handles[path] = _Tensors(path)
        array = handles[path].get(hf_name, model_dir)
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(array.shape)}, but config.json implies "
                             f"{tuple(shape)}")
        return array

    params = {}
    try:
        for name, spec in specs.items():
            arrays = [read(hf_name, name, hf_shape) for hf_name, hf_shape in spec.sources]
            eight_bit = [a.dtype == FP8_DTYPE for a in arrays]
            if any(eight_bit):
                if not (all(eight_bit) and spec.transpose and len(spec.shape) == 2):
                    raise ValueError(f"checkpoint in {model_dir!r}: {name} reads 8-bit tensors "
                                     f"{[h for h, _ in spec.sources]} only where every part of a linear layer is 8-bit")
                sources = [_fp8_source(a, read(h + quantized.scale_suffix, name), h + quantized.scale_suffix,
                                        quantized.block, on_host=layout is not None)
                           for (h, _), a in zip(spec.sources, arrays)]
                xp = np if layout is not None else jnp  # one device: folded blocks stay where they were made
                params.update(_fp8_param(name, xp.concatenate([v for v, _ in sources], axis=0),
                                         xp.concatenate([s for _, s in sources]), layout))
                if quantized.static_inputs:
                    params[input_scale_name(name)] = _input_scale(read, name, [h for h, _ in spec.sources], layout)
                continue
            parts = [a.T if spec.transpose else a for a in arrays]
            array = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
            if layout is not None:
                params[name] = layout.from_host(name, array, dtype)
            else:
                params[name] = jnp.asarray(array).astype(dtype)
        params.update(_kv_cache_scales(files, read, specs, layout))
    finally:
        handles.clear()
    return params


# A checkpoint's scales for an 8-bit KV cache, per layer (the cache holds k / k_scale): compressed-tensors' and
# vLLM's `self_attn.k_scale` / `v_scale`, AutoFP8's `k_proj.output_scale` / `v_proj.output_scale`, and the older
# `self_attn.kv_scale` for both.
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\."
                       r"(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)")


def _kv_cache_scales(files: dict[str, str], read, specs: dict[str, WeightSpec], layout) -> dict[str, jax.Array]:
    """`layers.<i>.kv_cache_scales` (f32 `[2]`: K's scale, V's) for every layer, where the checkpoint has such
    scales (a layer without them gets 1, as in vLLM); none where it has none. The model uses them with an 8-bit
    cache only."""
    layers = {int(name.split(".")[1]) for name in specs if name.startswith("layers.")}
    found: dict[int, list[float]] = {}
    for hf_name in sorted(files):
        match = _KV_SCALE.fullmatch(hf_name)
        if match is None or int(match[1]) not in layers:
            continue
        value = _positive_scalar(read(hf_name, f"layers.{match[1]}.{KV_CACHE_SCALES}"), f"KV cache scale {hf_name!r}")
        pair = found.setdefault(int(match[1]), [1.0, 1.0])
        for which in {"k": (0,), "v": (1,), "kv": (0, 1)}[match[2].split("_")[0]]:
            pair[which] = value
    if not found:
        return {}
    return {f"layers.{i}.{KV_CACHE_SCALES}": jax.device_put(np.asarray(found.get(i, [1.0, 1.0]), np.float32),
                                                           _everywhere(layout)) for i in sorted(layers)}


def _input_scale(read, name: str, weights: list[str], layout) -> jax.Array:
    """A layer's static activation scale (f32 `[]`, on every device): the largest of its parts' `input_scale`s
    (fused q/k/v or gate/up read the same input; vLLM takes the largest too)."""
    names = [weight.removesuffix(".weight") + ".input_scale" for weight in weights]
    values = [_positive_scalar(read(hf_name, f"{name}'s static input activations"), f"input scale {hf_name!r}")
              for hf_name in names]
    return jax.device_put(np.float32(max(values)), _everywhere(layout))


def _positive_scalar(value: np.ndarray, what: str) -> float:
    """A checkpoint's scale tensor as one float; a ValueError naming it unless it holds one finite positive number."""
    if value.size != 1 or not np.isfinite(value).all() or float(value.reshape(())) <= 0:
        raise ValueError(f"{what} must be one positive number, got {value.tolist()!r}")
    return float(value.reshape(()))


def _everywhere(layout):
    """Where a small param every device reads goes: the default device, or every device of the mesh."""
    return None if layout is None else NamedSharding(layout.mesh, PartitionSpec())


def _fp8_source(values: np.ndarray, scale: np.ndarray, hf_name: str, block, on_host: bool = True):
    """A checkpoint's 8-bit weight `[out, in]` and its scale tensor as values and one f32 scale per output channel:
    from `[out]`/`[out, 1]` (per channel), `[]`/`[1]` (per tensor), or one per `block` tile (folded on the default
    device, and brought back only `on_host`)."""
    rows = values.shape[0]
    if block is not None:
        try:
            folded = fp8_from_blocks(values, scale, block)
            return tuple(np.asarray(x) for x in folded) if on_host else folded
        except ValueError as e:
            raise ValueError(f"scale tensor {hf_name!r}: {e}") from None
    if scale.size == 1:
        return values, np.full(rows, np.float32(scale.reshape(())), np.float32)
    if scale.shape in ((rows,), (rows, 1)):
        return values, scale.reshape(rows).astype(np.float32)
    raise ValueError(f"scale tensor {hf_name!r} has shape {tuple(scale.shape)}: config.json's quantization_config "
                     f"implies per-channel ([{rows}] or [{rows}, 1]) or per-tensor scales")


def _fp8_param(name: str, values: np.ndarray, scales: np.ndarray, layout) -> dict[str, jax.Array]:
    """A quantized weight's values `[out, in]` and scales `[out]` as params: on one device, or permuted into the
    TP layout (the weight's output columns, here rows) and split as `quantization.fp8_weight` splits them."""
    if layout is None:
        return {name: jnp.asarray(values), scale_name(name): jnp.asarray(scales)}
    parts = layout.parts(name)
    if parts:
        values = to_tp_layout(values.T, parts, layout.tp, layout.cfg.head_dim).T
        scales = to_tp_layout(scales[None], parts, layout.tp, layout.cfg.head_dim)[0]
    put = lambda x, where: jax.make_array_from_callback(  # noqa: E731
        x.shape, where, lambda index: np.ascontiguousarray(x[index]))
    on_values, on_scales = fp8_shardings(layout.sharding(name))
    return {name: put(values, on_values), scale_name(name): put(scales, on_scales)}


class _Tensors:
    """One safetensors file's tensors as numpy arrays. 8-bit float tensors are read here from the file's header
    and bytes (safetensors' numpy reader looks their dtypes up in numpy, which has none); the rest by
    safetensors."""

    _FP8 = {"F8_E4M3": FP8_DTYPE}

    def __init__(self, path: str):
        self.path = path
        self.handle = safe_open(path, framework="numpy")
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            self.header, self.start = json.loads(f.read(size)), 8 + size

    def get(self, name: str, model_dir: str) -> np.ndarray:
        info = self.header.get(name)
        if info is None:  # a wrong sharded index; safetensors would raise its own error
            raise ValueError(f"{_INDEX} in {model_dir!r} maps tensor {name!r} to {os.path.basename(self.path)}, "
                             "which does not hold it")
        if info["dtype"] not in self._FP8:
            if info["dtype"].startswith("F8"):
                raise ValueError(f"tensor {name!r} is {info['dtype']}: jengine reads 8-bit weights as e4m3 (F8_E4M3)")
            return self.handle.get_tensor(name)
        begin, end = info["data_offsets"]
        dtype = np.dtype(self._FP8[info["dtype"]])
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r} in {self.path!r}: {end - begin} bytes for shape {info['shape']}")
        return np.fromfile(self.path, dtype=dtype, count=count, offset=self.start + begin).reshape(info["shape"])


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


def load_orbax(path: str, specs: dict[str, WeightSpec], dtype: str,
               layout: TensorParallelLayout | None = None) -> dict[str, jax.Array]:
    """Restore params written by `save_orbax`, checked against the specs' shapes, cast to `dtype`.

    Under TP each device reads only its shards; fused weights (stored in the checkpoint's order) are
    read split by rows, then permuted into the TP layout on the devices."""
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
        target = {name: jax.ShapeDtypeStruct(spec.shape, tree[name].dtype,
                                             sharding=_orbax_sharding(layout, name, spec))
                  for name, spec in specs.items()}
        # the KV cache's scales, where the converted checkpoint had them: f32, on every device
        scales = {name: jax.ShapeDtypeStruct((2,), jnp.float32, sharding=_everywhere(layout))
                  for name in stored if name.endswith("." + KV_CACHE_SCALES)}
        restored = ckptr.restore(path, {**target, **scales})
    params = {name: jnp.asarray(restored.pop(name)) for name in scales}
    for name, value in restored.items():
        parts = None if layout is None else layout.parts(name)
        if parts:
            relayout = functools.partial(to_tp_layout, parts=parts, tp=layout.tp, head_dim=layout.cfg.head_dim, xp=jnp)
            value = jax.jit(relayout, out_shardings=layout.sharding(name))(value)
        params[name] = jnp.asarray(value).astype(dtype)
    return params


def _orbax_sharding(layout: TensorParallelLayout | None, name: str, spec: WeightSpec):
    if layout is None:
        return None
    if not layout.parts(name):
        return layout.sharding(name)
    rows = TP if len(spec.shape) == 2 and spec.shape[0] % layout.tp == 0 else None
    return NamedSharding(layout.mesh, PartitionSpec(rows))


def convert_to_orbax(model: str, out_dir: str, dtype: str | None = None, load_format: str = "auto") -> str:
    """`jengine convert`: load a model and write it as an Orbax checkpoint plus its config/tokenizer files."""
    model_dir, _ = resolve_model(model)
    if checkpoint_quantization(read_config_json(model_dir).get("quantization_config")):
        raise ValueError(f"{model!r} is a pre-quantized checkpoint: jengine loads it from its safetensors files "
                         "and does not convert it to Orbax")
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
