"""Where start-up compile time goes: tracing/lowering vs XLA compilation of one forward bucket, and how
compiling several buckets scales with threads.

    python benchmarks/compile_probe.py --token-buckets 16 32 64 128 256 --seq-buckets 8 --workers 16

Compares in separate processes (run it once per --workers value): within one process XLA reuses its
GEMM autotuning results, so a second round would look faster for that reason alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import time

from jengine.engine import LLMEngine
from jengine.engine_config import EngineConfig
from jengine.runner import pack


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="jengine/llama-3.1-8b")
    parser.add_argument("--token-buckets", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--seq-buckets", type=int, nargs="+", default=[8])
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", max_model_len=2048,
                                    max_num_seqs=max(args.seq_buckets), max_num_batched_tokens=max(args.token_buckets),
                                    token_buckets=tuple(args.token_buckets), seq_buckets=tuple(args.seq_buckets),
                                    compilation_cache_dir=None, load_format="dummy"), warmup=False, progress=False)
    runner = engine.runner
    buckets = runner.buckets()

    def lower(bucket):
        ints, floats, layout = pack(dataclasses.replace(runner.dummy_input(*bucket), sampling=None))
        return runner._forward.lower(runner.params, runner.kv_caches, ints, floats, runner.no_prev_ids,
                                     layout=layout)

    t0 = time.perf_counter()
    lowered = lower(buckets[0])
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    print(f"one bucket {buckets[0]}: trace+lower {t1 - t0:.2f} s, XLA compile {t2 - t1:.2f} s")
    rest = buckets[1:]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        lows = list(pool.map(lower, rest))
        t1 = time.perf_counter()
        list(pool.map(lambda lw: lw.compile(), lows))
    t2 = time.perf_counter()
    print(f"{len(rest)} more buckets, {args.workers:2d} threads: lower {t1 - t0:6.2f} s, compile {t2 - t1:6.2f} s")


if __name__ == "__main__":
    main()
