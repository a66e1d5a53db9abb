"""Weight quantization at load time: vLLM's `quantization="fp8"` for an unquantized checkpoint. (A checkpoint
already quantized to fp8 loads into the same params: `jengine.loader`, `config.checkpoint_quantization`.)

Each linear layer's weight `[in, out]` becomes 8-bit floats (e4m3) with one f32 scale per output column,
`scale = max |w[:, j]| / 448` (448: e4m3's largest finite value), stored transposed (`[out, in]`, each column's
values contiguous: the operand layout of cuBLASLt's 8-bit GEMMs, and the faster one for XLA's Triton GEMMs at
batch 1) with its scales beside it as `<name>_scale`. The weights take half the memory and half the bytes a
decode step streams. The embedding and the LM head stay in the model's dtype, as in vLLM.

`fp8_linear` quantizes each row of x too (e4m3, a dynamic scale per token, as vLLM's fp8 does on Hopper; a
pre-quantized checkpoint with static activation scales gives one per layer instead, `fp8_static`) and
multiplies two 8-bit operands: cuBLASLt's fp8 GEMM or a Triton one, as XLA picks (on an H100 10-33% less time than
bf16 from 256 rows; RESULTS.md, session 38). A
token's rounding depends on its own row only, so quantizing adds no dependence on the batch (the buckets' GEMMs
still sum in orders of their own). Under tensor parallelism the values keep their weight's split and the scales
follow the output columns; a row-parallel GEMM's x rows take their largest values across the shards. Converting
only the weight and keeping x in 16 bits was 0.4 ms a step faster at batch 1 on an H100 (no pass over x before
each GEMM), but mixing the two by step size made greedy outputs depend on the batch (RESULTS.md, session 38).

Per-column scales keep a column's large weights from flattening its small ones (e4m3 keeps 3 mantissa bits,
so a weight is off by at most 1/16 of its own size, or of its column's largest / 2^9 near zero).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

QUANTIZATIONS = ("fp8",)
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
SCALE_SUFFIX = "_scale"
INPUT_SCALE_SUFFIX = "_input_scale"  # a pre-quantized checkpoint's static activation scale (f32 [])
_NK = (((1,), (1,)), ((), ()))  # x [T, K] times w [N, K]: contract both K axes


def check_quantization(value) -> None:
    """A ValueError naming the parameter unless `value` is None or a supported method."""
    if value is not None and (not isinstance(value, str) or value not in QUANTIZATIONS):
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {value!r}")


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def input_scale_name(name: str) -> str:
    return name + INPUT_SCALE_SUFFIX


def linear_weights(specs: dict) -> list[str]:
    """Names of the linear layers' weights among a family's `weight_specs` (transposed 2-D HF Linear
    weights), less the LM head."""
    return [name for name, spec in specs.items()
            if spec.transpose and len(spec.shape) == 2 and name != "lm_head"]


def fp8_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`w [in, out]` as (e4m3 values transposed [out, in], f32 scales [out]) with `w ~ (values * scales[:, None]).T`.
    A weight split over a mesh keeps its split: the values' axes swap with the weight's, and the scales follow
    the output columns (split with a column-parallel weight's columns, whole beside a row-parallel one)."""
    sharding = getattr(w, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return jax.jit(_fp8_values)(w)
    return jax.jit(_fp8_values, out_shardings=fp8_shardings(sharding))(w)


def fp8_shardings(sharding: NamedSharding) -> tuple[NamedSharding, NamedSharding]:
    """Where a weight split as `sharding` (`[in, out]`) puts its 8-bit values `[out, in]` (the axes swapped) and its
    scales `[out]` (the output columns' split)."""
    rows, cols = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(cols, rows)), NamedSharding(sharding.mesh, PartitionSpec(cols))


