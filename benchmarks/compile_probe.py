"""Where start-up compile time goes: tracing/lowering vs XLA compilation of one forward bucket, and how
compiling several buckets scales with threads; or (`--warmup`) the engine's own cold warm-up with every
XLA compile timed, summed per program kind.

    python benchmarks/compile_probe.py --token-buckets 16 32 64 128 256 --seq-buckets 8 --workers 16
    python benchmarks/compile_probe.py --warmup --tokens-per-seq-row 8   # default 2048 / 256 buckets

Compares in separate processes (run it once per --workers value): within one process XLA reuses its
GEMM autotuning results, so a second round would look faster for that reason alone. `--tokens-per-seq-row`
and `--swiglu-min-tokens` override `buckets.TOKENS_PER_SEQ_ROW` and `swiglu_matmul.MIN_TOKENS` for the run
(the number of forward programs, and which of them hold the fused gate/up kernel).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import tempfile
import threading
import time

import jax
from common import positive_int, write_json

from jengine import buckets as buckets_module
from jengine.engine import LLMEngine
from jengine.engine_config import EngineConfig
from jengine.kernels_pallas import swiglu_matmul


@contextlib.contextmanager
def timed_compiles():
    """Within the block, each `Lowered.compile` call records (program name, start, end) in the yielded list."""
    records, lock, compile_ = [], threading.Lock(), jax.stages.Lowered.compile

    def compile(self, *args, **kwargs):
        start = time.perf_counter()
        out = compile_(self, *args, **kwargs)
        with lock:
            records.append((getattr(self._lowering, "_name", "?"), start, time.perf_counter()))
        return out

    jax.stages.Lowered.compile = compile
    try:
        yield records
    finally:
        jax.stages.Lowered.compile = compile_


def warmup_breakdown(builder, workers: int) -> dict:
    """The engine's warm-up (`builder`, its `ProgramBuilder`) with every compile timed: totals, and per
    program kind its compiles."""
    with timed_compiles() as records:
        t0 = time.perf_counter()
        builder.warmup(progress=False, workers=workers)
        total = time.perf_counter() - t0
    print(f"{len(builder.runner.buckets())} buckets: warm-up {total:.1f} s, of it tracing and lowering "
          f"{builder.warmup_lowering_seconds:.1f} s, {len(records)} compiles ({workers} threads)")
    kinds = collections.defaultdict(list)
    for name, start, end in records:
        kinds[name].append((start - t0, end - t0))
    rows = {}
    for name, spans in sorted(kinds.items(), key=lambda kv: -sum(e - s for s, e in kv[1])):
        took = [e - s for s, e in spans]
        rows[name] = dict(n=len(spans), sum_s=sum(took), min_s=min(took), max_s=max(took),
                          first_start_s=min(s for s, _ in spans), last_end_s=max(e for _, e in spans))
        print(f"  {name:28} n={len(spans):3d}  sum {sum(took):7.1f} s  each {min(took):5.1f}-{max(took):5.1f} s  "
              f"first start {rows[name]['first_start_s']:5.1f} s  last end {rows[name]['last_end_s']:5.1f} s")
    return dict(warmup_s=total, lowering_s=builder.warmup_lowering_seconds, compiles=len(records), kinds=rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="jengine/llama-3.1-8b")
    parser.add_argument("--token-buckets", type=positive_int, nargs="+", default=None, help="default: the engine's")
    parser.add_argument("--seq-buckets", type=positive_int, nargs="+", default=None, help="default: the engine's")
    parser.add_argument("--max-num-seqs", type=positive_int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--workers", type=positive_int, default=16)
    parser.add_argument("--warmup", action="store_true", help="time the engine's cold warm-up, compile by compile")
    parser.add_argument("--tokens-per-seq-row", type=positive_int, default=None)
    parser.add_argument("--swiglu-min-tokens", type=positive_int, default=None)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    saved = buckets_module.TOKENS_PER_SEQ_ROW, swiglu_matmul.MIN_TOKENS
    buckets_module.TOKENS_PER_SEQ_ROW = args.tokens_per_seq_row or saved[0]
    swiglu_matmul.MIN_TOKENS = args.swiglu_min_tokens or saved[1]
    try:
        result = probe(args)
    finally:
        buckets_module.TOKENS_PER_SEQ_ROW, swiglu_matmul.MIN_TOKENS = saved
    write_json(args.output_json, result)
    return result


def probe(args) -> dict:
    tokens, seqs = args.token_buckets, args.seq_buckets
    # --warmup: a fresh cache directory, so that the engine's executable cache and JAX's do the work a cold
    # start does (and serve nothing)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", max_model_len=2048,
                                    max_num_seqs=max(seqs) if seqs else args.max_num_seqs,
                                    max_num_batched_tokens=max(tokens) if tokens else args.max_num_batched_tokens,
                                    token_buckets=tuple(tokens) if tokens else None,
                                    seq_buckets=tuple(seqs) if seqs else None,
                                    compilation_cache_dir=tempfile.mkdtemp() if args.warmup else None,
                                    load_format="dummy"), warmup=False, progress=False)
    runner = engine.runner
    if args.warmup:
        return warmup_breakdown(engine.builder, args.workers)
    buckets = runner.buckets()

    def lower(bucket):
        return runner.trace_forward(bucket)[1].lower()

    t0 = time.perf_counter()
    lowered = lower(buckets[0])
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    print(f"one bucket {buckets[0]}: trace+lower {t1 - t0:.2f} s, XLA compile {t2 - t1:.2f} s")
    one = dict(bucket=buckets[0], lower_s=t1 - t0, compile_s=t2 - t1)
    rest = buckets[1:]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        lows = list(pool.map(lower, rest))
        t1 = time.perf_counter()
        list(pool.map(lambda lw: lw.compile(), lows))
    t2 = time.perf_counter()
    print(f"{len(rest)} more buckets, {args.workers:2d} threads: lower {t1 - t0:6.2f} s, compile {t2 - t1:6.2f} s")
    return dict(one=one, rest=dict(buckets=len(rest), workers=args.workers, lower_s=t1 - t0, compile_s=t2 - t1))


if __name__ == "__main__":
    main()
