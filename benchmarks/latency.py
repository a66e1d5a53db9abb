"""Decode latency at batch 1 / 8 / 64 (vLLM's benchmark_latency), jengine and/or transformers.

    python benchmarks/latency.py --batch-sizes 1 8 64 --input-len 128 --output-len 256 --backend both

Outputs are forced to full length (ignore_eos). Prints per backend and batch size: end-to-end seconds,
ms per decode step, output tok/s, and the decode step time against the weight-streaming bound. For
transformers (`generate`, sdpa) the step time is end-to-end / output length (prefill included, as the
BENCHMARKS.md anchor is quoted).

`--trace` runs each batch size once more under `jax.profiler` and prints, per engine step, the device's
kernel span, busy and idle time, the widest idle gaps (`--gaps N`) and the host's busiest annotations
(`--host-events N`): where the engine's own loop (scheduling, packing, reading results back) leaves the
device waiting, which `profile_step.py`'s fixed-input loop does not show. JAX's Python tracer stays off
unless `--python-tracer` (it slows the host: a traced batch-1 step took 4.95 ms with it, 4.71 without).
"""

from __future__ import annotations

import argparse
import time

from common import (
    H200_COPY_BW,
    add_engine_flags,
    build_llm,
    hf_in_child,
    model_shape,
    non_negative_int,
    positive_float,
    positive_int,
    print_table,
    random_prompts,
    save_results,
    streamed_weight_bytes,
)


