"""Offline throughput: N random prompts submitted at once (vLLM's benchmark_throughput, jengine backend).

    python benchmarks/throughput.py --num-prompts 256 --input-len 512 --output-len 256
"""

from __future__ import annotations

import argparse
import time

from common import add_engine_flags, environment, make_llm, random_prompts, write_json

from jengine import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(parser)
    parser.add_argument("--dataset", default="random", choices=("random",))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()

    llm = make_llm(args)
    engine = llm.engine
    prompts = random_prompts(args.num_prompts, args.input_len, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine.scheduler.block_manager.reset_prefix_cache()
    steps0 = engine.stats["steps"]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    total = out_tokens + args.num_prompts * args.input_len
    result = {"elapsed_s": elapsed, "req_s": args.num_prompts / elapsed, "total_tok_s": total / elapsed,
              "output_tok_s": out_tokens / elapsed, "steps": engine.stats["steps"] - steps0,
              "preemptions": engine.stats["preemptions"]}
    print(f"{args.num_prompts} requests in {elapsed:.2f}s: {result['req_s']:.2f} req/s, "
          f"{result['total_tok_s']:.0f} total tok/s, {result['output_tok_s']:.0f} output tok/s, "
          f"{result['steps']} steps")
    write_json(args.output_json, {"env": environment(), "args": vars(args), "result": result})


if __name__ == "__main__":
    main()
