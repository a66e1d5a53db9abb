"""`x @ W` for steps of at most 64 token rows (decode at small batch), where the GEMM only streams W.

At 16 rows XLA runs the 8B model's QKV / O / down projections as split-K Triton GEMMs whose f32 partial
sums a second kernel reduces, at 3.3-4.0 TB/s of weight reads (session 8's profile); the gate/up GEMM
is followed by its own SwiGLU pass. Here one Mosaic GPU program per output tile (and K slice) streams its
`[K, tile_n]` weight columns through a `stages`-deep ring in shared memory with TMA, while one compute
warpgroup runs wgmmas against the step's rows (padded to the 64 rows a wgmma takes: compute is free at
this size, the weight bytes are the cost).

- `split_k` > 1 divides K between programs, so that a projection with few output tiles (N = 4096 is 64
  tiles of 64) still keeps every SM streaming; the programs write f32 partial sums `[split_k, M, N]`
  and the caller's next elementwise pass (XLA) sums them.
- `swiglu` takes the fused `[K, 2 I]` gate/up weight (gate columns first) and writes
  `silu(gate) * up` `[M, I]`, both accumulated side by side, the product in f32 in the epilogue.

Hopper only. `reference` is the same function in jnp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # a wgmma's rows: the step's rows are padded to this
SMEM_BYTES = 227 * 1024  # shared memory a Hopper block may opt in to


@dataclasses.dataclass(frozen=True)
class DecodeMatmulConfig:
    """`tile_n` output columns per program (as many gate and up columns with `swiglu`), `tile_k` of
    the contraction per pipeline step, `stages` steps in flight, `split_k` programs per column tile."""

    tile_n: int = 64
    tile_k: int = 128
    stages: int = 4
    split_k: int = 1

    def __post_init__(self):
        for name in ("tile_n", "tile_k", "stages", "split_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DecodeMatmulConfig: `{name}` must be a positive int, got {value!r}")
        if self.tile_n % 64 or self.tile_k % 64:
            raise ValueError(f"DecodeMatmulConfig: `tile_n` and `tile_k` must be multiples of 64 (128-byte "
                             f"swizzle), got tile_n={self.tile_n}, tile_k={self.tile_k}")
        if self.tile_n > 256:
            raise ValueError(f"DecodeMatmulConfig: `tile_n` must be at most 256 (a wgmma's width), got {self.tile_n}")


def reference(x: jax.Array, w: jax.Array, swiglu: bool = False) -> jax.Array:
    """`x @ w` (or `silu(gate) * up` of it, the product in f32), in x's dtype."""
    h = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if swiglu:
        gate, up = jnp.split(h, 2, axis=-1)
        h = jax.nn.silu(gate) * up
    return h.astype(x.dtype)


def smem_bytes(config: DecodeMatmulConfig, swiglu: bool = False) -> int:
    """Shared memory the kernel takes: the ring of x and weight slices (16-bit) and the output tile."""
    weights = 2 if swiglu else 1
    ring = config.stages * (ROWS * config.tile_k + weights * config.tile_k * config.tile_n) * 2
    return ring + ROWS * config.tile_n * (4 if config.split_k > 1 else 2)


def supports(x_shape, w_shape, dtype, config: DecodeMatmulConfig, swiglu: bool = False) -> bool:
    """Whether the kernel handles these shapes: 16-bit floats, at most `ROWS` rows, the output columns
    in whole tiles, each program's K slice in whole `tile_k` steps, the ring within shared memory;
    `swiglu` takes no `split_k`."""
    (m, k), (k2, n) = x_shape, w_shape
    cols = n // 2 if swiglu else n
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and k == k2 and 1 <= m <= ROWS
            and (not swiglu or (n % 2 == 0 and config.split_k == 1)) and cols % config.tile_n == 0
            and k % (config.split_k * config.tile_k) == 0 and smem_bytes(config, swiglu) <= SMEM_BYTES)


