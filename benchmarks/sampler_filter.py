"""The sampler's top-k + top-p filter (`sampler._apply_top_k_top_p`) by each of its selects, on random
logits of the 8B vocabulary.

    python benchmarks/sampler_filter.py --batch-sizes 8 64 256 --top-p 0.95

Per batch size S: k drawn in 1..64 and in 1..256 per row, every row with `--top-p`; the filter by the
radix selects (`k_bound` 0, 16 passes over [S, V] for each of top-k and top-p), by the k-th largest of the
64 chunks with the largest maxima with a radix top-p (`k_bound` 64: a batch with a top-p-only row), and
with top-p among the candidates too (`small_p`, bound 64 or 256). Each timed variant is checked to keep
the same tokens as the radix selects. Times: CUPTI kernel sums on a GPU (`kernels.cupti_us`), else the
wall clock net of a program's fixed cost (`common.bench`).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from common import bench, positive_float, positive_int, print_table, save_results

from jengine.sampler import _apply_top_k_top_p
from jengine.sampling_tables import SMALL_TOP_K, WIDE_TOP_K

# (name, largest k drawn, the filter's static switches)
VARIANTS = (
    ("radix", SMALL_TOP_K, {}),
    ("chunks k<=64, radix top-p", SMALL_TOP_K, {"k_bound": SMALL_TOP_K}),
    ("chunks k<=64, top-p among them", SMALL_TOP_K, {"k_bound": SMALL_TOP_K, "small_p": True}),
    ("radix, k<=256", WIDE_TOP_K, {}),
    ("chunks k<=256, top-p among them", WIDE_TOP_K, {"k_bound": WIDE_TOP_K, "small_p": True}),
)


def _kept(fn, logits, top_k, top_p) -> np.ndarray:
    return np.isfinite(np.asarray(jax.jit(fn)(logits, top_k, top_p)))


def timer(calls: int):
    if jax.default_backend() == "gpu":
        from kernels import cupti_us

        return lambda fn, args: cupti_us(fn, args, calls)
    return lambda fn, args: bench(fn, args, calls, reps=3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--vocab", type=positive_int, default=128256)
    ap.add_argument("--top-p", type=positive_float, default=0.95)
    ap.add_argument("--calls", type=positive_int, default=30)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if args.top_p > 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    time_us = timer(args.calls)
    rows = []
    for s in args.batch_sizes:
        rng = np.random.default_rng(s)
        logits = jnp.asarray(rng.standard_normal((s, args.vocab)).astype(np.float32) * rng.uniform(0.5, 3.0, (s, 1)))
        top_p = jnp.full((s,), args.top_p, jnp.float32)
        ks = {largest: jnp.asarray(rng.integers(1, largest + 1, s).astype(np.int32))
              for largest in (SMALL_TOP_K, WIDE_TOP_K)}
        kept_by_radix = {largest: _kept(_apply_top_k_top_p, logits, k, top_p) for largest, k in ks.items()}
        for name, largest, switches in VARIANTS:
            fn = functools.partial(_apply_top_k_top_p, **switches)
            inputs = (logits, ks[largest], top_p)
            rows.append({"batch": s, "variant": name, "ms": time_us(fn, inputs) / 1e3,
                         "same_as_radix": bool(np.array_equal(_kept(fn, *inputs), kept_by_radix[largest]))})
            print(f"S={s:4d} {name:34s} {rows[-1]['ms']:7.3f} ms  same tokens kept as the radix selects: "
                  f"{rows[-1]['same_as_radix']}", flush=True)
    print_table(rows, ["batch", "variant", "ms", "same_as_radix"], fmt="{:.3f}")
    return save_results(args, rows)


if __name__ == "__main__":
    main()
