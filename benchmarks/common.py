"""Shared pieces of the benchmark programs: engine flags, random prompts, bounds, JSON output."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import jax
import numpy as np

H200_COPY_BW = 4.3e12  # bytes/s, measured device copy ceiling (shared/BENCHMARKS.md)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="jengine/llama-3.1-8b", help="model dir or preset (dummy weights)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--token-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--seq-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--output-json", default=None)


def make_llm(args):
    """The engine under test, built from the common flags; prints start-up time and KV capacity."""
    from jengine import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               token_buckets=tuple(args.token_buckets) if args.token_buckets else None,
               seq_buckets=tuple(args.seq_buckets) if args.seq_buckets else None,
               gpu_memory_utilization=args.gpu_memory_utilization,
               enable_prefix_caching=args.enable_prefix_caching)
    print(f"start-up {time.perf_counter() - t0:.1f}s ({llm.engine.num_compiled_buckets} buckets), "
          f"KV cache {llm.engine.kv_cache_tokens} tokens")
    return llm


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab - 100, size=(n, length)).tolist()


def streamed_weight_bytes(params: dict) -> int:
    """Bytes a decode step reads from weights: everything but the embedding table (gathered)."""
    return sum(int(v.size) * v.dtype.itemsize for k, v in params.items() if k != "embed")


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "jax": jax.__version__,
            "host": platform.node(), "commit": commit}


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