def config_for(k: int, n: int, swiglu: bool = False, num_sms: int = 132) -> DecodeMatmulConfig:
    """The tiling the model uses for a `[K, N]` weight: gate/up in 128-column tiles (both halves in
    shared memory); other projections in 64-column tiles, K split so that the programs fill the SMs in
    one wave where that is possible."""
    if swiglu:
        return DecodeMatmulConfig(tile_n=128, tile_k=64, stages=4)
    tiles = max(n // 64, 1)
    split = 1
    while tiles * split * 2 <= num_sms and k % (split * 2 * 128) == 0:
        split *= 2
    return DecodeMatmulConfig(tile_n=64, tile_k=128, stages=4, split_k=split)


def use_kernel(x: jax.Array, w: jax.Array, swiglu: bool = False) -> bool:
    """The model's choice for these operands (arrays or tracers): on a Hopper GPU, for steps of at most
    `ROWS` rows that the kernel supports at `config_for`'s tiling, with x and w of one dtype."""
    from .ragged_paged_attention.gpu_mosaic import on_hopper

    return (x.ndim == 2 and w.ndim == 2 and x.shape[0] <= ROWS and x.dtype == w.dtype
            and supports(x.shape, w.shape, x.dtype, config_for(*w.shape, swiglu, _num_sms()), swiglu)
            and on_hopper())


def use_gated_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> bool:
    """`use_kernel` for both of `gated_mlp`'s calls."""
    h = jax.ShapeDtypeStruct((x.shape[0], w_down.shape[0]), x.dtype)
    return use_kernel(x, w_gate_up, swiglu=True) and use_kernel(h, w_down) and 2 * w_down.shape[0] == w_gate_up.shape[1]


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` in x's dtype at `config_for`'s tiling (split-K partial sums added in f32)."""
    config = config_for(*w.shape, num_sms=_num_sms())
    out = decode_matmul(x, w, config)
    return out.sum(0).astype(x.dtype) if config.split_k > 1 else out


def gated_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """`(silu(x @ W_gate) * (x @ W_up)) @ W_down`: two kernel calls, the padded rows kept between them."""
    m = x.shape[0]
    padded = _pad(x)
    h = _call(padded, w_gate_up, config_for(*w_gate_up.shape, True, _num_sms()), True)
    config = config_for(*w_down.shape, num_sms=_num_sms())
    out = _call(h, w_down, config, False)
    return out[:, :m].sum(0).astype(x.dtype) if config.split_k > 1 else out[:m]


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", 132)


def _pad(x: jax.Array) -> jax.Array:
    return jnp.pad(x, ((0, ROWS - x.shape[0]), (0, 0))) if x.shape[0] < ROWS else x


def decode_matmul(x: jax.Array, w: jax.Array, config: DecodeMatmulConfig | None = None,
                  swiglu: bool = False) -> jax.Array:
    """x `[M, K]` (M <= 64), w `[K, N]` -> `x @ w` `[M, N]` in x's dtype, or with `config.split_k` > 1 the
    f32 partial sums `[split_k, M, N]` (their sum is the product); with `swiglu`, `[M, N / 2]`."""
    config = config or DecodeMatmulConfig()
    if x.ndim != 2 or w.ndim != 2 or x.dtype != w.dtype:
        raise ValueError(f"decode_matmul: `x` [M, K] and `w` [K, N] must be 2-D of one dtype, got "
                         f"{x.dtype}{list(x.shape)} and {w.dtype}{list(w.shape)}")
    if not supports(x.shape, w.shape, x.dtype, config, swiglu):
        raise ValueError(f"decode_matmul: shapes x {x.shape}, w {w.shape} ({x.dtype}, swiglu={swiglu}) do not "
                         f"fit {config} (at most {ROWS} rows, N by tile_n, K by split_k * tile_k, 16-bit floats, "
                         f"{smem_bytes(config, swiglu)} of {SMEM_BYTES} bytes of shared memory)")
    m = x.shape[0]
    out = _call(_pad(x), w, config, swiglu)
    return out[:, :m] if config.split_k > 1 else out[:m]


def _call(padded: jax.Array, w: jax.Array, config: DecodeMatmulConfig, swiglu: bool) -> jax.Array:
    """The kernel on `ROWS`-row operands (validated by the caller), the output's rows padded too."""
    cols = w.shape[1] // 2 if swiglu else w.shape[1]
    out_dtype = jnp.float32 if config.split_k > 1 else padded.dtype
    out_shape = (config.split_k, ROWS, cols) if config.split_k > 1 else (ROWS, cols)
    kernel = plgpu.kernel(
        functools.partial(_kernel, config=config, swiglu=swiglu),
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(cols // config.tile_n, config.split_k), grid_names=("n", "s"), num_threads=2, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             approx_math=True),
    )
    return kernel(padded, w)


def _layout(cols: int, dtype) -> tuple:
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(cols * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _kernel(x_gmem, w_gmem, out_gmem, *, config: DecodeMatmulConfig, swiglu: bool):
    tile_n, tile_k = config.tile_n, config.tile_k
    k = x_gmem.shape[1]
    k_slice = k // config.split_k
    cols_total = w_gmem.shape[1] // 2 if swiglu else w_gmem.shape[1]
    dtype = x_gmem.dtype
    ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("s")
    cols = pl.ds(ni * tile_n, tile_n)
    ks = pl.ds(si * k_slice, k_slice)
    weights = [w_gmem.at[ks, cols]] + ([w_gmem.at[ks, pl.ds(cols_total + ni * tile_n, tile_n)]] if swiglu else [])
    spec = functools.partial(plgpu.BlockSpec, transforms=_layout(tile_k, dtype), memory_space=plgpu.SMEM)
    out_layout = _layout(tile_n, out_gmem.dtype)
    out_ref = out_gmem.at[si] if config.split_k > 1 else out_gmem
    pipeline_args = (x_gmem.at[:, ks], *weights)

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_slice // tile_k,), memory_registers=40,
            in_specs=[spec((ROWS, tile_k), lambda s: (0, s))]
            + [spec((tile_k, tile_n), lambda s: (s, 0))] * len(weights),
            wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=config.stages, compute_context=compute_context)

    def no_op(*_, **__):
        return None

    @functools.partial(pl.run_scoped, allocations=pipeline(no_op, no_op).get_allocations(*pipeline_args),
                       out_smem=plgpu.SMEM((ROWS, tile_n), out_gmem.dtype, transforms=out_layout),
                       collective_axes="wg")
    def _scope(allocations, out_smem):
        def step(_, x_smem, *rest):
            *w_smems, accs = rest
            for acc, w_smem in zip(accs, w_smems):
                plgpu.wgmma(acc, x_smem, w_smem)
            plgpu.wgmma_wait(0)
            return accs

        def compute(run):
            shapes = {f"acc{i}": plgpu.ACC((ROWS, tile_n), jnp.float32) for i in range(len(weights))}

            @functools.partial(pl.run_scoped, **shapes)
            def _accumulate(**accs):
                accs = tuple(accs[f"acc{i}"] for i in range(len(weights)))
                run(accs)
                if swiglu:
                    gate, up = accs[0][...], accs[1][...]
                    value = gate * up / (1.0 + jnp.exp(-gate))  # silu(gate) * up, in f32
                else:
                    value = accs[0][...]
                out_smem[...] = value.astype(out_gmem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, out_ref.at[:, cols])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pipeline(step, compute)(*pipeline_args, allocations=allocations)
