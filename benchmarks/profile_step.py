"""Where a decode step's device time goes, from a `jax.profiler` trace of back-to-back steps.

    python benchmarks/profile_step.py --batch-sizes 1 64 --context 256 --steps 10

For each batch size: B decode rows at `--context` tokens are padded to the smallest token bucket
that holds them and to the sequence bucket an engine with max_num_seqs = the largest batch would pick
(its default buckets: batch 1 runs as 8 rows, a decode-shaped bucket, as in a server); the step is
launched back to back as the engine does (`ModelRunner.execute`), timed, then traced. The trace's GPU
kernels are summed per category (matmul, attention, K/V write, other fusions, copies) and the idle time
between kernels is reported: what a step costs beyond its kernels.
Run it under different `XLA_FLAGS` to compare compiler settings on the same step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import tempfile
import time

import jax
import numpy as np
from common import H200_COPY_BW, non_negative_int, positive_float, positive_int, streamed_weight_bytes, write_json

from jengine.buckets import seq_bucket
from jengine.engine import LLMEngine
from jengine.engine_config import KV_CACHE_DTYPES, PAGE_SIZES, EngineConfig
from jengine.quantization import QUANTIZATIONS
from jengine.sampling_params import SamplingParams
from jengine.sampling_tables import build_sampling_tensors
from jengine.step_input import build_step_input

CATEGORIES = (  # first match wins
    ("attention", re.compile(r"ragged_paged_attention|paged_attention", re.I)),
    ("kv write", re.compile(r"scatter|write_kv", re.I)),
    ("matmul", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|sm90_|sm80_|splitk|dot", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other fusions"


def step_input(engine: LLMEngine, batch: int, context: int, num_tokens: int, prefill_len: int = 0,
               decode_rows: int = 0, decode_context: int = 0):
    """B decode rows at `context` tokens, or (prefill_len > 0) B prompt chunks of prefill_len new tokens
    after `context` cached ones; then `decode_rows` decode rows at `decode_context` tokens (a mixed step).
    Padded to `num_tokens` and the engine's sequence bucket for it."""
    cfg = engine.model_config
    rng = np.random.default_rng(batch)
    rows, next_page = [], 1
    for new, ctx in [(max(1, prefill_len), context)] * batch + [(1, decode_context)] * decode_rows:
        pages = (ctx + new) // engine.config.block_size + 1
        rows.append((rng.integers(1000, size=new).tolist(), ctx, list(range(next_page, next_page + pages)), -1, None))
        next_page += pages
    seqs = seq_bucket(len(rows), num_tokens, engine.config.seq_buckets)
    sampling = build_sampling_tensors([(SamplingParams(temperature=0), [1], [])] * len(rows), seqs, cfg.vocab_size)
    return build_step_input(rows, num_tokens, seqs, engine.config.pages_per_seq, engine.config.block_size, sampling)


def run_steps(runner, inp, n: int) -> float:
    """n steps back to back, each feeding the previous one's ids, as the engine's asynchronous loop.

    Returns the host's mean time inside `execute` (dispatch: if it nears the step time, launching a
    step waits for the previous one and host and device work do not overlap)."""
    out = None
    dispatch = 0.0
    for _ in range(n):
        t = time.perf_counter()
        out = runner.execute(inp)
        dispatch += time.perf_counter() - t
    jax.block_until_ready(out)
    return dispatch * 1e3 / n


def load_trace(trace_dir: str):
    from jax.profiler import ProfileData

    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    return ProfileData.from_file(path)


