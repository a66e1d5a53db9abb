"""Offline throughput: N prompts submitted at once (vLLM's benchmark_throughput), jengine and/or transformers.

    python benchmarks/throughput.py --num-prompts 256 --input-len 512 --output-len 256 --backend both
    python benchmarks/throughput.py --dataset chat-like --num-prompts 1000 --max-model-len 4096

Prints req/s, total and output tok/s per backend, the ratio jengine / hf when both run, and the
workload's roofline bound (prefill FLOPs at --peak-tflops, decode weight + KV bytes at --peak-tb-s)
with the fraction of it achieved. `--dataset chat-like` draws seeded ShareGPT-like lognormal lengths
(see common.chat_like_lengths for the parameters).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import jax.numpy as jnp
import numpy as np
from common import (
    KV_CACHE_DTYPES,
    add_dataset_flags,
    add_engine_flags,
    build_llm,
    hf_in_child,
    make_requests,
    model_shape,
    non_negative_int,
    positive_float,
    positive_int,
    print_table,
    roofline,
    save_results,
    write_json,
)


def kv_cache_bytes(kv_cache_dtype: str) -> int | None:
    """Bytes per cached K/V value for `--kv-cache-dtype` (None: the model's dtype)."""
    name = KV_CACHE_DTYPES[kv_cache_dtype]
    return jnp.dtype(name).itemsize if name else None


def sampling_params(args, max_tokens: int, vocab: int = 0, index: int = 0):
    """jengine's SamplingParams for `--temperature/--top-p/--top-k/--logprobs/--flat-logprobs/...` (greedy by
    default); with `--allowed-token-ids N`, request `index` may sample N ids of `vocab` drawn for it."""
    from jengine import SamplingParams

    allowed = None
    if args.allowed_token_ids:
        rng = np.random.default_rng(index)
        allowed = sorted(int(t) for t in rng.choice(vocab, args.allowed_token_ids, replace=False))
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, logprobs=args.logprobs,
                          flat_logprobs=args.flat_logprobs, max_tokens=max_tokens, ignore_eos=True,
                          repetition_penalty=args.repetition_penalty, structured_outputs=args.structured_outputs,
                          allowed_token_ids=allowed)


