"""Does tensor parallelism on this machine's devices compute what one device computes?

    XLA_FLAGS=... python benchmarks/tp_check.py --tensor-parallel-sizes 2 4

For correctness of collective settings (XLA flags) on real GPUs, where the CPU test suite's fake
devices cannot tell. Each TP size runs the committed f32 checkpoint `tests/fixtures/models/llama3_tied`
(run it with JAX_DEFAULT_MATMUL_PRECISION=highest so matmuls are true f32) and generates greedily with
logprobs; the greedy tokens must equal TP 1's and the logprobs agree within --tolerance. Prints one
JSON line per TP size and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from jengine import LLM, SamplingParams

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "models",
                       "llama3_tied")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 31)), list(range(40, 100))]


def run(model: str, tp: int, max_tokens: int) -> tuple[list, np.ndarray]:
    llm = LLM(model, load_format="safetensors", dtype="float32", tensor_parallel_size=tp, max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 64), seq_buckets=(4,),
              compilation_cache_dir=None, use_tqdm_on_load=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outs])
    return tokens, logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=FIXTURE, help="an HF checkpoint directory (safetensors)")
    parser.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max abs logprob difference")
    args = parser.parse_args()
    want_tokens, want_lp = run(args.model, 1, args.max_tokens)
    ok = True
    for tp in args.tensor_parallel_sizes:
        tokens, lp = run(args.model, tp, args.max_tokens)
        diff = float(np.abs(lp - want_lp).max())
        same = tokens == want_tokens
        ok &= same and diff <= args.tolerance
        print(json.dumps({"tp": tp, "xla_flags": os.environ.get("XLA_FLAGS", ""), "tokens_equal": same,
                          "max_logprob_diff": diff}), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
