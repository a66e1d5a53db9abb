"""Does a forward program's speed depend on its compile? (XLA's GEMM autotuner times candidate
algorithms on the device while it compiles; warm-up compiles many programs at once.)

    python benchmarks/compile_variance.py --bucket 256 256 --rounds 3 --alongside 0 15 \
        --max-model-len 1024 --max-num-seqs 256 --max-num-batched-tokens 2048 --token-buckets 256 2048 \
        --seq-buckets 64 256 --gpu-memory-utilization 0.3

(Without warm-up the engine allocates its KV cache before these compiles; at the default memory
utilization, concurrent autotuning then runs out of device memory on an H200: hence the lower setting.)

Each round is a fresh process (XLA keeps its autotuning results for the process's lifetime), with no
compilation cache. It compiles the `--bucket` (T, S) forward program while `--alongside` other forward
programs compile beside it in a thread pool, as warm-up does (the engine's other buckets, taken in turn,
repeated as needed). It then reports the cuBLAS algorithm XLA selected for each GEMM of that program (read
from the compiled HLO; none on CPU) and the program's time per call, on a padding-only input, so that the
time is the GEMMs' and the other per-token work's, not attention's: `ms_per_call` is the median over
`--repeats` runs of `--calls` calls queued back to back (the host's dispatch and XLA's command-buffer
update hide behind the device, as in the engine); `serial_ms` is the median of single calls each waited
for, which adds the host's share (session 14 measured with that alone, and saw a ~5% spread between
processes that had picked the same algorithms). Rounds that selected different algorithms, or took
different times with the same ones, show the compile-to-compile spread.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import statistics
import sys
import time

from common import (
    add_engine_flags,
    child_argv,
    engine_args,
    non_negative_int,
    positive_float,
    positive_int,
    print_table,
    run_marked_child,
    save_results,
)

_MARK = "COMPILE_VARIANCE "
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:lt\$)?(?:matmul|gemm)[^"]*".*?"selected_algorithm":"?(-?\d+)')


def selected_algorithms(hlo_text: str) -> list[int]:
    """The cuBLAS algorithm of each GEMM custom call in a compiled module's text, in order."""
    return [int(m.group(1)) for m in _GEMM.finditer(hlo_text)]


def child(args) -> None:
    import jax

    from jengine.engine import LLMEngine
    from jengine.engine_config import EngineConfig
    from jengine.runner import forward_compiler_options
    from jengine.step_input import pack

    config = EngineConfig(model=args.model, **engine_args(args, compilation_cache_dir=None))
    runner = LLMEngine(config, warmup=False, progress=False).runner

    def lowered(bucket):
        return runner.trace_forward(bucket)[1].lower(), forward_compiler_options(bucket[0])

    target = tuple(args.bucket)
    if target not in runner.buckets():
        raise SystemExit(f"--bucket {target} is not one of the engine's buckets {runner.buckets()}")
    others = [b for b in runner.buckets() if b != target] or [target]
    (alongside,) = args.alongside  # the parent passes one value to each child
    jobs = [lowered(target)] + [lowered(others[i % len(others)]) for i in range(alongside)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        compiled = [f.result() for f in [pool.submit(low.compile, opts) for low, opts in jobs]][0]
    compile_s = time.perf_counter() - t0

    runner.allocate_kv_cache()
    ints, floats, _ = pack(dataclasses.replace(runner.dummy_input(*target), sampling=None))
    kv = runner.kv_caches
    outputs = runner.output_buffers(target)  # the logits and hidden buffers each call writes over (donated)

    def call(kv):
        nonlocal outputs
        kv, *outputs = compiled(runner.params, kv, ints, floats, runner.prev_ids, *outputs)
        return kv, outputs[0]

    serial, pipelined = [], []
    for i in range(args.warmup_calls + args.calls):
        start = time.perf_counter()
        kv, logits = call(kv)
        jax.block_until_ready(logits)
        if i >= args.warmup_calls:
            serial.append(time.perf_counter() - start)
    for _ in range(args.repeats):  # calls queued back to back: the host's dispatch hides behind the device
        start = time.perf_counter()
        for _ in range(args.calls):
            kv, logits = call(kv)
        jax.block_until_ready(logits)
        pipelined.append((time.perf_counter() - start) / args.calls)
    print(_MARK + json.dumps({"cache": config.compilation_cache_dir, "compile_s": compile_s,
                              "ms_per_call": 1e3 * statistics.median(pipelined),
                              "serial_ms": 1e3 * statistics.median(serial),
                              "algorithms": selected_algorithms(compiled.as_text())}), flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(parser)
    parser.add_argument("--bucket", type=positive_int, nargs=2, required=True, metavar=("T", "S"))
    parser.add_argument("--rounds", type=positive_int, default=3, help="fresh processes per --alongside value")
    parser.add_argument("--alongside", type=non_negative_int, nargs="+", default=[0, 15],
                        help="other forward programs compiling at the same time")
    parser.add_argument("--calls", type=positive_int, default=20)
    parser.add_argument("--warmup-calls", type=non_negative_int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs of --calls queued calls")
    parser.add_argument("--child-timeout", type=positive_float, default=900)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return {}

    own = child_argv(argv)  # the children print; only the parent writes the file
    rows = []
    for alongside in args.alongside:
        for r in range(args.rounds):
            cmd = [sys.executable, os.path.abspath(__file__), *own, "--alongside", str(alongside), "--child"]
            result = run_marked_child(cmd, _MARK, args.child_timeout)
            rows.append({"alongside": alongside, "round": r, **result,
                         "algorithms": " ".join(map(str, result["algorithms"])) or "-"})
            print(f"alongside {alongside} round {r}: {result['ms_per_call']:.3f} ms per call", flush=True)
    print_table(rows, ["alongside", "round", "compile_s", "ms_per_call", "serial_ms", "algorithms"])
    distinct = {row["algorithms"] for row in rows}
    print(f"{len(distinct)} distinct algorithm selection(s) over {len(rows)} compiles")
    return save_results(args, rows)


if __name__ == "__main__":
    main()