def run_jengine(args, requests) -> dict:
    from jengine import SamplingParams

    llm = build_llm(args)
    engine = llm.engine
    prompts = [p for p, _ in requests]
    vocab = engine.model_config.vocab_size
    params = [sampling_params(args, o, vocab, i) for i, (_, o) in enumerate(requests)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine.scheduler.block_manager.reset_prefix_cache()
    steps0, preempt0 = engine.stats["steps"], engine.stats["preemptions"]
    timings0 = dict(engine.timings)
    engine.step_log = [] if args.step_log else None
    collector = CollectorTime()
    gc.callbacks.append(collector)
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        elapsed = time.perf_counter() - start
        gc.callbacks.remove(collector)
    if args.step_log:
        summarize_steps(engine.step_log, start, args.step_log)
    steps = engine.stats["steps"] - steps0
    host = {k: 1e3 * (v - timings0.get(k, 0.0)) / max(steps, 1) for k, v in engine.timings.items()}
    print("host ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
    print(f"garbage collector: {collector.seconds:.3f} s in {collector.count} collections "
          f"({collector.full} full, {collector.full_seconds:.3f} s)")
    return {"backend": "jengine", "elapsed_s": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "steps": steps, "preemptions": engine.stats["preemptions"] - preempt0, "host_ms_per_step": host,
            "gc": {"seconds": collector.seconds, "collections": collector.count, "full": collector.full,
                   "full_seconds": collector.full_seconds}}


class CollectorTime:
    """A `gc.callbacks` entry adding up the time Python's garbage collector runs (all, and full ones)."""

    def __init__(self):
        self.seconds, self.count, self.full, self.full_seconds, self._t0 = 0.0, 0, 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        self.seconds += took
        self.count += 1
        if info["generation"] == 2:
            self.full += 1
            self.full_seconds += took


def step_kind(entry: dict) -> str:
    if entry["prompt_tokens"] == 0:
        return "decode"
    return "mixed" if entry["decodes"] else "prefill"


def summarize_steps(log: list[dict], start: float, path: str) -> None:
    """Print the run's time per step kind and bucket, and write every step to `path` (JSON).

    A step's time is the gap between its result reaching the host and the previous step's: the engine
    launches step N+1 before it waits for step N, so while the device is the bottleneck that gap is
    step N's device time (a gap the host caused shows up in it too). The host's share per step: host_ms
    (scheduling to launch), wait_ms (blocked on the results: near 0 when the host is the bottleneck)
    and update_ms (applying them)."""
    prev = start
    for entry in log:
        entry["seconds"], prev = entry["done"] - prev, entry["done"]
    groups: dict[tuple, list[dict]] = {}
    for entry in log:
        groups.setdefault((step_kind(entry), entry["padded_tokens"], entry["padded_seqs"]), []).append(entry)
    rows = []
    for (kind, t, s), entries in sorted(groups.items()):
        secs = sum(e["seconds"] for e in entries)
        rows.append({"kind": kind, "T": t, "S": s, "steps": len(entries), "seconds": secs,
                     "ms_per_step": 1e3 * secs / len(entries),
                     "mean_tokens": sum(e["tokens"] for e in entries) / len(entries),
                     "mean_decodes": sum(e["decodes"] for e in entries) / len(entries),
                     **{f"{k}_ms": 1e3 * sum(e[f"{k}_s"] for e in entries) / len(entries)
                        for k in ("host", "wait", "update")}})
    print_table(rows, ["kind", "T", "S", "steps", "seconds", "ms_per_step", "mean_tokens", "mean_decodes",
                       "host_ms", "wait_ms", "update_ms"])
    write_json(path, {"steps": log, "summary": rows})


def run_hf(args, requests) -> list[dict]:
    import hf_backend

    model = hf_backend.load(args.model, args.dtype, attn="sdpa")
    prompts = [p for p, _ in requests]
    rows = []
    if "batch" in args.hf_modes:
        res = hf_backend.generate_batch(model, prompts, [o for _, o in requests], attn=args.hf_cb_attn)
        if res is not None:
            rows.append({"backend": "hf-generate_batch", "elapsed_s": res[0], "output_tokens": res[1]})
    if "static" in args.hf_modes:
        if len({o for _, o in requests}) > 1 or len({len(p) for p in prompts}) > 1:
            print("hf static generate: lengths differ per request; prompts are left-padded and each batch "
                  "runs to its longest output (only requested tokens are counted)")
        hf_backend.generate_static(model, prompts[:args.hf_batch_size], 4, args.hf_batch_size)  # warm-up
        elapsed, out_tokens = hf_backend.generate_static(model, prompts, [o for _, o in requests],
                                                         args.hf_batch_size)
        rows.append({"backend": f"hf-generate-b{args.hf_batch_size}", "elapsed_s": elapsed,
                     "output_tokens": out_tokens})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(parser)
    add_dataset_flags(parser, num_prompts=256, input_len=512, output_len=256)
    parser.add_argument("--backend", default="jengine", choices=("jengine", "hf", "both"))
    parser.add_argument("--hf-modes", nargs="+", default=["batch", "static"], choices=("batch", "static"),
                        help="transformers runs: generate_batch (continuous batching) and/or static generate")
    parser.add_argument("--hf-batch-size", type=positive_int, default=64, help="batch size of static generate")
    parser.add_argument("--hf-cb-attn", default="paged|sdpa", help="attention for generate_batch")
    parser.add_argument("--peak-tflops", type=positive_float, default=790.0, help="dense bf16 ceiling for the bound")
    parser.add_argument("--peak-tb-s", type=positive_float, default=4.3, help="copy-bandwidth ceiling for the bound")
    parser.add_argument("--step-log", default=None,
                        help="write every jengine step (tokens, sequences, buckets, seconds) to this JSON file "
                             "and print the time per step kind and bucket")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="jengine's sampling (0: greedy); transformers runs stay greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per output token (0: the sampled one)")
    parser.add_argument("--flat-logprobs", action="store_true",
                        help="outputs carry logprobs as FlatLogprobs (few Python objects) instead of dicts")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="every request's repetition_penalty (1: off); penalties need each row's previous token")
    parser.add_argument("--structured-outputs", type=json.loads, default=None, metavar="JSON",
                        help="every request's constraint (vLLM's StructuredOutputsParams fields as JSON, e.g. "
                             "'{\"regex\": \"[a-z ]+\"}'); needs a model dir with a tokenizer "
                             "(benchmarks/bench_model_dir.py)")
    parser.add_argument("--allowed-token-ids", type=non_negative_int, default=0, metavar="N",
                        help="every request may sample only N token ids drawn for it (allowed_token_ids; 0: off)")
    args = parser.parse_args(argv)
    try:
        sampling_params(args, 1, model_shape(args.model)["vocab"])
    except ValueError as e:
        parser.error(str(e))
    if args.backend != "jengine":
        import hf_backend

        if not hf_backend.available():
            parser.error(f"--backend {args.backend} needs torch and transformers installed")

    try:
        requests = make_requests(args, model_shape(args.model)["vocab"])
    except ValueError as e:
        parser.error(str(e))
    lengths = [(len(p), o) for p, o in requests]
    prompt_tokens = sum(i for i, _ in lengths)
    print(f"workload: {args.dataset}, {len(requests)} requests, {prompt_tokens} prompt tokens "
          f"(mean {prompt_tokens / len(requests):.0f}), {sum(o for _, o in lengths)} output tokens")
    bound = roofline(args.model, lengths, args.max_num_seqs, dtype_bytes=4 if "32" in args.dtype else 2,
                     kv_dtype_bytes=kv_cache_bytes(args.kv_cache_dtype),
                     flops=args.peak_tflops * 1e12 * args.tensor_parallel_size,  # aggregate over the TP group
                     bandwidth=args.peak_tb_s * 1e12 * args.tensor_parallel_size)
    rows = hf_in_child(__file__, argv) if args.backend == "both" else []  # first: before JAX takes the device
    if args.backend in ("jengine", "both"):
        rows.insert(0, run_jengine(args, requests))
    if args.backend == "hf":
        rows += run_hf(args, requests)
    for r in rows:
        t = r["elapsed_s"]
        r.update(req_s=len(requests) / t, output_tok_s=r["output_tokens"] / t,
                 total_tok_s=(r["output_tokens"] + prompt_tokens) / t, fraction_of_bound=bound["bound_s"] / t)
    print_table(rows, ["backend", "elapsed_s", "req_s", "total_tok_s", "output_tok_s", "fraction_of_bound"])
    print(f"roofline bound {bound['bound_s']:.2f}s = {bound['bound_output_tok_s']:.0f} output tok/s "
          f"(prefill {bound['prefill_tflop']:.0f} TFLOP at {bound['peak_tflops']:.0f} TFLOP/s = "
          f"{bound['prefill_bound_s']:.2f}s; decode {bound['decode_steps']} steps, "
          f"{bound['decode_weight_gb']:.0f} GB weights + {bound['decode_kv_gb']:.0f} GB KV at "
          f"{bound['peak_tb_s']} TB/s = {bound['decode_bound_s']:.2f}s)")
    ratios = {}
    jen = next((r for r in rows if r["backend"] == "jengine"), None)
    for r in rows:
        if jen is not None and r is not jen:
            ratios[r["backend"]] = jen["output_tok_s"] / r["output_tok_s"]
            print(f"jengine / {r['backend']}: {ratios[r['backend']]:.2f}x output tok/s")
    return save_results(args, rows, use_jax=args.backend != "hf", bound=bound, ratios=ratios)


if __name__ == "__main__":
    main()
