"""Does tensor parallelism on this machine's devices compute what one device computes?

    XLA_FLAGS=... python benchmarks/tp_check.py --tensor-parallel-sizes 2 4

For correctness of collective settings (XLA flags) on real GPUs, where the CPU test suite's fake
devices cannot tell. Each TP size runs the committed f32 checkpoint `tests/fixtures/models/llama3_tied`
(run it with JAX_DEFAULT_MATMUL_PRECISION=highest so matmuls are true f32) and generates greedily with
logprobs; the greedy tokens must equal TP 1's and the logprobs agree within --tolerance. Prints one
JSON line per TP size and exits non-zero on a mismatch.

Large all-reduces (a long prefill of a big model), where greedy tokens of random bf16 weights may
legitimately differ: `--model jengine/llama-3.1-8b --load-format dummy --dtype bfloat16
--prompt-len 1500 --tolerance 0.5` compares the teacher-forced prompt logprobs position by position
(mean and max difference) and only reports the generated tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from common import non_negative_int, positive_float, positive_int, release

from jengine import LLM, SamplingParams

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "models",
                       "llama3_tied")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 31)), list(range(40, 100))]


def run(args, tp: int) -> tuple[list, np.ndarray, np.ndarray]:
    max_len = max(128, 2 * args.prompt_len)
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, tensor_parallel_size=tp,
              max_model_len=max_len, max_num_seqs=8, max_num_batched_tokens=max_len, token_buckets=(8, max_len),
              seq_buckets=(8,), compilation_cache_dir=None, use_tqdm_on_load=False)
    vocab = llm.engine.model_config.vocab_size
    prompts = PROMPTS + ([np.random.default_rng(0).integers(1, vocab, args.prompt_len).tolist()]
                         if args.prompt_len else [])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outs])
    prompt_lp = np.array([d[t].logprob for o, p in zip(outs, prompts) for d, t in zip(o.prompt_logprobs[1:], p[1:])])
    release(llm)  # the next TP size's engine needs the device memory
    return tokens, logprobs, prompt_lp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=FIXTURE, help="checkpoint directory or preset")
    parser.add_argument("--load-format", default="safetensors")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=non_negative_int, default=0, help="add one random prompt this long")
    parser.add_argument("--tensor-parallel-sizes", type=positive_int, nargs="+", default=[2, 4])
    parser.add_argument("--max-tokens", type=positive_int, default=24)
    parser.add_argument("--tolerance", type=positive_float, default=1e-3, help="max abs logprob difference")
    args = parser.parse_args()
    want_tokens, want_lp, want_prompt = run(args, 1)
    exact = args.dtype == "float32"
    ok = True
    for tp in args.tensor_parallel_sizes:
        tokens, lp, prompt_lp = run(args, tp)
        same = tokens == want_tokens
        diff = float(np.abs(lp - want_lp).max()) if same else None
        prompt_diff = np.abs(prompt_lp - want_prompt)
        ok &= prompt_diff.max() <= args.tolerance and (not exact or (same and diff <= args.tolerance))
        print(json.dumps({"tp": tp, "xla_flags": os.environ.get("XLA_FLAGS", ""), "tokens_equal": same,
                          "max_logprob_diff": diff, "prompt_logprob_diff_max": float(prompt_diff.max()),
                          "prompt_logprob_diff_mean": float(prompt_diff.mean()),
                          "prompt_positions": int(prompt_diff.size)}), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
