"""GEMM benchmark: a model's projections at the engine's step sizes, through XLA (cuBLAS on GPUs) and,
on Hopper, through JAX's Pallas Mosaic GPU matmul (`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`);
plus the SwiGLU product `silu(gate) * up` that XLA runs as its own pass after the gate/up GEMM.

It answers two questions before a GEMM of our own is worth writing: how close a Pallas matmul gets to
cuBLAS on these shapes, and how much time an epilogue that absorbs the SwiGLU product could save.
Example (one H200):

    python benchmarks/gemm.py --m 1 256 2048 --timer cupti --output-json gemm.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re

import jax
import jax.numpy as jnp
from common import H200_BF16_FLOPS, bench, model_shape, positive_int, write_json
from kernels import cupti_us, rotated

from jengine.kernels_pallas import swiglu_matmul
from jengine.runner import CUBLAS_OPTIONS as CUBLAS  # what the engine compiles buckets of >= 64 tokens with

CUBLASLT = {**CUBLAS, "xla_gpu_enable_cublaslt": True}
TRITON_ONLY = {"xla_gpu_cublas_fallback": False}  # the autotuner keeps to its Triton GEMMs


SWIGLU_CONFIGS = [swiglu_matmul.SwigluConfig(), swiglu_matmul.SwigluConfig(approx_math=False),
                  swiglu_matmul.SwigluConfig(delay_release=1), swiglu_matmul.SwigluConfig(snake=2)]


def pallas_tiles(m: int) -> list[dict]:
    """TuningConfig fields to try at `m` rows: per-warpgroup tiles whose f32 accumulator fits the registers,
    the two warpgroups side by side in N or M, and (from 1024 rows) the order the persistent programs walk
    the output tiles in (grid_minor_dim, grid_tile_width: which tiles share operands in L2)."""
    tiles = [(128, 128, "N"), (64, 256, "M"), (128, 64, "N"), (128, 128, "M"), (64, 128, "M")]
    orders = [("N", 1), ("M", 1), ("N", 8), ("M", 8)] if m >= 1024 else [("N", 1)]
    return [dict(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4, wg_dimension=wg, grid_minor_dim=g,
                 grid_tile_width=w) for (tm, tn, wg), (g, w) in itertools.product(tiles, orders)]


def projections(model: str) -> dict[str, tuple[int, int]]:
    """(K, N) of each projection of a layer, with gate and up as one [K, 2 I] weight as the engine has it."""
    s = model_shape(model)
    hidden, inter = s["config"]["hidden_size"], s["config"]["intermediate_size"]
    return {"qkv": (hidden, (s["hq"] + 2 * s["hkv"]) * s["head_dim"]), "o": (s["hq"] * s["head_dim"], hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}


def pallas_matmul(tile: dict):
    """JAX's Hopper matmul with one tiling (`pallas_tiles`), or None where this JAX lacks it (a shape that
    does not divide into the tiles raises when called; the caller reports it)."""
    try:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    except ImportError:
        return None
    dims = {k: hm.MatmulDimension[v] for k, v in tile.items() if k in ("wg_dimension", "grid_minor_dim")}
    config = hm.TuningConfig(**{**tile, **dims})
    return lambda x, w: hm.matmul(x, w, None, config)


def tile_name(t: dict) -> str:
    return (f"pallas {t['tile_m']}x{t['tile_n']} wg{t['wg_dimension']} "
            f"{t['grid_minor_dim']}{t['grid_tile_width']}")


def fp8_impls(x, w):
    """fp8-weight variants of `x @ w`: (name, fn, args, XLA options). The weight is quantized per output
    column (`jengine.quantization.fp8_weight`, stored [N, K]); the engine's `fp8_linear` (W8A8) also quantizes
    each row of x and multiplies two 8-bit operands; W8A16 converts the weight to bf16 inside XLA's GEMM and
    leaves x as it is, from [N, K] or from [K, N] (the layout of session 37's engine)."""
    from jengine.quantization import fp8_linear, fp8_weight

    q, s = fp8_weight(w)
    kn = q.T.copy()

    def w8a16(x, q, s):
        return jax.lax.dot_general(x, q.astype(x.dtype), (((1,), (1,)), ((), ()))) * s.astype(x.dtype)

    def w8a16_kn(x, q, s):
        return (x @ q.astype(x.dtype)) * s.astype(x.dtype)

    return [("fp8 w8a8 autotuned", fp8_linear, (x, q, s), None),
            ("fp8 w8a8 cublas", fp8_linear, (x, q, s), CUBLAS),
            ("fp8 w8a8 triton only", fp8_linear, (x, q, s), TRITON_ONLY),
            ("fp8 w8a16 [N,K] autotuned", w8a16, (x, q, s), None),
            ("fp8 w8a16 [K,N] autotuned", w8a16_kn, (x, kn, s), None)]


def gemm_kernels(fn, args, options) -> str:
    """The GEMM kernels XLA compiled `fn` to: its custom calls' targets and Triton GEMM fusions' names."""
    text = jax.jit(fn, compiler_options=options).lower(*args).compile().as_text()
    found = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))
                   | set(re.findall(r'"kind":"(__triton[a-z_]*)"', text)))
    return ",".join(found) or "none"