def run_jengine(args) -> list[dict]:
    from jengine import SamplingParams

    llm = build_llm(args)
    engine = llm.engine
    tp = engine.config.tensor_parallel_size  # the bound is per device: its shard of the weights
    weight_bytes = streamed_weight_bytes(engine.runner.params) / tp
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.input_len, engine.model_config.vocab_size, seed=batch)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        runs = []
        engine.timings.clear()
        steps0 = engine.stats["steps"]
        for it in range(args.num_iters):
            engine.scheduler.block_manager.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate([[t + it for t in p] for p in prompts], params, use_tqdm=False)
            e2e = time.perf_counter() - start
            first = max(o.metrics.first_token_time for o in outs)
            last = max(o.metrics.finished_time for o in outs)
            runs.append((e2e, (last - first) / max(1, args.output_len - 1)))
        e2e, step = sorted(runs)[len(runs) // 2]
        num_steps = engine.stats["steps"] - steps0
        phases = {k: 1e3 * v / num_steps for k, v in engine.timings.items()}
        rows.append({"backend": "jengine", "batch": batch, "e2e_s": e2e, "ms_per_step": step * 1e3,
                     "out_tok_s": batch * args.output_len / e2e, "decode_tok_s": batch / step,
                     "weight_bytes": weight_bytes, "host_ms_per_step": phases})
        print("    jengine ms per step by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
        if args.trace:
            rows[-1]["trace"] = trace_run(args, llm, [[t + args.num_iters for t in p] for p in prompts], params)
    return rows


def trace_run(args, llm, prompts, params) -> dict:
    """One more run of the batch under the profiler: per-step device span / busy / idle and host events."""
    import tempfile

    import jax
    import profile_step

    engine = llm.engine
    engine.scheduler.block_manager.reset_prefix_cache()
    steps0 = engine.stats["steps"]
    trace_dir = tempfile.mkdtemp(prefix="jengine_latency_trace_")
    profile_step.start_trace(trace_dir, python=args.python_tracer)
    llm.generate(prompts, params, use_tqdm=False)
    jax.profiler.stop_trace()
    steps = engine.stats["steps"] - steps0
    data = profile_step.load_trace(trace_dir)
    planes = profile_step.kernel_events(data)
    if not planes:
        raise SystemExit("latency.py --trace: the trace has no GPU kernels (it reads GPU traces only)")
    summary = profile_step.summarise(planes[sorted(planes)[0]], steps, top_n=0, gaps_n=args.gaps)
    summary["steps"] = steps
    summary["host_events"] = profile_step.host_events(data, steps, args.host_events)
    print(f"    traced {steps} steps: span {summary['span_ms']:.3f}, kernels busy {summary['busy_ms']:.3f}, idle "
          f"{summary['idle_ms']:.3f} ms/step (largest gap per step {summary['largest_gap_ms']:.3f} ms), "
          f"{summary['kernels_per_step']:.0f} kernels/step, median gap {summary['median_gap_us']:.1f} us")
    for g in summary["widest_gaps"]:
        print(f"    gap {g['us']:8.1f} us after {g['after']!r} before {g['before']!r}")
    for name, ms, calls in summary["host_events"]:
        print(f"    host {ms:7.3f} ms/step {calls:7.1f}x  {name}")
    return summary


def run_hf(args) -> list[dict]:
    import hf_backend

    model = hf_backend.load(args.model, args.dtype, attn="sdpa")
    shape = model_shape(args.model)
    weight_bytes = (shape["layer_params"] + shape["head_params"]) * (4 if "32" in args.dtype else 2)
    rows = []
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.input_len, shape["vocab"], seed=batch)
        hf_backend.generate_static(model, prompts, 4, batch)  # warm-up
        runs = sorted(hf_backend.generate_static(model, prompts, args.output_len, batch)[0]
                      for _ in range(args.num_iters))
        e2e = runs[len(runs) // 2]
        step = e2e / args.output_len
        rows.append({"backend": "hf", "batch": batch, "e2e_s": e2e, "ms_per_step": step * 1e3,
                     "out_tok_s": batch * args.output_len / e2e, "decode_tok_s": batch / step,
                     "weight_bytes": weight_bytes})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(parser)
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=256)
    parser.add_argument("--num-iters", type=positive_int, default=2)
    parser.add_argument("--backend", default="jengine", choices=("jengine", "hf", "both"))
    parser.add_argument("--trace", action="store_true",
                        help="profile one more run per batch size (jengine): device busy / idle per step")
    parser.add_argument("--host-events", type=non_negative_int, default=20,
                        help="with --trace: the host's N busiest annotations")
    parser.add_argument("--gaps", type=non_negative_int, default=0,
                        help="with --trace: the N widest idle gaps of the traced run, with their neighbours")
    parser.add_argument("--python-tracer", action="store_true",
                        help="with --trace: trace Python calls too (their names in --host-events; slows the host)")
    parser.add_argument("--peak-tb-s", type=positive_float, default=H200_COPY_BW / 1e12, help="bandwidth of the bound")
    args = parser.parse_args(argv)
    if args.backend != "jengine":
        import hf_backend

        if not hf_backend.available():
            parser.error(f"--backend {args.backend} needs torch and transformers installed")

    rows = hf_in_child(__file__, argv) if args.backend == "both" else []  # first: before JAX takes the device
    if args.backend in ("jengine", "both"):
        rows = run_jengine(args) + rows
    if args.backend == "hf":
        rows += run_hf(args)
    for r in rows:
        bound = r["weight_bytes"] / (args.peak_tb_s * 1e12)
        r.update(bound_ms_per_step=bound * 1e3, fraction_of_bound=bound / (r["ms_per_step"] / 1e3))
    print_table(rows, ["backend", "batch", "e2e_s", "ms_per_step", "decode_tok_s", "out_tok_s",
                       "bound_ms_per_step", "fraction_of_bound"])
    ratios = {}
    for r in rows:
        other = next((h for h in rows if h["backend"] == "hf" and h["batch"] == r["batch"]), None)
        if r["backend"] == "jengine" and other is not None:
            ratios[str(r["batch"])] = r["out_tok_s"] / other["out_tok_s"]
            print(f"batch {r['batch']}: jengine / hf = {ratios[str(r['batch'])]:.2f}x output tok/s")
    return save_results(args, rows, use_jax=args.backend != "hf", ratios=ratios)


if __name__ == "__main__":
    main()