def start_trace(trace_dir: str, python: bool = False) -> None:
    """`jax.profiler.start_trace`, with JAX's Python tracer only if `python`: it records every Python call and
    slows the host (a traced batch-1 engine loop on an H200: 4.95 ms a step with it, 4.71 without, 4.40 untraced;
    RESULTS.md, session 45). Without it the trace keeps the device's kernels and the runtime's own annotations
    (XLA, PjRt, CUDA calls)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python else 0
    jax.profiler.start_trace(trace_dir, profiler_options=options)


def host_events(data, steps: int, top_n: int) -> list[tuple[str, float, float]]:
    """The host's busiest trace annotations: (name, ms per step, calls per step), nested ones included
    (an outer annotation's time contains its children's); numbers in names are folded to '#'."""
    total = collections.defaultdict(lambda: [0.0, 0])
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            for ev in line.events:
                entry = total[re.sub(r"\d+", "#", ev.name)[:100]]
                entry[0] += ev.duration_ns
                entry[1] += 1
    top = sorted(total.items(), key=lambda kv: -kv[1][0])[:top_n]
    return [(name, ns / 1e6 / steps, n / steps) for name, (ns, n) in top]


def kernel_events(data) -> dict[str, list]:
    """Per GPU plane: (name, start_ns, duration_ns) of every kernel/copy on its stream lines."""
    planes = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        events = planes.setdefault(plane.name, [])
        for line in plane.lines:
            if not line.name.lower().startswith("stream"):
                continue
            events.extend((ev.name, ev.start_ns, ev.duration_ns) for ev in line.events)
    return planes


def summarise(events, steps: int, top_n: int = 20, gaps_n: int = 0) -> dict:
    per_cat = collections.defaultdict(float)
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    for name, _, dur in events:
        per_cat[category(name)] += dur
        per_kernel[name][0] += dur
        per_kernel[name][1] += 1
    intervals = sorted((s, s + d, name) for name, s, d in events)
    # The trace starts with the first step's input copies, then the device waits while the host is still
    # launching that step (1.5-1.8 ms on an H200, session 8): not a gap between steps, so idle time and
    # gaps count from the first kernel on.
    first = next((i for i, (_, _, name) in enumerate(intervals) if category(name) != "copy"), 0)
    intervals = intervals[first:]
    busy, end, last, gaps = 0.0, None, "", []
    for s, e, name in intervals:
        if end is not None and e <= end:
            continue
        if end is not None and s > end:
            gaps.append((s - end, last, name))
        busy += e - (s if end is None else max(s, end))
        end, last = e, name
    # The host's time not hidden behind the device shows as gaps at step boundaries; the `steps` largest
    # gaps bound it (the rest of `idle` is the ordinary spacing between back-to-back kernels).
    gaps.sort(reverse=True)
    widest = [{"us": g / 1e3, "after": a[:80], "before": b[:80]} for g, a, b in gaps[:gaps_n]]
    gaps = [g for g, _, _ in gaps]
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    to_ms = lambda ns: ns / 1e6 / steps  # noqa: E731
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top_n]
    return {
        "kernels_per_step": len(events) / steps,
        "span_ms": to_ms(span), "busy_ms": to_ms(busy), "idle_ms": to_ms(span - busy),
        "largest_gap_ms": to_ms(sum(gaps[:steps])), "widest_gaps": widest,
        "median_gap_us": gaps[len(gaps) // 2] / 1e3 if gaps else 0.0,
        "categories_ms": {k: to_ms(v) for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:110], "ms_per_step": to_ms(t), "calls_per_step": c / steps,
                         "us_per_call": t / c / 1e3} for n, (t, c) in top],
    }


def sequence(events, first: int, count: int, copies: bool = False) -> list[dict]:
    """Kernels [first, first + count) in start order: name, start (from the first listed), duration and
    the gap since the previous kernel ended (negative: they overlapped, as programmatic dependent
    launch lets them). Copies and memsets are left out unless `copies`."""
    ordered = sorted((s, d, name) for name, s, d in events
                     if copies or category(name) != "copy")[first:first + count]
    rows, prev_end = [], None
    for s, d, name in ordered:
        rows.append({"name": name[:90], "start_us": (s - ordered[0][0]) / 1e3, "us": d / 1e3,
                     "gap_us": 0.0 if prev_end is None else (s - prev_end) / 1e3})
        prev_end = s + d
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="jengine/llama-3.1-8b")
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=non_negative_int, default=256)
    parser.add_argument("--token-buckets", type=positive_int, nargs="+", default=[8, 64])
    parser.add_argument("--prefill-len", type=non_negative_int, default=0,
                        help="rows are prompt chunks of this many new tokens (after --context cached ones)")
    parser.add_argument("--decode-rows", type=non_negative_int, default=0,
                        help="add this many decode rows at --decode-context tokens to every step (mixed steps)")
    parser.add_argument("--decode-context", type=positive_int, default=512)
    parser.add_argument("--max-model-len", type=positive_int, default=None)
    parser.add_argument("--steps", type=positive_int, default=10, help="steps traced (and 3x as many timed)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1)
    parser.add_argument("--top", type=non_negative_int, default=12, help="kernels listed per step")
    parser.add_argument("--gaps", type=non_negative_int, default=0,
                        help="also list the N widest idle gaps, with their neighbours")
    parser.add_argument("--host-events", type=non_negative_int, default=0,
                        help="also list the host's N busiest annotations")
    parser.add_argument("--python-tracer", action="store_true",
                        help="trace Python calls too (their names in --host-events; slows the host)")
    parser.add_argument("--sequence", type=int, nargs=2, default=None, metavar=("FIRST", "COUNT"),
                        help="also list COUNT kernels of the traced run in time order from kernel FIRST "
                             "(one layer's chain: which fusions sit between the GEMMs, with gaps)")
    parser.add_argument("--sequence-copies", action="store_true",
                        help="--sequence lists copies and memsets too (they are left out by default)")
    parser.add_argument("--gpu-memory-utilization", type=positive_float, default=0.9)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES))
    parser.add_argument("--block-size", type=int, default=EngineConfig.block_size, choices=PAGE_SIZES,
                        help="tokens per KV page (default: the engine's)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help="the engine's weight quantization")
    parser.add_argument("--trace-dir", default=None, help="keep the raw trace here (default: a temp dir)")
    parser.add_argument("--label", default=os.environ.get("XLA_FLAGS", "default flags"))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.sequence and (args.sequence[0] < 0 or args.sequence[1] < 1):
        parser.error(f"--sequence needs FIRST >= 0 and COUNT >= 1, got {args.sequence}")
    seqs = tuple(sorted({b + args.decode_rows for b in args.batch_sizes}))
    buckets = tuple(sorted(args.token_buckets))
    t0 = time.perf_counter()
    max_len = args.max_model_len or max(1024, 2 * (args.context + args.prefill_len))
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", max_model_len=max_len,
                                    max_num_seqs=max(seqs), max_num_batched_tokens=max(buckets),
                                    token_buckets=buckets,  # the engine's sequence buckets, as a server's
                                    gpu_memory_utilization=args.gpu_memory_utilization,
                                    kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                                    quantization=args.quantization,
                                    tensor_parallel_size=args.tensor_parallel_size), progress=False)
    print(f"[{args.label}] start-up {time.perf_counter() - t0:.1f} s")
    bound_ms = 1e3 * streamed_weight_bytes(engine.runner.params) / H200_COPY_BW
    results = []
    for b in args.batch_sizes:
        t = min(x for x in buckets if x >= b * max(1, args.prefill_len) + args.decode_rows)
        inp = step_input(engine, b, args.context, t, args.prefill_len, args.decode_rows, args.decode_context)
        run_steps(engine.runner, inp, 3)
        times, dispatch = [], []
        for _ in range(3):
            t1 = time.perf_counter()
            dispatch.append(run_steps(engine.runner, inp, args.steps))
            times.append((time.perf_counter() - t1) * 1e3 / args.steps)
        step_ms = statistics.median(times)
        trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="jengine_trace_")
        start_trace(trace_dir, python=args.python_tracer)
        run_steps(engine.runner, inp, args.steps)
        jax.profiler.stop_trace()
        data = load_trace(trace_dir)
        planes = kernel_events(data)
        if not planes:
            raise SystemExit("profile_step.py: the trace has no GPU kernels (it reads GPU traces only)")
        first = sorted(planes)[0]
        summary = summarise(planes[first], args.steps, args.top, args.gaps)
        summary.update(batch=b, tokens=t, step_ms=step_ms, weight_bound_ms=bound_ms,
                       dispatch_ms=statistics.median(dispatch), device=first,
                       busy_ms_per_device={p: summarise(e, args.steps, 0)["busy_ms"] for p, e in planes.items()})
        results.append(summary)
        cats = ", ".join(f"{k} {v:.3f}" for k, v in summary["categories_ms"].items())
        print(f"[{args.label}] B={b} T={t}: {step_ms:.3f} ms/step back to back (weights bound {bound_ms:.2f}), "
              f"host in execute {summary['dispatch_ms']:.3f} ms/step; traced {first}: span "
              f"{summary['span_ms']:.3f}, kernels busy {summary['busy_ms']:.3f}, idle {summary['idle_ms']:.3f} "
              f"ms/step (largest gap per step {summary['largest_gap_ms']:.3f} ms, median gap "
              f"{summary['median_gap_us']:.1f} us), {summary['kernels_per_step']:.0f} kernels/step; {cats}")
        if len(planes) > 1:
            print("    busy ms/step per device: " + ", ".join(
                f"{p.rsplit(':', 1)[-1]} {v:.3f}" for p, v in sorted(summary["busy_ms_per_device"].items())))
        for g in summary["widest_gaps"]:
            print(f"    gap {g['us']:8.1f} us after {g['after']!r} before {g['before']!r}")
        summary["host_events"] = host_events(data, args.steps, args.host_events)
        for name, ms, calls in summary["host_events"]:
            print(f"    host {ms:7.3f} ms/step {calls:7.1f}x  {name}")
        if args.sequence:
            summary["sequence"] = sequence(planes[first], *args.sequence, copies=args.sequence_copies)
            for k in summary["sequence"]:
                print(f"    at {k['start_us']:9.1f} us  {k['us']:7.1f} us  gap {k['gap_us']:6.1f}  {k['name']}")
        for k in summary["top_kernels"]:
            print(f"    {k['ms_per_step']:7.3f} ms/step {k['calls_per_step']:6.1f}x {k['us_per_call']:8.1f} us  "
                  f"{k['name']}")
    write_json(args.output_json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
