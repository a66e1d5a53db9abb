"""Shared-prefix workload: throughput with prefix caching on vs off (vLLM's benchmark_prefix_caching).

    python benchmarks/prefix.py --num-prompts 512 --prefix-len 1024 --suffix-len 64 --output-len 128

N requests share one random P-token prefix, each followed by its own random tokens, K tokens out
(ignore_eos), all submitted at once. Each mode builds its own engine (one after the other, the first
released before the second is built). Prints per mode: seconds, req/s, output and total tok/s, prompt
tokens actually computed (the engine's computed_prompt_tokens), and the on / off ratio.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import (
    add_engine_flags,
    build_llm,
    model_shape,
    non_negative_int,
    positive_int,
    print_table,
    release,
    save_results,
)


def shared_prefix_prompts(n: int, prefix_len: int, suffix_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(100, vocab - 100, size=prefix_len).tolist()
    return [prefix + rng.integers(100, vocab - 100, size=suffix_len).tolist() for _ in range(n)]


def run_mode(args, prompts: list[list[int]], caching: bool) -> dict:
    from jengine import SamplingParams

    llm = build_llm(args, label=f"prefix caching {'on' if caching else 'off'}: ", enable_prefix_caching=caching)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    warm = shared_prefix_prompts(4, 16, 16, vocab, seed=args.seed + 99)
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine.scheduler.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    computed0, steps0 = engine.stats["computed_prompt_tokens"], engine.stats["steps"]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    row = {"prefix_caching": "on" if caching else "off", "elapsed_s": elapsed, "req_s": len(prompts) / elapsed,
           "output_tok_s": out_tokens / elapsed, "total_tok_s": (out_tokens + prompt_tokens) / elapsed,
           "prompt_tokens": prompt_tokens, "computed_prompt_tokens": engine.stats["computed_prompt_tokens"] - computed0,
           "steps": engine.stats["steps"] - steps0, "mean_ttft_ms": 1e3 * float(np.mean(
               [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]))}
    release(llm)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(parser)
    parser.add_argument("--num-prompts", type=positive_int, default=512)
    parser.add_argument("--prefix-len", type=positive_int, default=1024)
    parser.add_argument("--suffix-len", type=non_negative_int, default=64)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--modes", nargs="+", default=["on", "off"], choices=("on", "off"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    prompts = shared_prefix_prompts(args.num_prompts, args.prefix_len, args.suffix_len,
                                    model_shape(args.model)["vocab"], args.seed)
    rows = [run_mode(args, prompts, caching=(mode == "on")) for mode in args.modes]
    print_table(rows, ["prefix_caching", "elapsed_s", "req_s", "output_tok_s", "total_tok_s", "prompt_tokens",
                       "computed_prompt_tokens", "mean_ttft_ms"])
    by_mode = {r["prefix_caching"]: r for r in rows}
    ratio = None
    if len(by_mode) == 2:
        ratio = by_mode["on"]["output_tok_s"] / by_mode["off"]["output_tok_s"]
        print(f"prefix caching on / off: {ratio:.2f}x output tok/s; prompt tokens computed "
              f"{by_mode['on']['computed_prompt_tokens']} vs {by_mode['off']['computed_prompt_tokens']}")
    return save_results(args, rows, ratio_on_off=ratio)


if __name__ == "__main__":
    main()
