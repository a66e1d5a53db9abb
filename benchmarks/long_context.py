"""TPOT of running decodes while long prompts arrive, chunked prefill on vs off.

    python benchmarks/long_context.py --max-model-len 33024 --num-decodes 32 --decode-output-len 1024 \\
        --long-input-lens 16384 24576 32000

--num-decodes short requests start first and keep decoding (--decode-output-len tokens). Once each has
--warmup-tokens tokens, the long prompts (--long-input-lens, --long-output-len out) are added one every
--long-interval-steps engine steps. Token arrival times are taken on the host after each engine step.
Reported per mode: the decodes' inter-token latency (ITL) while any long prompt is waiting for its
first token (the window that matters) and over the whole run (mean / p50 / p99 / max), their mean
TPOT, and the long prompts' TTFT. Without chunked prefill max_num_batched_tokens is raised to
max_model_len (a whole prompt must fit one step) and that size is added to --token-buckets.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import (
    add_engine_flags,
    build_llm,
    non_negative_int,
    percentiles,
    positive_int,
    print_table,
    release,
    save_results,
)


def run_mode(args, chunked: bool) -> dict:
    from jengine import SamplingParams

    # A server's order unless asked otherwise: the running decodes keep stepping while a long prompt arrives
    # (the offline LLM's default, prompt-only steps, would stall them for the whole prompt).
    overrides = {"enable_chunked_prefill": chunked,
                 "prefill_first": False if args.prefill_first is None else args.prefill_first}
    if not chunked:
        overrides["max_num_batched_tokens"] = max(args.max_num_batched_tokens, args.max_model_len)
        if args.token_buckets:
            overrides["token_buckets"] = tuple(sorted({*args.token_buckets, overrides["max_num_batched_tokens"]}))
    llm = build_llm(args, label=f"chunked prefill {'on' if chunked else 'off'}: ", **overrides)
    engine = llm.engine
    rng = np.random.default_rng(args.seed)
    vocab = engine.model_config.vocab_size

    def prompt(n):
        return rng.integers(100, vocab - 100, size=n).tolist()

    llm.generate([prompt(16)], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine.scheduler.block_manager.reset_prefix_cache()
    decode_params = SamplingParams(temperature=0.0, max_tokens=args.decode_output_len, ignore_eos=True)
    long_params = SamplingParams(temperature=0.0, max_tokens=args.long_output_len, ignore_eos=True)
    decodes = [f"decode-{i}" for i in range(args.num_decodes)]
    for rid in decodes:
        engine.add_request(rid, prompt(args.decode_input_len), decode_params)
    pending_long = list(args.long_input_lens)
    arrivals, first_tokens, token_times = {}, {}, {rid: [] for rid in decodes}
    seen: dict[str, int] = {}
    step, next_long_step = 0, None
    start = time.perf_counter()
    while engine.has_unfinished_requests() or pending_long:
        if pending_long and next_long_step is None and all(len(token_times[r]) >= args.warmup_tokens
                                                          for r in decodes):
            next_long_step = step
        if pending_long and next_long_step is not None and step >= next_long_step:
            rid = f"long-{len(arrivals)}"
            engine.add_request(rid, prompt(pending_long.pop(0)), long_params)
            arrivals[rid] = time.perf_counter()
            next_long_step = step + args.long_interval_steps
        outs = engine.step() if engine.has_unfinished_requests() else []
        now = time.perf_counter()
        step += 1
        for out in outs:
            n = len(out.outputs[0].token_ids)
            new = n - seen.get(out.request_id, 0)
            seen[out.request_id] = n
            if new <= 0:
                continue
            if out.request_id in token_times:
                token_times[out.request_id].extend([now] * new)
            elif out.request_id not in first_tokens:
                first_tokens[out.request_id] = now
    elapsed = time.perf_counter() - start
    engine.drain()
    window = (min(arrivals.values()), max(first_tokens.values())) if arrivals and first_tokens else (0.0, 0.0)
    gaps_all, gaps_window = [], []
    for times in token_times.values():
        for a, b in zip(times, times[1:]):
            gaps_all.append(b - a)
            if window[0] <= b <= window[1]:
                gaps_window.append(b - a)
    finished_early = sum(1 for times in token_times.values() if times and times[-1] < window[1])
    row = {"chunked_prefill": "on" if chunked else "off", "elapsed_s": elapsed, "steps": step,
           "window_s": window[1] - window[0], "decodes_finished_before_window_end": finished_early,
           "decode_tpot_ms": 1e3 * float(np.mean([(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values()
                                                  if len(t) > 1]))}
    row.update({f"window_{k}": v for k, v in percentiles(gaps_window, "itl").items()})
    row.update({f"all_{k}": v for k, v in percentiles(gaps_all, "itl").items()})
    row.update(percentiles([first_tokens[r] - arrivals[r] for r in arrivals if r in first_tokens], "long_ttft"))
    release(llm)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(parser, prefill_first_default="off, as a server runs")
    parser.set_defaults(max_model_len=33024, max_num_seqs=64)
    parser.add_argument("--num-decodes", type=positive_int, default=32)
    parser.add_argument("--decode-input-len", type=positive_int, default=128)
    parser.add_argument("--decode-output-len", type=positive_int, default=1024)
    parser.add_argument("--warmup-tokens", type=non_negative_int, default=16,
                        help="decode tokens before the first long prompt")
    parser.add_argument("--long-input-lens", type=positive_int, nargs="+", default=[16384, 24576, 32000])
    parser.add_argument("--long-output-len", type=positive_int, default=16)
    parser.add_argument("--long-interval-steps", type=positive_int, default=64)
    parser.add_argument("--modes", nargs="+", default=["on", "off"], choices=("on", "off"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if max(args.long_input_lens) + args.long_output_len > args.max_model_len:
        parser.error("--long-input-lens + --long-output-len must fit --max-model-len")

    rows = [run_mode(args, chunked=(mode == "on")) for mode in args.modes]
    print_table(rows, ["chunked_prefill", "elapsed_s", "window_s", "decode_tpot_ms", "window_itl_mean_ms",
                       "window_itl_p50_ms", "window_itl_p99_ms", "window_itl_max_ms", "long_ttft_mean_ms",
                       "long_ttft_max_ms"])
    for r in rows:
        if r["decodes_finished_before_window_end"]:
            print(f"note ({r['chunked_prefill']}): {r['decodes_finished_before_window_end']} decodes finished before "
                  "the last long prompt's first token; raise --decode-output-len")
    return save_results(args, rows)


if __name__ == "__main__":
    main()
