"""Ragged paged attention kernel benchmark: decode, prefill and mixed batches.

Prints µs, TB/s of KV read and TFLOP/s per shape, and for decode the same shape through JAX's bundled
Pallas GPU `paged_attention` as a ratio (same run). `--check` first holds the kernel to the reference
on the device. Example (one H200):

    python benchmarks/kernels.py --check --mode decode --batch 64 --ctx 2048 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import json
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from common import bench, net_us_per_call, positive_float, positive_int

from jengine.buckets import normalize_buckets, pick_bucket
from jengine.engine_config import KV_CACHE_DTYPES
from jengine.kernels_pallas.ragged_paged_attention import gpu as gpu_kernel
from jengine.kernels_pallas.ragged_paged_attention import (
    gpu_mosaic,
    ragged_paged_attention,
    reference,
    rope_and_write_kv,
)

HQ, HKV, D = 32, 8, 128


def make_batch(key, q_lens, kv_lens, *, page_size, dtype, hq=HQ, hkv=HKV, d=D, kv_dtype=None, page_order="random",
               num_tokens=None, num_seqs=None, max_model_len=None):
    """Random q, a cache holding exactly the sequences' pages (in `kv_dtype`, default q's), and the
    metadata. `page_order`: "random" permutes the pages; "runs" gives each sequence consecutive pages
    (as prompts written from a fresh free list), sequences in order.

    Padded as an engine's step is, where given: q to `num_tokens` rows (the token bucket), the metadata to
    `num_seqs` sequence rows (the sequence bucket; the extra rows empty) and the page table to
    `max_model_len / page_size` columns (the kernels size their key splits from its width)."""
    if page_order not in ("random", "runs"):
        raise ValueError(f"make_batch: `page_order` must be 'random' or 'runs', got {page_order!r}")
    real_seqs, real_tokens = len(q_lens), sum(q_lens)
    s = max(real_seqs, num_seqs or 0)
    need = [-(-k // page_size) for k in kv_lens]
    pages_per_seq = max(max(need), -(-(max_model_len or 0) // page_size))
    num_pages = sum(need) + 1
    perm = np.random.default_rng(0).permutation(num_pages) if page_order == "random" else np.arange(num_pages)
    table = np.zeros((s, pages_per_seq), np.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n]
        start += n
    k1, k2 = jax.random.split(key)
    cache = jax.random.normal(k1, reference.kv_cache_shape(num_pages, page_size, hkv, d), dtype)
    cache = cache.astype(kv_dtype or dtype)
    q = jax.random.normal(k2, (max(real_tokens, num_tokens or 0), hq, d), dtype)
    cu = np.full(s + 1, real_tokens, np.int32)
    cu[: real_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.zeros(s, np.int32)
    lens[:real_seqs] = kv_lens
    return (q, cache, jnp.asarray(lens), jnp.asarray(table), jnp.asarray(cu), jnp.asarray([real_seqs], jnp.int32))


def bucket(n, buckets):
    """The engine's bucket for n (`pick_bucket` over sorted buckets); None (no padding) without buckets or past
    the largest."""
    return pick_bucket(n, buckets) if buckets and n <= buckets[-1] else None


def workload(mode, batch, ctx):
    """(q_lens, kv_lens) of one benchmark shape."""
    if mode == "decode":
        return [1] * batch, [ctx] * batch
    if mode == "prefill":
        return [ctx] * batch, [ctx] * batch
    chunk = min(512, ctx)  # mixed: batch-1 decodes plus one prefill chunk at the end of a ctx prompt
    return [1] * (batch - 1) + [chunk], [ctx] * batch


def counts(q_lens, kv_lens, hq=HQ, hkv=HKV, d=D, itemsize=2):
    """Bytes of KV that must be read once, and the attention FLOPs (causal, visible keys only)."""
    kv_bytes = sum(kv_lens) * hkv * d * 2 * itemsize
    visible = sum(q * k - q * (q - 1) // 2 for q, k in zip(q_lens, kv_lens))
    return kv_bytes, 4 * d * hq * visible


ROTATE_BYTES = 256 << 20  # KV caches smaller than this are copied and rotated: several times the 50 MB L2


def rotated(args, kv_bytes):
    """Alternatives for `args[1:]` (cache and metadata) holding distinct copies of a small cache, so that
    back-to-back calls do not read K/V from L2 that the previous call left there."""
    copies = min(8, -(-ROTATE_BYTES // max(kv_bytes, 1)))
    caches = [args[1]] + [jnp.array(args[1], copy=True) for _ in range(copies - 1)]
    return [(cache, *args[2:]) for cache in caches]


def bundled_decode(q, cache, kv_lens, table, page_size):
    """JAX's bundled Pallas GPU paged_attention on the same decode batch (its own layout = ours, split K/V)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as bundled
    pages = table.shape[1]
    k_splits = max(s for s in (1, 2, 4, 8, 16) if pages % s == 0)
    ppcb = max(p for p in (1, 2, 4, 8) if (pages // k_splits) % p == 0)
    fn = lambda q, k, v, lens, t: bundled.paged_attention(  # noqa: E731
        q, k, v, t, lens, k_splits=k_splits, pages_per_compute_block=ppcb)
    return fn, (q, cache[0], cache[1], kv_lens, table)  # K/V split once, outside the timed program


def bench_write_kv(cache, num_tokens, calls, reps=5, impl=None):
    """Median µs of one `rope_and_write_kv` of `num_tokens` new tokens (Q/K/V split, RoPE, K/V into the cache;
    `impl` None: the op's choice, "reference": XLA's ops), inside a jitted program with the cache donated as in
    the model's step: programs of `calls` and `2 * calls` chained calls, the difference per extra call."""
    hkv, num_pages, page_size, d = cache.shape[1:]
    k1, k2 = jax.random.split(jax.random.key(9))
    qkvs = jax.random.normal(k1, (2 * calls, num_tokens, (HQ + 2 * hkv) * d), jnp.bfloat16)  # the QKV GEMM's outputs
    angles = jax.random.uniform(k2, (num_tokens, d // 2), jnp.float32, 0, 100)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    slots = jnp.asarray(np.random.default_rng(0).permutation(num_pages * page_size)[:num_tokens], jnp.int32)

    state = {"cache": cache}

    def seconds(n):
        @functools.partial(jax.jit, donate_argnums=0)
        def many(cache, qkvs, slots):
            qsum = jnp.zeros((), jnp.float32)
            for i in range(n):
                q, cache = rope_and_write_kv(cache, qkvs[i], cos, sin, slots, num_q_heads=HQ, impl=impl)
                qsum += q[0, 0, 0].astype(jnp.float32)  # keeps each call's Q alive
            return cache, qsum

        state["cache"] = jax.block_until_ready(many(state["cache"], qkvs, slots))[0]
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            state["cache"] = jax.block_until_ready(many(state["cache"], qkvs, slots))[0]
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    us = net_us_per_call(seconds, calls)
    return us, state["cache"]


def dense_anchors(ctx, calls, timed=bench):
    """JAX's bundled dense causal attention kernels on one sequence of `ctx` tokens: µs by name, timed
    like the kernels (`bench` or `cupti_us`)."""
    from jax.experimental.pallas.ops.gpu import attention, attention_mgpu

    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(k1, (1, ctx, HQ, D), jnp.bfloat16)
    k = jax.random.normal(k2, (1, ctx, HKV, D), jnp.bfloat16)
    v = jax.random.normal(k3, (1, ctx, HKV, D), jnp.bfloat16)
    rep = HQ // HKV
    out = {}
    fns = {
        "bundled triton mha (dense)": (lambda q, k, v: attention.mha(
            q, k, v, None, sm_scale=D**-0.5, causal=True), (q, jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2))),
        # the Mosaic GPU kernel (FlashAttention-3's design) takes float16 only: same FLOPs, same bytes. 64
        # rows per compute warpgroup and 128-key blocks: 505-512 TFLOP/s at 4k on an H200 (RESULTS.md,
        # session 8); 128 rows ran at 139.
        "bundled mosaic-gpu attention (dense, f16)": (lambda q, k, v: attention_mgpu.attention(
            q, k, v, attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)),
            tuple(x.astype(jnp.float16) for x in (q, k, v))),
    }
    for name, (fn, args) in fns.items():  # K/V heads repeated / cast once, outside the timed program
        try:
            out[name] = timed(fn, args, calls)
        except Exception as e:  # an anchor that does not run here is reported, not fatal
            print(f"{name}: failed: {type(e).__name__}: {e}"[:300], flush=True)
    return out


def check(dtype, page_size):
    """Kernel vs reference on small random ragged batches, on the default device."""
    rng = np.random.default_rng(1)
    worst = 0.0
    for q_lens, kv_lens, kw in [
        ([1, 1, 1, 1], [1, 16, 17, 300], {}),
        ([37, 1, 128, 5], [37, 64, 200, 5], {}),
        ([1, 70, 1], [500, 90, 33], dict(sliding_window=40, soft_cap=30.0)),
    ]:
        args = make_batch(jax.random.key(int(rng.integers(1 << 30))), q_lens, kv_lens, page_size=page_size,
                          dtype=dtype)
        for cfg in (None, gpu_kernel.GpuConfig(4, 64, 4, 4, 2)):
            out = ragged_paged_attention(*args, sm_scale=D**-0.5, impl="gpu", config=cfg, **kw)
            f32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
            ref = reference.ragged_paged_attention(*f32, sm_scale=D**-0.5, **kw)
            err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            worst = max(worst, err)
            assert np.isfinite(err) and err < (2e-2 if dtype == jnp.bfloat16 else 5e-3), (q_lens, cfg, err)
    print(f"check {jnp.dtype(dtype).name} page {page_size}: worst relative error {worst:.2e}", flush=True)


def cupti_us(fn, args, calls, rests=None, compiler_options=None):
    """Median µs of one call's GPU kernels, summed by CUPTI (JAX's Mosaic GPU profiler): one compiled
    program run `calls` times, cycling through `rests` like `bench`. No host time and no program fixed
    cost to subtract, and one lowering per shape (`bench` lowers each of its 3 x calls kernel copies)."""
    from jax.experimental.mosaic.gpu import profiler

    rests = rests or [args[1:]]
    jitted = jax.jit(fn, compiler_options=compiler_options)
    jax.block_until_ready(jitted(args[0], *rests[0]))  # compile (and any autotuning) outside the timing
    timed = profiler.measure(jitted)
    times = [timed(args[0], *rests[i % len(rests)])[1] for i in range(calls)]
    times = [ms * 1e3 for ms in times if ms is not None]
    return statistics.median(times) if times else float("nan")


def region_summary(trace_path):
    """Summary of one `MosaicConfig.profile_dir` trace (Chrome trace events, one track per warpgroup,
    "pid" 1 + the SM): per region, its events, mean cycles per event and cycles per program (programs:
    tracks with a prologue), and how many programs each SM started together at the launch (the
    occupancy the launch got)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    tracks = collections.defaultdict(list)
    for e in events:
        tracks[e["tid"]].append(e)
    cycles, count, first_starts = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    programs = 0
    for track in tracks.values():
        open_ = []
        for e in track:
            if e["ph"] == "B":
                open_.append(e)
            elif open_:
                begin = open_.pop()
                cycles[begin["name"]] += (e["ts"] - begin["ts"]) * 1e3  # the profiler writes cycles / 1e3
                count[begin["name"]] += 1
        if any(e["name"] == "prologue" for e in track):
            programs += 1
            first_starts[track[0]["pid"]].append(track[0]["ts"])
    together = collections.Counter()
    for starts in first_starts.values():
        starts.sort()
        together[sum(1 for t in starts if t - starts[0] < 0.5)] += 1  # within 0.5 µs of the SM's first
    regions = {name: dict(events=count[name], cycles_per_event=cycles[name] / count[name],
                          cycles_per_program=cycles[name] / max(programs, 1)) for name in count}
    return dict(programs=programs, regions=regions, programs_per_sm_at_launch=dict(sorted(together.items())))


def transposed_config(cfg, args, page_size):
    """The transposed Mosaic config a timed row ran (`cfg`, or the table's for `cfg` None), or None when
    it ran another kernel (the Triton one, or a non-transposed Mosaic tile): only that kernel has
    named regions."""
    if cfg is None:
        q, cache, _, table, _, _ = args
        cfg = gpu_mosaic.tuned_config(q.shape[0], table.shape[0], cache.shape[1], table.shape[1] * page_size,
                                      q.shape[2], fp8_cache=reference.is_fp8(cache.dtype))
    return cfg if isinstance(cfg, gpu_mosaic.MosaicConfig) and cfg.transposed else None


def trace_regions(run, directory):
    """Call `run(directory)`, one run of a kernel whose Mosaic GPU on-device profiler writes its trace to
    `directory`, and return `region_summary` of that trace."""
    os.makedirs(directory, exist_ok=True)
    before = set(glob.glob(os.path.join(directory, "*-trace.json")))
    jax.block_until_ready(run(directory))
    jax.effects_barrier()  # the trace is written by a host callback
    new = sorted(set(glob.glob(os.path.join(directory, "*-trace.json"))) - before, key=os.path.getmtime)
    if not new:
        raise RuntimeError(f"no on-device profiler trace appeared in {directory}")
    return region_summary(new[-1])


def profile_regions(fn, args, cfg, directory):
    """`trace_regions` of `fn` run once with `cfg` (a transposed Mosaic config)."""
    return trace_regions(
        lambda d: jax.jit(functools.partial(fn, config=dataclasses.replace(cfg, profile_dir=d)))(*args), directory)


def print_regions(summary):
    """`region_summary` as lines: per region its cycles per event and per program."""
    print(f"{'':22}in-kernel profile: {summary['programs']} programs; programs per SM started together: "
          f"{summary['programs_per_sm_at_launch']}", flush=True)
    for name, r in summary["regions"].items():
        print(f"{'':24}{name:10}{r['events']:8} events {r['cycles_per_event']:8.0f} cycles each "
              f"{r['cycles_per_program']:9.0f} per program", flush=True)


def parse_config(text):
    """'' = the table (on Hopper: the Mosaic kernel); 'triton' = the Triton kernel as its table runs it;
    'm:block_kv,stages,splits[,block_q[,compute_warpgroups]]' = a Mosaic tile (an empty block_q: the
    default); 'mt:block_kv,stages,splits[,block_q]' = the transposed Mosaic kernel's (block_q 1: decode
    buckets' one-token items, which the table uses and which key splits need; none: prompt blocks too);
    'block_q,block_kv,splits,warps,stages' = a Triton tile (one launch)."""
    if not text:
        return None
    if text == "triton":
        return "triton"
    if text.startswith("mt:"):
        fields = [int(x) if x else None for x in text[3:].split(",")]
        return gpu_mosaic.MosaicConfig(*fields[:3], block_q=fields[3] if len(fields) > 3 else None, transposed=True)
    if text.startswith("m:"):
        return gpu_mosaic.MosaicConfig(*(int(x) if x else None for x in text[2:].split(",")))
    return gpu_kernel.GpuConfig(*(int(x) for x in text.split(",")))


def config_name(cfg):
    """A tile as `--configs` spells it."""
    if isinstance(cfg, gpu_mosaic.MosaicConfig):
        if cfg.transposed:
            block_q = "" if cfg.block_q is None else f",{cfg.block_q}"
            return f"mt:{cfg.block_kv},{cfg.num_stages},{cfg.num_kv_splits}{block_q}"
        return "m:" + ",".join("" if v is None else str(v) for k, v in vars(cfg).items()
                               if k not in ("transposed", "profile_dir"))
    return ",".join(str(v) for v in vars(cfg).values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="decode,prefill,mixed", help="comma list of decode,prefill,mixed")
    p.add_argument("--batch", default="1,8,64,256")
    p.add_argument("--ctx", default="128,2048,8192,32768")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--page-order", default="random", choices=("random", "runs"),
                   help="random: the cache's pages permuted; runs: each sequence's pages consecutive")
    p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                   help="the cache's dtype (auto: bf16 like q); the bundled kernel runs with bf16 only")
    p.add_argument("--impl", default=None, help="gpu / tpu / reference (default: by backend)")
    p.add_argument("--configs", default="", help="';'-separated configs to time side by side (default: the "
                   "table): '' (the table), 'triton' (the Triton table tile), "
                   "'m:block_kv,stages,splits[,block_q[,wgs]]' (Mosaic tile), 'mt:block_kv,stages,splits[,block_q]' "
                   "(transposed Mosaic tile; block_q 1 for decode buckets' items), "
                   "'block_q,block_kv,splits,warps,stages' (Triton tile)")
    p.add_argument("--token-buckets", type=positive_int, nargs="+", default=None,
                   help="pad each shape's query rows to the smallest of these that holds them, as an engine's step "
                        "(e.g. 8 64 256: batch 1 runs as 8 rows, 7 of them padding; larger shapes stay unpadded)")
    p.add_argument("--seq-buckets", type=positive_int, nargs="+", default=None,
                   help="pad the sequence rows likewise (the extra rows hold no tokens)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="page-table width in tokens, as the engine's (the table sizes key splits from it)")
    p.add_argument("--max-tokens", type=positive_int, default=65536, help="skip prefill shapes with more q tokens")
    p.add_argument("--max-kv-gb", type=positive_float, default=24.0, help="skip shapes whose cache is larger")
    p.add_argument("--calls", type=positive_int, default=10,
                   help="kernel calls in the shorter of the two timed programs (100+ for kernels under ~50 us: "
                        "the difference of two programs is noisy below that); with --timer cupti, the runs")
    p.add_argument("--timer", choices=("program", "cupti"), default="program",
                   help="program: the difference of programs of --calls and 2x --calls calls (any backend); "
                        "cupti: the median over --calls runs of one call's GPU kernel time (GPU only)")
    p.add_argument("--no-bundled", action="store_true", help="skip JAX's bundled decode kernel")
    p.add_argument("--check", action="store_true", help="check against the reference first")
    p.add_argument("--write-kv", action="store_true",
                   help="also time rope_and_write_kv of each batch's new tokens (cache donated)")
    p.add_argument("--anchors", action="store_true",
                   help="for prefill B=1, also time JAX's bundled dense causal attention kernels")
    p.add_argument("--region-profile", default=None, metavar="DIR",
                   help="for decode shapes on the transposed Mosaic kernel, also run once with its in-kernel "
                        "profiler (traces to DIR) and print cycles per named region (Hopper only)")
    p.add_argument("--json", default=None, help="write results to this file")
    a = p.parse_args(argv)

    if a.timer == "cupti" and jax.default_backend() != "gpu":
        p.error("--timer cupti needs a GPU (CUPTI counts CUDA kernels)")
    if a.region_profile and not gpu_mosaic.on_hopper():
        p.error("--region-profile needs a Hopper GPU (the Mosaic GPU kernel's on-device profiler)")
    token_buckets, seq_buckets = (normalize_buckets(b) if b else None for b in (a.token_buckets, a.seq_buckets))
    timed = bench if a.timer == "program" else cupti_us
    print(f"devices: {jax.devices()}", flush=True)
    if a.check:
        for dt in (jnp.bfloat16, jnp.float32):
            check(dt, a.page_size)
    kv_dtype = jnp.dtype(KV_CACHE_DTYPES[a.kv_cache_dtype] or jnp.bfloat16)
    configs = [parse_config(c) for c in a.configs.split(";")] if a.configs else [None]
    rows = []
    hdr = f"{'mode':8}{'B':>5}{'ctx':>7}  {'config':24}{'µs':>10}{'KV TB/s':>9}{'TFLOP/s':>9}{'bundled':>10}"
    print(hdr, flush=True)
    for mode in a.mode.split(","):
        for b in (int(x) for x in a.batch.split(",")):
            for ctx in (int(x) for x in a.ctx.split(",")):
                q_lens, kv_lens = workload(mode, b, ctx)
                kv_bytes, flops = counts(q_lens, kv_lens, itemsize=jnp.dtype(kv_dtype).itemsize)
                if sum(q_lens) > a.max_tokens or kv_bytes / 1e9 > a.max_kv_gb:
                    continue
                args = make_batch(jax.random.key(b * 7 + ctx), q_lens, kv_lens, page_size=a.page_size,
                                  dtype=jnp.bfloat16, kv_dtype=kv_dtype, page_order=a.page_order,
                                  num_tokens=bucket(sum(q_lens), token_buckets),
                                  num_seqs=bucket(len(q_lens), seq_buckets), max_model_len=a.max_model_len)
                rests = rotated(args, kv_bytes)
                bundled_us = None
                # the bundled kernel on the same rotated caches, K/V split per copy (bf16, unpadded shapes only)
                padded = a.token_buckets or a.seq_buckets or a.max_model_len
                if mode == "decode" and not a.no_bundled and kv_dtype == jnp.bfloat16 and not padded:
                    fn, bargs = bundled_decode(args[0], args[1], args[2], args[3], a.page_size)
                    brests = [bundled_decode(args[0], r[0], args[2], args[3], a.page_size)[1][1:] for r in rests]
                    bundled_us = timed(fn, bargs, a.calls, rests=brests)
                for cfg in configs:
                    if cfg == "triton":  # the Triton kernel as its own table runs it (off Hopper)
                        fn = functools.partial(gpu_kernel.ragged_paged_attention_gpu, sm_scale=D**-0.5)
                    else:
                        fn = functools.partial(ragged_paged_attention, sm_scale=D**-0.5, impl=a.impl, config=cfg)
                    try:
                        us = timed(fn, args, a.calls, rests=rests)
                    except Exception as e:  # a config that does not compile is reported, not fatal
                        print(f"{mode:8}{b:>5}{ctx:>7}  {str(cfg):24} failed: {type(e).__name__}: {e}"[:300])
                        continue
                    name = "table" if cfg is None else cfg if isinstance(cfg, str) else config_name(cfg)
                    row = dict(mode=mode, batch=b, ctx=ctx, config=name, us=us, kv_tb_s=kv_bytes / us / 1e6,
                               tflop_s=flops / us / 1e6, bundled_us=bundled_us)
                    rows.append(row)
                    ratio = f"{bundled_us / us:9.2f}x" if bundled_us else ""
                    print(f"{mode:8}{b:>5}{ctx:>7}  {name:24}{us:10.1f}{row['kv_tb_s']:9.2f}"
                          f"{row['tflop_s']:9.1f}{ratio:>10}", flush=True)
                    profiled = transposed_config(cfg, args, a.page_size) if a.region_profile else None
                    if profiled is not None and mode == "decode":
                        row["regions"] = profile_regions(fn, args, profiled, a.region_profile)
                        print_regions(row["regions"])
                if bundled_us:
                    print(f"{'':8}{'':>5}{'':>7}  {'bundled paged_attention':24}{bundled_us:10.1f}"
                          f"{kv_bytes / bundled_us / 1e6:9.2f}", flush=True)
                if a.write_kv:
                    n_new = sum(q_lens)
                    rests = None  # the copies' memory goes back before the cache is written
                    written = n_new * HKV * D * 2 * kv_dtype.itemsize
                    impls = [("reference", "rope+write XLA")]
                    if jax.default_backend() == "gpu":
                        impls.insert(0, ("gpu", "rope+write Pallas"))
                    for impl, label in impls:
                        us, cache = bench_write_kv(args[1], n_new, a.calls, impl=impl)
                        args = (args[0], cache, *args[2:])
                        rows.append(dict(mode=mode, batch=b, ctx=ctx, config=label, us=us,
                                         write_gb_s=written / us / 1e3))
                        print(f"{'':8}{'':>5}{'':>7}  {label + ' (' + str(n_new) + ' tokens)':36}{us:10.1f}"
                              f"  {written / us / 1e3:.1f} GB/s of K/V written", flush=True)
                if mode == "prefill" and b == 1 and a.anchors:
                    for name, us in dense_anchors(ctx, a.calls, timed).items():
                        rows.append(dict(mode=mode, batch=b, ctx=ctx, config=name, us=us, tflop_s=flops / us / 1e6))
                        print(f"{'':8}{'':>5}{'':>7}  {name[:36]:36}{us:10.1f}{'':9}{flops / us / 1e6:9.1f}",
                              flush=True)
                del args, rests
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