def swiglu(h):
    gate, up = jnp.split(h, 2, axis=-1)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(h.dtype)


def split_k(s: int, reduce: bool):
    """x @ w as an explicit split-K product: a batched dot over s slices of K giving the f32 partial sums
    `[s, M, N]` (what a kernel after the GEMM could add up itself), or (reduce) their sum in x's dtype."""
    def fn(x, w):
        m, k = x.shape
        parts = jnp.einsum("smk,skn->smn", x.reshape(m, s, k // s).transpose(1, 0, 2), w.reshape(s, k // s, -1),
                           preferred_element_type=jnp.float32)
        return parts.sum(axis=0).astype(x.dtype) if reduce else parts

    return fn


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="jengine/llama-3.1-8b", help="model dir or preset (its config.json)")
    p.add_argument("--m", type=positive_int, nargs="+", default=[1, 64, 256, 2048], help="rows (step tokens)")
    p.add_argument("--timer", choices=("program", "cupti"), default="program",
                   help="as in kernels.py: program-difference timing (any backend) or CUPTI kernel time (GPU)")
    p.add_argument("--ops", nargs="+", choices=("qkv", "o", "gate_up", "down"), default=None,
                   help="projections to time (default: all)")
    p.add_argument("--calls", type=positive_int, default=10)
    p.add_argument("--no-pallas", action="store_true", help="skip the Pallas matmul (it runs on Hopper only)")
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                   help="time only the implementations whose name contains one of these (e.g. cublas swiglu_matmul)")
    p.add_argument("--fp8", action="store_true",
                   help="also time fp8 weights (quantization='fp8'): the engine's 8-bit x 8-bit product with per-row "
                        "activation scales (W8A8), the weight converted in the GEMM (W8A16), and the kernels XLA chose")
    p.add_argument("--split-k", type=positive_int, nargs="+", default=[], metavar="S",
                   help="also time each projection as an explicit split-K batched dot over S slices of K: its f32 "
                        "partial sums alone (XLA times its own split-K with the reduction), and with their sum")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    if any(s & (s - 1) for s in a.split_k):
        p.error(f"--split-k: each S must be a power of two, got {a.split_k}")
    if a.timer == "cupti" and jax.default_backend() != "gpu":
        raise SystemExit("--timer cupti needs a GPU (CUPTI counts CUDA kernels)")
    from jengine.kernels_pallas.ragged_paged_attention.gpu_mosaic import on_hopper

    pallas = not a.no_pallas and on_hopper()
    timed = functools.partial(cupti_us if a.timer == "cupti" else bench, calls=a.calls)
    print(f"devices: {jax.devices()}")
    print(f"{'m':>6} {'op':10} {'impl':32}{'µs':>10}{'TFLOP/s':>9}{'W TB/s':>8}")
    rows = []
    key = jax.random.key(0)
    for m in a.m:
        for name, (k, n) in projections(a.model).items():
            if a.ops and name not in a.ops:
                continue
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            w = (jax.random.normal(key, (k, n), jnp.bfloat16) * k**-0.5).astype(jnp.bfloat16)
            # (name, fn, args, XLA options); the weight is the rotated operand
            impls = [("xla cublas", lambda x, w: x @ w, (x, w), CUBLAS),
                     ("xla autotuned", lambda x, w: x @ w, (x, w), None),
                     ("xla triton only", lambda x, w: x @ w, (x, w), TRITON_ONLY),
                     ("xla cublaslt", lambda x, w: x @ w, (x, w), CUBLASLT),
                     ("xla cublas, w as [N, K]", lambda x, wt: x @ wt.T, (x, w.T.copy()), CUBLAS)]
            impls += [(f"xla split-k {s}{suffix}", split_k(s, reduce), (x, w), None)
                      for s in a.split_k if k % s == 0 for suffix, reduce in (("", False), (" + sum", True))]
            if a.fp8:
                impls += fp8_impls(x, w)
            if pallas:
                impls += [(tile_name(t), pallas_matmul(t), (x, w), None) for t in pallas_tiles(m)]
            if name == "gate_up":
                impls.append(("xla cublas + swiglu", lambda x, w: swiglu(x @ w), (x, w), CUBLAS))
                if pallas:  # the product in the GEMM's epilogue (the engine's kernel), at a few tilings
                    impls += [(f"swiglu_matmul {c.tile_m}x{c.tile_n} s{c.stages} snake{c.snake} "
                               f"d{c.delay_release}{'' if c.approx_math else ' exact exp'}",
                               functools.partial(swiglu_matmul.swiglu_matmul, config=c), (x, w), None)
                              for c in SWIGLU_CONFIGS if swiglu_matmul.supports(x.shape, w.shape, x.dtype, c)]
            if name == "down":  # the product as the down GEMM's prologue: fusible where XLA picks a Triton GEMM
                h = jax.random.normal(key, (m, 2 * k), jnp.bfloat16)
                impls += [("swiglu, then cublas", lambda h, w: swiglu(h) @ w, (h, w), CUBLAS),
                          ("swiglu into autotuned", lambda h, w: swiglu(h) @ w, (h, w), None)]
            reference = jax.jit(lambda x, w: x @ w, compiler_options=CUBLAS)(x, w).astype(jnp.float32)
            fused_reference = swiglu_matmul.reference(x, w).astype(jnp.float32) if name == "gate_up" else None
            for impl, fn, args, options in impls:
                if fn is None or (a.only and not any(text in impl for text in a.only)):
                    continue
                try:  # distinct weight copies in turn, so that a call does not find the last one's in L2
                    if impl.startswith(("pallas", "swiglu_matmul", "fp8", "xla split-k")):
                        want = fused_reference if impl.startswith("swiglu_matmul") else reference
                        got = jax.jit(fn)(*args).astype(jnp.float32)
                        if impl.startswith("xla split-k") and got.ndim == 3:  # the partial sums: checked summed
                            got = got.sum(axis=0)
                        error = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                        if impl.startswith("fp8"):  # 8-bit rounding: reported, with the kernels chosen
                            print(f"{m:>6} {name:10} {impl:32} error {error:.3g}, kernels "
                                  f"{gemm_kernels(fn, args, options)}", flush=True)
                        elif error > 2e-2:
                            print(f"{m:>6} {name:10} {impl:32} wrong: relative error {error:.3g}", flush=True)
                            continue
                    us = timed(fn, args, rests=rotated(args, args[1].nbytes), compiler_options=options)
                except Exception as e:  # a tiling that does not fit (shared memory, shape) is reported, not fatal
                    print(f"{m:>6} {name:10} {impl:32} failed: {type(e).__name__}: {e}"[:200], flush=True)
                    continue
                row = dict(m=m, op=name, impl=impl, us=us, tflop_s=2 * m * k * n / us / 1e6,
                           weight_tb_s=args[1].nbytes / us / 1e6, fraction_of_peak=2 * m * k * n / us / 1e6
                           / (H200_BF16_FLOPS / 1e12))
                rows.append(row)
                print(f"{m:>6} {name:10} {impl:32}{us:10.1f}{row['tflop_s']:9.1f}{row['weight_tb_s']:8.2f}",
                      flush=True)
            if name == "gate_up":  # the product alone: what an epilogue that absorbs it would save
                h = jax.random.normal(key, (m, n), jnp.bfloat16)
                us = timed(lambda h, _: swiglu(h), (h, h[:1]))
                rows.append(dict(m=m, op="swiglu", impl="xla", us=us))
                print(f"{m:>6} {'swiglu':10} {'xla (alone)':32}{us:10.1f}", flush=True)
    write_json(a.output_json, {"rows": rows})


if __name__ == "__main__":
    main()
