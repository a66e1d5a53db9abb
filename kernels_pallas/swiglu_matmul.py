"""The gated MLP's first half as one GEMM: `silu(x @ W_gate) * (x @ W_up)` from the fused `[K, 2 I]`
gate/up weight (gate columns first, as `models.llama` stores it on one device), writing `[M, I]`.

XLA runs this as a cuBLAS GEMM writing `[M, 2 I]` and then an elementwise pass that reads it back (at
2048 tokens of the 8B model: 596 + 45 µs per layer on an H200). Here each output tile accumulates its
gate and up columns side by side in registers and the product is formed in the epilogue, so the
`[M, 2 I]` intermediate never exists.

Hopper only (Pallas Mosaic GPU, wgmma): a persistent kernel, one program per SM walking the output
tiles; one memory warpgroup streams [rows, tile_k] slices of x and [tile_k, tile_n] slices of the
gate and up weights through a `stages`-deep ring in shared memory while two compute warpgroups, each
owning `tile_m` rows of a 2 x tile_m-row tile, issue two wgmmas per slice (gate and up accumulators,
f32). `reference` is the same function in jnp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Steps with at least this many token rows use the kernel on Hopper; smaller ones keep XLA's GEMM and
# product (a 2 x tile_m-row tile would be mostly padding).
MIN_TOKENS = 256
_WARPGROUPS = 2  # compute warpgroups per program, side by side in M


@dataclasses.dataclass(frozen=True)
class SwigluConfig:
    """Tiling: `tile_m` rows per compute warpgroup (a program's tile has 2 x tile_m rows), `tile_n`
    output columns (and as many gate and up columns), `tile_k` of the contraction per pipeline step,
    `stages` steps in flight, and `snake` output-tile columns walked together (all rows of a column
    before the next, so that the weight slices are read once while x stays in L2). With
    `delay_release` 1 a compute warpgroup leaves one step's wgmmas running while it issues the next
    (each slot is released a step later); `approx_math` lets the epilogue's exp use the fast
    approximation."""

    tile_m: int = 64
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    snake: int = 1
    delay_release: int = 0
    approx_math: bool = True

    def __post_init__(self):
        for name in ("tile_m", "tile_n", "tile_k", "stages", "snake"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SwigluConfig: `{name}` must be a positive int, got {value!r}")
        if self.delay_release not in (0, 1) or isinstance(self.delay_release, bool) or \
                self.delay_release >= self.stages:
            raise ValueError(f"SwigluConfig: `delay_release` must be 0 or 1 and below `stages` ({self.stages}), "
                             f"got {self.delay_release!r}")
        if not isinstance(self.approx_math, bool):
            raise ValueError(f"SwigluConfig: `approx_math` must be a bool, got {self.approx_math!r}")
        if self.tile_m % 64 or self.tile_n % 64 or self.tile_k % 64:
            raise ValueError(f"SwigluConfig: tiles must be multiples of 64 (wgmma rows, 128-byte swizzle), got "
                             f"tile_m={self.tile_m}, tile_n={self.tile_n}, tile_k={self.tile_k}")
        if 2 * self.tile_m * self.tile_n > 128 * 128:
            raise ValueError(f"SwigluConfig: two f32 accumulators of {self.tile_m} x {self.tile_n} exceed a "
                             "warpgroup's registers (tile_m * tile_n must be at most 8192)")


def reference(x: jax.Array, w_gate_up: jax.Array) -> jax.Array:
    """`silu(gate) * up` of `x @ w_gate_up`, the product in f32 from f32 GEMM results, in x's dtype."""
    h = jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32)
    gate, up = jnp.split(h, 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def supports(x_shape, w_shape, dtype, config: SwigluConfig = SwigluConfig()) -> bool:
    """Whether the kernel handles these shapes: 16-bit floats, rows in whole 2 x tile_m tiles, the
    intermediate size in whole tile_n tiles, the contraction in whole tile_k slices."""
    (m, k), (k2, n2) = x_shape, w_shape
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and k == k2 and n2 % 2 == 0
            and m % (_WARPGROUPS * config.tile_m) == 0 and (n2 // 2) % config.tile_n == 0
            and k % config.tile_k == 0)


def use_kernel(x: jax.Array, w_gate_up: jax.Array) -> bool:
    """The model's choice for these operands (arrays or tracers): on a Hopper GPU, for steps of
    `MIN_TOKENS` or more that the kernel supports, with x and the weight of one dtype."""
    from .ragged_paged_attention.gpu_mosaic import on_hopper

    return (x.ndim == 2 and x.shape[0] >= MIN_TOKENS and x.dtype == w_gate_up.dtype
            and supports(x.shape, w_gate_up.shape, x.dtype) and on_hopper())


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", 132)


def swiglu_matmul(x: jax.Array, w_gate_up: jax.Array, config: SwigluConfig | None = None) -> jax.Array:
    """`reference(x, w_gate_up)` as one Mosaic GPU kernel (Hopper). x `[M, K]`, w `[K, 2 I]` -> `[M, I]`."""
    config = config or SwigluConfig()
    if x.ndim != 2 or w_gate_up.ndim != 2 or x.dtype != w_gate_up.dtype:
        raise ValueError(f"swiglu_matmul: `x` [M, K] and `w_gate_up` [K, 2 I] must be 2-D of one dtype, got "
                         f"{x.dtype}{list(x.shape)} and {w_gate_up.dtype}{list(w_gate_up.shape)}")
    if not supports(x.shape, w_gate_up.shape, x.dtype, config):
        raise ValueError(f"swiglu_matmul: shapes x {x.shape}, w_gate_up {w_gate_up.shape} ({x.dtype}) do not "
                         f"divide into {config} (rows by {_WARPGROUPS * config.tile_m}, I by tile_n, K by "
                         "tile_k; 16-bit floats)")
    m, _ = x.shape
    inter = w_gate_up.shape[1] // 2
    kernel = plgpu.kernel(
        functools.partial(_kernel, config=config),
        out_type=jax.ShapeDtypeStruct((m, inter), x.dtype),
        grid=(_num_sms(),), grid_names=("sm",), num_threads=_WARPGROUPS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             approx_math=config.approx_math),
    )
    return kernel(x, w_gate_up)


