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

import jax
import jax.numpy as jnp
from common import H200_BF16_FLOPS, bench, model_shape, positive_int, write_json
from kernels import cupti_us, rotated

# tile_m, tile_n, tile_k, stages; a tiling runs where tile_m divides the rows (the kernel's requirement)
PALLAS_TILES = list(itertools.product((64, 128, 256), (128, 256), (64,), (4,)))


def projections(model: str) -> dict[str, tuple[int, int]]:
    """(K, N) of each projection of a layer, with gate and up as one [K, 2 I] weight as the engine has it."""
    s = model_shape(model)
    hidden, inter = s["config"]["hidden_size"], s["config"]["intermediate_size"]
    return {"qkv": (hidden, (s["hq"] + 2 * s["hkv"]) * s["head_dim"]), "o": (s["hq"] * s["head_dim"], hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}


def pallas_matmul(tile):
    """JAX's Hopper matmul with one tiling, or None where this JAX lacks it."""
    try:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    except ImportError:
        return None
    tile_m, tile_n, tile_k, stages = tile
    config = hm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, max_concurrent_steps=stages)
    return lambda x, w: hm.matmul(x, w, None, config)


def swiglu(h):
    gate, up = jnp.split(h, 2, axis=-1)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(h.dtype)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="jengine/llama-3.1-8b", help="model dir or preset (its config.json)")
    p.add_argument("--m", type=positive_int, nargs="+", default=[1, 64, 256, 2048], help="rows (step tokens)")
    p.add_argument("--timer", choices=("program", "cupti"), default="program",
                   help="as in kernels.py: program-difference timing (any backend) or CUPTI kernel time (GPU)")
    p.add_argument("--calls", type=positive_int, default=10)
    p.add_argument("--no-pallas", action="store_true", help="skip the Pallas matmul (it runs on Hopper only)")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    if a.timer == "cupti" and jax.default_backend() != "gpu":
        raise SystemExit("--timer cupti needs a GPU (CUPTI counts CUDA kernels)")
    from jengine.kernels_pallas.ragged_paged_attention.gpu_mosaic import on_hopper

    pallas = not a.no_pallas and on_hopper()
    timed = functools.partial(cupti_us if a.timer == "cupti" else bench, calls=a.calls)
    print(f"devices: {jax.devices()}")
    print(f"{'m':>6} {'op':10} {'impl':28}{'µs':>10}{'TFLOP/s':>9}{'W TB/s':>8}")
    rows = []
    key = jax.random.key(0)
    for m in a.m:
        for name, (k, n) in projections(a.model).items():
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            w = (jax.random.normal(key, (k, n), jnp.bfloat16) * k**-0.5).astype(jnp.bfloat16)
            rests = rotated((x, w), w.nbytes)
            impls = [("xla", lambda x, w: x @ w)]
            if pallas:
                impls += [(f"pallas {t[0]}x{t[1]}x{t[2]} s{t[3]}", pallas_matmul(t)) for t in PALLAS_TILES
                          if m % t[0] == 0]
            if name == "gate_up":
                impls.append(("xla + swiglu", lambda x, w: swiglu(x @ w)))
            for impl, fn in impls:
                if fn is None:
                    continue
                try:  # distinct weight copies in turn, so that a call does not find the last one's in L2
                    us = timed(fn, (x, w), rests=rests)
                except Exception as e:  # a tiling that does not fit (shared memory, shape) is reported, not fatal
                    print(f"{m:>6} {name:10} {impl:28} failed: {type(e).__name__}: {e}"[:200], flush=True)
                    continue
                row = dict(m=m, op=name, impl=impl, us=us, tflop_s=2 * m * k * n / us / 1e6,
                           weight_tb_s=2 * k * n / us / 1e6, fraction_of_peak=2 * m * k * n / us / 1e6
                           / (H200_BF16_FLOPS / 1e12))
                rows.append(row)
                print(f"{m:>6} {name:10} {impl:28}{us:10.1f}{row['tflop_s']:9.1f}{row['weight_tb_s']:8.2f}",
                      flush=True)
            if name == "gate_up":  # the product alone: what an epilogue that absorbs it would save
                h = jax.random.normal(key, (m, n), jnp.bfloat16)
                us = timed(lambda h, _: swiglu(h), (h, h[:1]))
                rows.append(dict(m=m, op="swiglu", impl="xla", us=us))
                print(f"{m:>6} {'swiglu':10} {'xla (alone)':28}{us:10.1f}", flush=True)
    write_json(a.output_json, {"rows": rows})


if __name__ == "__main__":
    main()
