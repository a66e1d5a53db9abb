"""How fast XLA's matmuls stream a model's weights at decode-sized M (rows = tokens in the step).

    python benchmarks/gemm.py --m 1 8 16 64 256

For every weight shape of one decoder layer (and the LM head) and every M: a jitted program multiplies
one `[M, K]` activation by `copies` distinct `[K, N]` bf16 weights (distinct buffers, more bytes than
L2, as consecutive layers are), timed as the median of `--iters` calls. Prints µs per matmul and the
bytes streamed per second against the device copy ceiling. Run under different `XLA_FLAGS` to compare
GEMM back ends (`--xla_gpu_enable_triton_gemm=false`, ...).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
from common import H200_COPY_BW, model_shape, write_json


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    s = model_shape(model)
    h, d, inter = s["config"]["hidden_size"], s["head_dim"], s["config"]["intermediate_size"]
    return {"qkv": (h, (s["hq"] + 2 * s["hkv"]) * d), "o": (s["hq"] * d, h), "gate_up": (h, 2 * inter),
            "down": (inter, h), "lm_head": (h, s["vocab"])}


def time_matmuls(m: int, k: int, n: int, total_bytes: float, iters: int) -> tuple[float, int]:
    copies = max(2, min(64, int(total_bytes // (2 * k * n))))
    keys = jax.random.split(jax.random.key(0), copies + 1)
    ws = [jax.random.normal(keys[i], (k, n), jnp.bfloat16) for i in range(copies)]
    x = jax.random.normal(keys[-1], (m, k), jnp.bfloat16)
    fn = jax.jit(lambda x, ws: [x @ w for w in ws])
    jax.block_until_ready(fn(x, ws))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(x, ws))
        times.append(time.perf_counter() - t)
    del ws
    return statistics.median(times) / copies, copies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="jengine/llama-3.1-8b")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--weights", nargs="+", default=None, help="subset of qkv o gate_up down lm_head")
    parser.add_argument("--total-gb", type=float, default=3.0, help="weight bytes one timed call streams")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--label", default=os.environ.get("XLA_FLAGS", "default flags"))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    shapes = layer_shapes(args.model)
    rows = []
    for name, (k, n) in shapes.items():
        if args.weights and name not in args.weights:
            continue
        for m in args.m:
            sec, copies = time_matmuls(m, k, n, args.total_gb * 1e9, args.iters)
            moved = 2 * (k * n + m * k + m * n)
            rows.append({"weight": name, "k": k, "n": n, "m": m, "us": sec * 1e6, "tb_s": moved / sec / 1e12,
                         "copies": copies})
            print(f"[{args.label}] {name:8s} {k:6d}x{n:<6d} M={m:4d}: {sec * 1e6:8.1f} us  "
                  f"{moved / sec / 1e12:5.2f} TB/s ({moved / sec / H200_COPY_BW:5.1%} of copy ceiling)")
    write_json(args.output_json, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
