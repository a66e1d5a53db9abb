"""Where a decode step's time goes: full step vs forward only, and whether launching blocks.

    python benchmarks/step_probe.py --batch-sizes 1 8 64
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import numpy as np
from common import non_negative_int, positive_float, positive_int

from jengine.buckets import seq_bucket
from jengine.engine import LLMEngine
from jengine.engine_config import EngineConfig
from jengine.sampling_params import SamplingParams
from jengine.sampling_tables import build_sampling_tensors
from jengine.step_input import build_step_input


def _median_ms(fn, n=20):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="jengine/llama-3.1-8b")
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=non_negative_int, default=256)
    parser.add_argument("--launch-variants", action="store_true",
                        help="also time back-to-back launches of parts of the step program")
    parser.add_argument("--num-tokens", type=positive_int, default=64,
                        help="token bucket T the steps are padded to (a server runs batch 1-8 in T=8)")
    parser.add_argument("--gpu-memory-utilization", type=positive_float, default=0.9)
    parser.add_argument("--ablate", choices=("none", "attention", "write_kv", "both"), default="none",
                        help="replace the attention op and/or the RoPE + K/V write by no-ops, to price them")
    args = parser.parse_args(argv)
    if args.ablate != "none":
        from jengine.models import llama

        if args.ablate in ("attention", "both"):
            llama.ragged_paged_attention = lambda q, *a, out_dtype=None, **k: q.astype(out_dtype or q.dtype)
        if args.ablate in ("write_kv", "both"):
            from jengine.kernels_pallas.ragged_paged_attention.reference import split_heads

            def no_write(cache, qkv, cos, sin, slots, *, num_q_heads, kv_scales=None, q_dtype=None):
                q = split_heads(qkv, num_q_heads, cache.shape[1], cache.shape[4])[0]
                return q.astype(q_dtype or qkv.dtype), cache

            llama.rope_and_write_kv = no_write
    seqs = tuple(sorted(set(args.batch_sizes)))
    num_tokens = max(args.num_tokens, max(seqs))
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", max_model_len=1024, max_num_seqs=max(seqs),
                                    max_num_batched_tokens=num_tokens, token_buckets=(num_tokens,),
                                    gpu_memory_utilization=args.gpu_memory_utilization),
                       progress=False)  # the engine's default sequence buckets, as a server's
    runner, cfg = engine.runner, engine.model_config
    family_forward = jax.jit(lambda p, c, mi: runner_forward(p, c, mi, cfg), donate_argnums=(1,))
    tails = ("argmax", "logprobs top-20", "process_logits", "categorical", "sample") if args.launch_variants else ()
    fwd_tails = {name: jax.jit(functools.partial(forward_sample, cfg=cfg, tail=name), donate_argnums=(1,))
                 for name in tails}
    for b in args.batch_sizes:
        block_size = engine.config.block_size
        pages = args.context // block_size + 1
        rng = np.random.default_rng(b)
        rows = [([int(rng.integers(1000))], args.context, list(range(1 + i * pages, 1 + (i + 1) * pages)), -1, None)
                for i in range(b)]
        num_seqs = seq_bucket(b, num_tokens, engine.config.seq_buckets)
        sampling = build_sampling_tensors([(SamplingParams(temperature=0), [1], [])] * b, num_seqs, cfg.vocab_size)
        inp = build_step_input(rows, num_tokens, num_seqs, engine.config.pages_per_seq, block_size, sampling)

        def sync_step(inp=inp):
            jax.block_until_ready(runner.execute(inp))

        launches = []

        def burst(inp=inp, launches=launches):
            out = None
            for _ in range(10):
                t = time.perf_counter()
                out = runner.execute(inp)
                launches.append(time.perf_counter() - t)
            jax.block_until_ready(out)

        sync_step()
        step_ms = _median_ms(sync_step)
        burst_ms = _median_ms(burst, 3) / 10
        model_in = jax.device_put(inp.model)

        def fwd(model_in=model_in):
            runner.kv_caches, h = family_forward(runner.params, runner.kv_caches, model_in)
            jax.block_until_ready(h)

        fwd()
        fwd_ms = _median_ms(fwd)
        print(f"[ablate={args.ablate}] B={b:3d}: sync step {step_ms:6.2f} ms | "
              f"back-to-back {burst_ms:6.2f} ms/step, launch median "
              f"{1e3 * statistics.median(launches):6.2f} ms | forward only {fwd_ms:6.2f} ms")
        if not args.launch_variants:
            continue
        # Which part of the program makes a launch wait for the previous step? Launch each variant 10
        # times back to back with inputs already on the device and report the median launch time.
        inp_dev = jax.device_put(inp)
        variants = {  # noqa: B023 below: each lambda runs within this iteration
            "forward": lambda: family_forward(runner.params, runner.kv_caches, model_in),  # noqa: B023
            **{f"forward+logits+{name}": (lambda fn=fn: fn(runner.params, runner.kv_caches, model_in,  # noqa: B023
                                                           inp_dev))  # noqa: B023
               for name, fn in fwd_tails.items()},
        }
        for name, launch in variants.items():
            times = []
            for _ in range(12):
                t = time.perf_counter()
                result = launch()
                times.append(time.perf_counter() - t)
                runner.kv_caches = result[0]  # each variant donates and returns the cache
            jax.block_until_ready(result)
            print(f"    launch back to back, {name:26s}: median {1e3 * statistics.median(times[2:]):6.2f} ms")


def _tail(name):
    """The part of a step after the logits, by name (to find which part makes launches block)."""
    import jax.numpy as jnp

    from jengine import sampler

    return {
        "argmax": lambda logits, t: jnp.argmax(logits, -1),
        "logprobs top-20": lambda logits, t: sampler.compute_logprobs(logits, jnp.argmax(logits, -1)),
        "process_logits": lambda logits, t: sampler.process_logits(logits, t),
        "categorical": lambda logits, t: jax.vmap(jax.random.categorical)(sampler._row_keys(t), logits),
        "sample": lambda logits, t: sampler.sample(logits, t),
    }[name]


def forward_sample(params, caches, model_input, step_input, cfg, tail="sample"):
    from jengine.models import get_model_family

    family = get_model_family(cfg.architecture)
    caches, hidden = family.forward(params, cfg, model_input, caches)
    logits = family.compute_logits(params, cfg, hidden[step_input.logits_indices])
    return caches, _tail(tail)(logits, step_input.sampling)


def runner_forward(params, caches, model_input, cfg):
    from jengine.models import get_model_family

    return get_model_family(cfg.architecture).forward(params, cfg, model_input, caches)


if __name__ == "__main__":
    main()
