"""Decode latency at batch 1 / 8 / 64 (vLLM's benchmark_latency, jengine's LLM API).

    python benchmarks/latency.py --batch-sizes 1 8 64 --input-len 128 --output-len 256

Outputs are forced to full length (ignore_eos). Prints per batch size: end-to-end seconds, ms per
decode step, output tok/s, and the decode step time against the weight-streaming bound.
"""

from __future__ import annotations

import argparse
import time

from common import H200_COPY_BW, add_engine_flags, environment, make_llm, random_prompts, streamed_weight_bytes
from common import write_json as save

from jengine import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-iters", type=int, default=2)
    args = parser.parse_args()

    llm = make_llm(args)
    engine = llm.engine
    weight_bytes = streamed_weight_bytes(engine.runner.params)
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
            runs.append((e2e, (last - first) / (args.output_len - 1)))
        e2e, step = sorted(runs)[len(runs) // 2]
        num_steps = engine.stats["steps"] - steps0
        phases = {k: 1e3 * v / num_steps for k, v in engine.timings.items()}
        bound = weight_bytes / H200_COPY_BW
        rows.append({"batch": batch, "e2e_s": e2e, "ms_per_step": step * 1e3,
                     "out_tok_s": batch * args.output_len / e2e, "decode_tok_s": batch / step,
                     "bound_ms_per_step": bound * 1e3, "fraction_of_bound": bound / step,
                     "host_ms_per_step": phases})
        r = rows[-1]
        print(f"batch {batch:4d}: e2e {e2e:7.2f}s  step {r['ms_per_step']:7.2f} ms  "
              f"decode {r['decode_tok_s']:9.1f} tok/s  out {r['out_tok_s']:9.1f} tok/s  "
              f"weight-stream bound {r['bound_ms_per_step']:.2f} ms "
              f"({100 * r['fraction_of_bound']:.0f}% of it)")
        print("    ms per step by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    save(args.output_json, {"env": environment(), "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
