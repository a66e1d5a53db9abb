"""Fused small-batch matmul benchmark: the decoder layer's four matmuls at decode row counts.

Times the Pallas kernel (RMS norm / SwiGLU / residual fused in) against what XLA compiles for the same
unfused math (separate norm, matmul, split-K reduction, SwiGLU and add kernels), per op and row count,
and prints µs, weight GB/s and the fraction of the copy ceiling. Every call gets its own x and its own
copy of the weight (2 x --calls copies: up to 24 GB for gate/up at 50 calls), so XLA can neither merge
calls nor serve weights from L2. `--check` first holds the kernel to an f32 reference on the device. Example (one H200):

    python benchmarks/fused_matmul.py --check --rows 16,32 --calls 100 --json out.json
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from common import H200_COPY_BW, bench, environment, positive_int, print_table, write_json

from jengine.kernels_pallas import fused_matmul as fm
from jengine.kernels_pallas.fused_matmul import gpu as gpu_kernel
from jengine.kernels_pallas.fused_matmul import reference

EPS = 1e-5


def ops(hidden, inter, q_out, kv_out):
    """(name, kind, K, N of the weight) of one Llama layer."""
    return [("qkv", "norm", hidden, q_out + 2 * kv_out), ("o", "add", q_out, hidden),
            ("gate_up", "swiglu", hidden, 2 * inter), ("down", "add", inter, hidden)]


def make(kind, m, k, n, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    g = (1.0 + 0.1 * jax.random.normal(keys[1], (k,), jnp.float32)).astype(dtype)
    w = (jax.random.normal(keys[2], (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    n_out = n // 2 if kind == "swiglu" else n
    r = jax.random.normal(keys[3], (m, n_out), jnp.float32).astype(dtype)
    return x, g, w, r


def op_fn(kind, impl, config=None, interpret=False):
    """`fn(x, second, w)` for bench: second is the norm weight or the residual."""
    kw = dict(impl=impl, config=config, interpret=interpret)
    if kind == "add":
        return lambda x, r, w: fm.matmul_add(x, w, r, **kw)
    return lambda x, g, w: fm.norm_matmul(x, g, w, eps=EPS, swiglu_out=kind == "swiglu", **kw)


def reference_fn(kind):
    if kind == "add":
        return lambda x, r, w: reference.matmul_add(x, w, r)
    return lambda x, g, w: reference.norm_matmul(x, g, w, eps=EPS, swiglu_out=kind == "swiglu")


def check(shapes, rows, configs, interpret):
    """Kernel (bf16) against the f32 reference: relative Frobenius error per op and tile."""
    worst = 0.0
    for name, kind, k, n in shapes:
        x, g, w, r = make(kind, rows, k, n, jnp.bfloat16, seed=1)
        second = r if kind == "add" else g
        f32 = [a.astype(jnp.float32) for a in (x, second, w)]
        with jax.default_matmul_precision("highest"):
            want = np.asarray(jax.jit(reference_fn(kind))(*f32))
        for cfg in configs:
            try:
                got = np.asarray(jax.jit(op_fn(kind, "gpu", cfg, interpret))(x, second, w).astype(jnp.float32))
            except jax.errors.JaxRuntimeError as e:  # e.g. a tile over the shared-memory limit
                print(f"check {name} tile={cfg}: failed to run: {str(e).splitlines()[0]}", flush=True)
                continue
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            worst = max(worst, err)
            print(f"check {name} rows={rows} tile={cfg}: rel err {err:.2e}", flush=True)
    return worst


def parse_configs(text):
    if not text:
        return [None]
    return [None if c == "table" else gpu_kernel.GpuConfig(*(int(v) for v in c.split(",")))
            for c in text.split(";")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16,32", help="comma list of token rows (decode buckets)")
    p.add_argument("--ops", default="qkv,o,gate_up,down")
    p.add_argument("--hidden", type=positive_int, default=4096)
    p.add_argument("--intermediate", type=positive_int, default=14336)
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--configs", default="", help="';'-separated tiles 'block_n,block_k,warps,stages' (or "
                   "'table') to time side by side (default: the table)")
    p.add_argument("--calls", type=positive_int, default=100,
                   help="calls per timed program (timing is the difference of N and 2N calls)")
    p.add_argument("--no-xla", action="store_true", help="skip the unfused XLA baseline")
    p.add_argument("--check", action="store_true")
    p.add_argument("--interpret", action="store_true", help="run the kernel in interpret mode (CPU smoke test)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    shapes = [s for s in ops(a.hidden, a.intermediate, a.heads * a.head_dim, a.kv_heads * a.head_dim)
              if s[0] in a.ops.split(",")]
    rows_list = [int(v) for v in a.rows.split(",")]
    configs = parse_configs(a.configs)
    result = {"env": environment(), "args": vars(a), "rows": []}
    if a.check:
        result["max_rel_err"] = check(shapes, rows_list[0], configs, a.interpret)
    for rows in rows_list:
        for name, kind, k, n in shapes:
            x, g, w, r = make(kind, rows, k, n, jnp.bfloat16)
            second = r if kind == "add" else g
            w_bytes = w.size * w.dtype.itemsize
            # A weight copy per call: XLA merges dots that share an operand (so shared weights made its
            # unfused baseline look 2-4x faster than the copy bandwidth), and no call finds L2 warm.
            rests = [(second, w)] + [(second, jnp.array(w, copy=True)) for _ in range(2 * a.calls - 1)]
            variants = [] if a.no_xla else [("xla", op_fn(kind, "reference"))]
            for cfg in configs:
                label = "table" if cfg is None else ",".join(str(v) for v in (cfg.block_n, cfg.block_k,
                                                                             cfg.num_warps, cfg.num_stages))
                variants.append((f"pallas {label}", op_fn(kind, "gpu", cfg, a.interpret)))
            for label, fn in variants:
                try:
                    us = bench(fn, (x, second, w), a.calls, rests=rests)
                except jax.errors.JaxRuntimeError as e:
                    print(f"{name} {label}: failed to run: {str(e).splitlines()[0]}", flush=True)
                    us = float("nan")
                row = {"op": name, "rows": rows, "variant": label, "us": us,
                       "weight_GBps": w_bytes / us / 1e3, "of_copy_bw": w_bytes / (us * 1e-6) / H200_COPY_BW}
                result["rows"].append(row)
                print(row, flush=True)
            del rests
    print_table(result["rows"], ["op", "rows", "variant", "us", "weight_GBps", "of_copy_bw"])
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
