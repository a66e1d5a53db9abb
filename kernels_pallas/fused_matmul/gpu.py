"""Small-batch (decode) matmuls with their neighbours fused in, for NVIDIA GPUs: Pallas, Triton lowering.

At decode a layer's matmuls read megabytes of weights for a handful of token rows, so they are bound by
weight bandwidth; what XLA adds around them (the RMS norm's reduction, the reduction of split-K partial
sums plus the residual add, SiLU(gate) * up) are separate kernels of 1.5-3 us each, ~15 us per layer.
Here one program owns `block_n` output columns of all M rows and walks the full K dimension, so no
partial sums leave the program and the epilogue is applied in registers:

- RMS norm: the row scale rsqrt(mean(x^2) + eps) commutes with the matmul, so the program accumulates
  (x * g) @ W and x^2 in the same K loop and scales the rows at the end (no extra pass over x).
- SwiGLU: the program reads the gate columns and the matching up columns of the fused [K, 2N] weight
  (two block specs over one array) and writes SiLU(gate) * up.
- Residual: `residual + x @ W` in the epilogue.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    block_n: int  # output columns per program
    block_k: int  # K per loop step
    num_warps: int
    num_stages: int


# Tuning table, measured on an H200 (benchmarks/RESULTS.md): settings per op kind. The grid has
# N / block_n programs, which must cover the SMs, so block_n is small and the K loop long.
TUNED = {
    "norm": GpuConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),
    "swiglu": GpuConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),
    "add": GpuConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),
}


def _pow2(v: int) -> bool:
    return v >= 16 and v & (v - 1) == 0


def fits(config: GpuConfig, m: int, k: int, n_out: int) -> bool:
    """Whether the kernel handles these shapes with this tile (Triton tiles are powers of two >= 16)."""
    return (_pow2(m) and _pow2(config.block_n) and _pow2(config.block_k) and k % config.block_k == 0
            and n_out % config.block_n == 0)


def tuned_config(kind: str, k: int, n_out: int) -> GpuConfig:
    """The table's tile for `kind`, its blocks shrunk (halved) until they divide K and N (small models)."""
    t = TUNED[kind]
    block_n, block_k = t.block_n, t.block_k
    while block_n > 16 and n_out % block_n:
        block_n //= 2
    while block_k > 16 and k % block_k:
        block_k //= 2
    return dataclasses.replace(t, block_n=block_n, block_k=block_k)


def _kernel(*refs, norm: bool, swiglu: bool, residual: bool, block_k: int, eps: float):
    refs = list(refs)
    x_ref = refs.pop(0)  # [M, K]
    g_ref = refs.pop(0) if norm else None  # [K]
    w_refs = [refs.pop(0) for _ in range(2 if swiglu else 1)]  # [K, block_n] each
    r_ref = refs.pop(0) if residual else None  # [M, block_n]
    (o_ref,) = refs  # [M, block_n]
    m, k_dim = x_ref.shape
    f32 = x_ref.dtype == jnp.float32

    def step(i, carry):
        accs, sq = carry
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        xk = x_ref[:, ks]  # [M, block_k]
        if norm:  # elementwise here, reduced after the loop: a row reduction per step stalls the pipeline
            xf = xk.astype(jnp.float32)
            sq = sq + xf * xf
            xk = (xk * g_ref[ks][None, :]).astype(x_ref.dtype)
        accs = tuple(acc + plgpu.dot(xk, w[ks, :], allow_tf32=not f32) for acc, w in zip(accs, w_refs))
        return accs, sq

    zeros = jnp.zeros(o_ref.shape, jnp.float32)
    accs, sq = jax.lax.fori_loop(0, k_dim // block_k, step,
                                 ((zeros,) * len(w_refs), jnp.zeros((m, block_k) if norm else (m,), jnp.float32)))
    if norm:
        scale = jax.lax.rsqrt(jnp.sum(sq, axis=1) / k_dim + eps)[:, None]
        accs = tuple(acc * scale for acc in accs)
    y = accs[0]
    if swiglu:
        y = y / (1.0 + jnp.exp(-y)) * accs[1]
    if residual:
        y = y + r_ref[...].astype(jnp.float32)
    o_ref[...] = y.astype(o_ref.dtype)


def fused_matmul_gpu(x, w, *, norm_w=None, eps: float = 0.0, swiglu: bool = False, residual=None,
                     config: GpuConfig, interpret: bool = False):
    """`[M, K] @ [K, N]` with the optional norm / SwiGLU / residual epilogues; inputs assumed validated."""
    m, k = x.shape
    n = w.shape[1]
    n_out = n // 2 if swiglu else n
    bn = config.block_n
    half = n_out // bn  # block offset of the up columns

    inputs = [x]
    in_specs = [pl.BlockSpec((m, k), lambda j: (0, 0))]
    if norm_w is not None:
        inputs.append(norm_w)
        in_specs.append(pl.BlockSpec((k,), lambda j: (0,)))
    inputs.append(w)
    in_specs.append(pl.BlockSpec((k, bn), lambda j: (0, j)))
    if swiglu:
        inputs.append(w)
        in_specs.append(pl.BlockSpec((k, bn), lambda j: (0, j + half)))
    if residual is not None:
        inputs.append(residual)
        in_specs.append(pl.BlockSpec((m, bn), lambda j: (0, j)))
    kernel = functools.partial(_kernel, norm=norm_w is not None, swiglu=swiglu, residual=residual is not None,
                               block_k=config.block_k, eps=float(eps))
    return pl.pallas_call(
        kernel,
        grid=(n_out // bn,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((m, bn), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n_out), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="fused_matmul",
    )(*inputs)