def _kernel(x_gmem, w_gmem, out_gmem, *, config: SwigluConfig):
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    rows = _WARPGROUPS * tile_m  # a program's output tile: rows x tile_n
    m, k = x_gmem.shape
    inter = out_gmem.shape[1]
    dtype = x_gmem.dtype
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    operand = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(tile_n * jnp.dtype(dtype).itemsize * 8)
    out_layout = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(dtype).itemsize)),
                  plgpu.SwizzleTransform(out_swizzle))
    m_tiles, n_tiles = m // rows, inter // tile_n

    def pipeline(body, compute_context):
        spec = functools.partial(plgpu.BlockSpec, transforms=operand, memory_space=plgpu.SMEM,
                                 delay_release=config.delay_release)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // tile_k,), memory_registers=40,
            in_specs=[spec((rows, tile_k), lambda s: (0, s)), spec((tile_k, tile_n), lambda s: (s, 0)),
                      spec((tile_k, tile_n), lambda s: (s, 0))],
            wg_axis="wg", num_compute_wgs=_WARPGROUPS, max_concurrent_steps=config.stages,
            compute_context=compute_context)

    def no_op(*_, **__):
        return None

    @functools.partial(pl.run_scoped,
                       allocations=pipeline(no_op, no_op).get_allocations(x_gmem, w_gmem, w_gmem),
                       out_smem=plgpu.SMEM((_WARPGROUPS, tile_m, tile_n), dtype, transforms=out_layout),
                       collective_axes="wg")
    def _scope(allocations, out_smem):
        wg = jax.lax.axis_index("wg")

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tiles(loop):
            (index,) = loop.index
            mi, ni = plgpu.planar_snake(index, (m_tiles, n_tiles), 1, config.snake)
            my_rows = pl.ds(mi * rows + wg * tile_m, tile_m)
            cols = pl.ds(ni * tile_n, tile_n)

            def step(_, x_smem, gate_smem, up_smem, accs):
                acc_gate, acc_up = accs
                plgpu.wgmma(acc_gate, x_smem.at[pl.ds(wg * tile_m, tile_m)], gate_smem)
                plgpu.wgmma(acc_up, x_smem.at[pl.ds(wg * tile_m, tile_m)], up_smem)
                plgpu.wgmma_wait(2 * config.delay_release)  # two wgmma groups per step
                return accs

            def compute(run):
                @functools.partial(pl.run_scoped, acc_gate=plgpu.ACC((tile_m, tile_n), jnp.float32),
                                   acc_up=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _accumulate(acc_gate, acc_up):
                    run((acc_gate, acc_up))
                    plgpu.wgmma_wait(0)
                    gate, up = acc_gate[...], acc_up[...]
                    product = gate * up / (1.0 + jnp.exp(-gate))  # silu(gate) * up, in f32
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read it
                    out_smem[wg] = product.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[my_rows, cols])

            pipeline(step, compute)(
                x_gmem.at[pl.ds(mi * rows, rows), :], w_gmem.at[:, cols],
                w_gmem.at[:, pl.ds(inter + ni * tile_n, tile_n)], allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store, before the memory is freed