def _fp8_values(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _fp8_per_row(w.astype(jnp.float32).T)


def _fp8_per_row(wf: jax.Array, scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """f32 `[rows, K]` as e4m3 values and one f32 scale per row (by default each row's largest value / 448)."""
    if scale is None:
        scale = jnp.max(jnp.abs(wf), axis=1) / FP8_MAX
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero row keeps zeros, not NaNs
    return jnp.clip(wf / scale[:, None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), scale


def fp8_from_blocks(values, scales, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """A block-quantized weight (e4m3 `values [out, in]`, f32 `scales` with one per `block` = (rows, columns) tile,
    `w = values * scales` tile by tile; the last tiles may be cut short) in `fp8_weight`'s form: each output row
    rounded again to e4m3 at one scale of its own, its largest value at 448. Where that largest value is 448 times
    its tile's scale (the usual case for the row holding a tile's largest value), the row's tiles of that scale
    keep their values exactly; the rest are rounded once more, by at most half an e4m3 step."""
    rows, cols = values.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scales.shape) != grid:
        raise ValueError(f"block scales of shape {tuple(scales.shape)} for a [{rows}, {cols}] weight in {block[0]}x"
                         f"{block[1]} blocks: expected {grid}")
    return _blocks_per_row(jnp.asarray(values), jnp.asarray(scales, jnp.float32), tuple(block))


@functools.partial(jax.jit, static_argnames="block")
def _blocks_per_row(values: jax.Array, scales: jax.Array, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    rows, cols = values.shape
    per_value = jnp.abs(jnp.repeat(jnp.repeat(scales, block[0], axis=0)[:rows], block[1], axis=1)[:, :cols])
    q = values.astype(jnp.float32)
    # (|q| / 448) * scale, not |q * scale| / 448: a tile's scale comes back exactly where its value is 448
    return _fp8_per_row(q * per_value, jnp.max(jnp.abs(q) / FP8_MAX * per_value, axis=1))


def fp8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x [T, K]` as (e4m3 values [T, K], f32 scales [T, 1]): each row scaled so its largest value is 448."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (xf / scale).astype(FP8_DTYPE), scale


def fp8_static(x: jax.Array, input_scale: jax.Array) -> jax.Array:
    """`x` as e4m3 values at one static scale (a checkpoint's `input_scale`), saturated at ±448 as vLLM does."""
    return jnp.clip(x.astype(jnp.float32) / input_scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def fp8_linear(x: jax.Array, q: jax.Array, scale: jax.Array, input_scale: jax.Array | None = None) -> jax.Array:
    """`x [T, K] @ w` for a weight quantized by `fp8_weight` (q `[N, K]`, scale `[N]`), in x's dtype: x quantized
    (each row at its own scale, `fp8_rows`; or all at a checkpoint's static `input_scale`, `fp8_static`), the 8-bit
    product summed in f32 and rounded to x's dtype, then both scales applied."""
    if input_scale is None:
        xq, x_scale = fp8_rows(x)
    else:
        xq, x_scale = fp8_static(x, input_scale), input_scale
    y = jax.lax.dot_general(xq, q, _NK, preferred_element_type=x.dtype)
    return (y.astype(jnp.float32) * x_scale * scale).astype(x.dtype)


def quantize(params: dict, names: list[str], method: str) -> dict:
    """`params` with each of `names` quantized by `method` (its scale added as `scale_name(name)`). Each
    original weight is deleted once quantized, so the weights' memory peaks at the unquantized size.

    The deleted weights leave holes between the quantized ones in the device allocator's pool, each too
    small for a large temporary: on an H100 the 8B engine's first sampling program then ran out of memory
    for 1.9 GiB (RESULTS.md, session 37). So the params then go to the host and back, onto one stretch of
    memory."""
    check_quantization(method)
    out = dict(params)
    for name in names:
        w = out.pop(name)
        out[name], out[scale_name(name)] = fp8_weight(w)
        if isinstance(w, jax.Array):
            w.delete()
    return _compacted(out)


def _compacted(params: dict) -> dict:
    """The same params, placed again (same shardings) after every device buffer of them was freed. Params
    spread over several hosts stay where they are (this host cannot read the others' shards)."""
    arrays = {name: x for name, x in params.items() if isinstance(x, jax.Array)}
    if not all(x.is_fully_addressable for x in arrays.values()):
        return params
    shardings = {name: x.sharding for name, x in arrays.items()}
    host = jax.device_get(arrays)
    for x in arrays.values():
        x.delete()
    return {**params, **{name: jax.device_put(host[name], shardings[name]) for name in arrays}}


def is_quantized(params: dict) -> bool:
    return any(name.endswith(SCALE_SUFFIX) for name in params)


__all__ = ["FP8_DTYPE", "QUANTIZATIONS", "check_quantization", "fp8_from_blocks", "fp8_shardings", "fp8_linear",
           "fp8_rows", "fp8_static", "fp8_weight", "input_scale_name", "is_quantized", "linear_weights", "quantize",
           "scale_name"]
