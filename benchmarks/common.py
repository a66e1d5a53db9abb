"""Shared pieces of the benchmark programs: engine flags, random prompts, bounds, JSON output."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.engine_config import KV_CACHE_DTYPES, PAGE_SIZES
from jengine.quantization import QUANTIZATIONS

H200_COPY_BW = 4.3e12  # bytes/s, measured device copy ceiling (shared/BENCHMARKS.md)


def add_engine_flags(parser: argparse.ArgumentParser, prefill_first_default: str = "the offline LLM's, on") -> None:
    parser.add_argument("--model", default="jengine/llama-3.1-8b", help="model dir or preset (dummy weights)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES))
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--max-model-len", type=positive_int, default=2048)
    parser.add_argument("--max-num-seqs", type=positive_int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--block-size", type=int, default=None, choices=PAGE_SIZES,
                        help="tokens per KV page (default: the engine's)")
    parser.add_argument("--token-buckets", type=positive_int, nargs="+", default=None)
    parser.add_argument("--seq-buckets", type=positive_int, nargs="+", default=None)
    parser.add_argument("--gpu-memory-utilization", type=positive_float, default=0.9)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--prefill-first", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine's prefill_first: prompt-only steps while prompts fill a step (default: "
                             f"{prefill_first_default})")
    parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1)
    parser.add_argument("--compilation-cache-dir", default=None,
                        help="JAX's and jengine's compile caches (default: the engine's); 'none' compiles afresh")
    parser.add_argument("--output-json", default=None)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab - 100, size=(n, length)).tolist()


def streamed_weight_bytes(params: dict) -> int:
    """Bytes a decode step reads from weights: everything but the embedding table (gathered)."""
    return sum(int(v.size) * v.dtype.itemsize for k, v in params.items() if k != "embed")


def environment(use_jax: bool = True) -> dict:
    """Where a result was measured. use_jax=False (transformers-only runs) leaves the JAX client unstarted,
    so it never preallocates device memory next to torch."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    env = {"host": platform.node(), "commit": commit}
    if use_jax:
        env.update(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), jax=jax.__version__)
    return env


def hf_in_child(script: str, argv: list[str] | None) -> list[dict]:
    """Run `script` with --backend hf in a child process and return its result rows.

    transformers gets its own process: JAX preallocates most of the device memory once its client starts,
    so torch could not allocate beside it. Call this before anything here touches JAX.
    """
    import os
    import sys
    import tempfile

    rest = child_argv(argv, drop=("--backend", "--output-json"))
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        subprocess.run([sys.executable, script, *rest, "--backend", "hf", "--output-json", out], check=True)
        with open(out) as f:
            return json.load(f)["results"]
    finally:
        os.unlink(out)


def child_argv(argv: list[str] | None, drop: tuple[str, ...] = ("--output-json",)) -> list[str]:
    """This process's arguments (`sys.argv` when `argv` is None) less the `drop` flags with their values
    (`--flag value` or `--flag=value`), to hand to a child process (e.g. only the parent writes the JSON)."""
    import sys

    rest, skip = [], False
    for a in list(sys.argv[1:] if argv is None else argv):
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif not a.startswith(tuple(f"{flag}=" for flag in drop)):
            rest.append(a)
    return rest


def run_marked_child(cmd: list[str], mark: str, timeout: float) -> dict:
    """Run `cmd` and return the JSON its stdout printed after `mark` on one line; a child that fails or
    prints no such line stops the benchmark with the tails of its output."""
    import os

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith(mark)), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len(mark):])


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


def save_results(args, results, use_jax: bool = True, **extra) -> dict:
    """A benchmark's JSON payload (environment, arguments, result rows and `extra` keys), written to
    `--output-json` when given and returned."""
    payload = {"env": environment(use_jax=use_jax), "args": vars(args), "results": results, **extra}
    write_json(args.output_json, payload)
    return payload


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (inf allowed)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def bench(fn, args, calls, reps=5, rests=None, compiler_options=None):
    """Median µs per call of `fn(q, *rest)`, net of a program's fixed cost.

    Programs holding `calls` and `2 * calls` calls on distinct copies of q (so XLA cannot merge them)
    are timed, and the difference is divided by the `calls` extra calls. Dividing one program's time
    by its calls instead spreads the program's launch and synchronisation (~1 ms) over them, which
    made short decode kernels look twice as slow as in the engine's trace (RESULTS.md, session 4).
    `compiler_options`: XLA options for the timed programs (as `jax.jit` takes them).
    `rests`: alternatives for `args[1:]` that successive calls cycle through (e.g. copies of a cache
    or weight larger together than L2, so that calls do not read what the previous one left there).
    """
    q = args[0]
    rests = rests or [args[1:]]

    def seconds(n):
        qs = [(q.astype(jnp.float32) * (1.0 + 1e-3 * i)).astype(q.dtype) for i in range(n)]
        many = jax.jit(lambda qs, rests: [fn(x, *rests[i % len(rests)]) for i, x in enumerate(qs)],
                       compiler_options=compiler_options)
        jax.block_until_ready(many(qs, rests))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(many(qs, rests))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return net_us_per_call(seconds, calls)


def net_us_per_call(seconds, calls: int) -> float:
    """µs per call from `seconds(n)`, the time of a program holding n calls: the difference between
    2 * calls and calls, per extra call (nan, with a warning, when the clock cannot see it)."""
    extra = seconds(2 * calls) - seconds(calls)
    if extra <= 0:  # the calls are too short for the clock: raise --calls
        print(f"warning: {calls} more calls took no measurable time; reported as nan (raise --calls)", flush=True)
        return float("nan")
    return extra / calls * 1e6


# ---------------------------------------------------------------- shared by the newer programs

H200_BF16_FLOPS = 790e12  # FLOP/s, measured dense bf16 matmul ceiling (shared/BENCHMARKS.md)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

# ShareGPT-like lengths: lognormal input / output token counts (medians near the ShareGPT-V3 figures
# vLLM's scripts sample: prompts ~ 250 tokens with a long tail, replies ~ 200 tokens), seeded and fixed.
CHAT_INPUT_MEDIAN, CHAT_INPUT_SIGMA = 256, 1.0
CHAT_OUTPUT_MEDIAN, CHAT_OUTPUT_SIGMA = 192, 0.8
CHAT_MIN_LEN, CHAT_MAX_OUTPUT = 4, 1024


def engine_args(args, **overrides) -> dict:
    """LLM keyword arguments from the common flags, `overrides` winning (None values dropped, except an
    explicit `compilation_cache_dir=None`: no caches)."""
    kw = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, load_format=args.load_format,
              quantization=getattr(args, "quantization", None),
              max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size,
              token_buckets=tuple(args.token_buckets) if args.token_buckets else None,
              seq_buckets=tuple(args.seq_buckets) if args.seq_buckets else None,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
              prefill_first=args.prefill_first, tensor_parallel_size=args.tensor_parallel_size)
    kw.update(overrides)
    kw = {k: v for k, v in kw.items() if v is not None}
    cache_dir = getattr(args, "compilation_cache_dir", None)
    if "compilation_cache_dir" in overrides:
        kw["compilation_cache_dir"] = overrides["compilation_cache_dir"]
    elif cache_dir is not None:
        kw["compilation_cache_dir"] = None if cache_dir.lower() == "none" else cache_dir
    return kw


def build_llm(args, label: str = "", **overrides):
    """The engine under test, built from the common flags, with per-run overrides (prefix caching
    on/off, chunked prefill on/off, cache dir); prints start-up time and KV capacity."""
    from jengine import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, use_tqdm_on_load=False, **engine_args(args, **overrides))
    if getattr(args, "prefill_first", False) is None:  # the JSON's args record what the engine ran
        args.prefill_first = llm.engine.config.prefill_first
    mem = getattr(llm.engine, "kv_cache_memory", None)
    share = "" if mem is None else (f" = {mem['kv_bytes'] / 2**30:.1f} GiB, {100 * mem['kv_fraction_of_free']:.1f}% of "
                                    f"the {mem['free_after_weights'] / 2**30:.1f} GiB free after the weights")
    print(f"{label}start-up {time.perf_counter() - t0:.1f}s ({llm.engine.num_compiled_buckets} buckets), "
          f"KV cache {llm.engine.kv_cache_tokens} tokens{share}; prefill_first {llm.engine.config.prefill_first}")
    return llm


def release(llm) -> None:
    """Drop an engine so the next one gets the device memory (two engines never fit side by side)."""
    import gc

    del llm.engine
    gc.collect()


def chat_like_lengths(n: int, max_model_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """(input, output) token counts drawn from the fixed ShareGPT-like distribution, fitting max_model_len."""
    rng = np.random.default_rng(seed)
    out = np.exp(rng.normal(np.log(CHAT_OUTPUT_MEDIAN), CHAT_OUTPUT_SIGMA, n))
    inp = np.exp(rng.normal(np.log(CHAT_INPUT_MEDIAN), CHAT_INPUT_SIGMA, n))
    out = np.clip(out.astype(int), CHAT_MIN_LEN, min(CHAT_MAX_OUTPUT, max_model_len // 2))
    inp = np.clip(inp.astype(int), CHAT_MIN_LEN, max_model_len - out)
    return list(zip(inp.tolist(), out.tolist()))


DATASETS = ("random", "chat-like", "sharegpt")
SHAREGPT_MIN_LEN = 4  # prompts and replies shorter than this many tokens are skipped, as vLLM's benchmarks do


def add_dataset_flags(parser: argparse.ArgumentParser, num_prompts: int, input_len: int, output_len: int) -> None:
    parser.add_argument("--dataset", default="random", choices=DATASETS,
                        help="random: fixed lengths; chat-like: seeded ShareGPT-like lognormal lengths; sharegpt: "
                             "the first exchanges of a ShareGPT JSON file (--dataset-path), tokenized with the "
                             "model's tokenizer")
    parser.add_argument("--dataset-path", default=None,
                        help="sharegpt only: a JSON list of {\"conversations\": [{\"from\", \"value\"}, ...]}")
    parser.add_argument("--sharegpt-output-len", type=positive_int, default=None,
                        help="sharegpt only: every output this long instead of its reply's token count")
    parser.add_argument("--num-prompts", type=positive_int, default=num_prompts)
    parser.add_argument("--input-len", type=positive_int, default=input_len, help="random dataset only")
    parser.add_argument("--output-len", type=positive_int, default=output_len, help="random dataset only")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random dataset only: each request's input and output lengths drawn uniformly from "
                             "[len * (1 - r), len * (1 + r)] (vLLM's), r in [0, 1); 0: fixed lengths")
    parser.add_argument("--random-prefix-len", type=non_negative_int, default=0,
                        help="random dataset only: this many tokens shared by every prompt, before its own "
                             "--input-len (vLLM's)")
    parser.add_argument("--seed", type=int, default=0)


def make_requests(args, vocab: int, variant: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request for --dataset. Another `variant` keeps the lengths
    and draws other tokens, so a server's prefix cache holds none of an earlier variant's prompts (sharegpt:
    another shuffle of the file, which may repeat conversations an earlier variant sent). ValueError for a
    dataset flag or file that cannot make the requests."""
    sharegpt_only = [f for f, v in (("--dataset-path", args.dataset_path),
                                    ("--sharegpt-output-len", args.sharegpt_output_len)) if v is not None]
    if args.dataset != "sharegpt" and sharegpt_only:
        raise ValueError(f"{' and '.join(sharegpt_only)} need --dataset sharegpt, got --dataset {args.dataset}")
    random_only = [f for f, v in (("--random-range-ratio", args.random_range_ratio),
                                  ("--random-prefix-len", args.random_prefix_len)) if v]
    if args.dataset != "random" and random_only:
        raise ValueError(f"{' and '.join(random_only)} need --dataset random, got --dataset {args.dataset}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.dataset == "sharegpt":
        return sharegpt_requests(args.dataset_path, args.model, args.num_prompts, args.max_model_len,
                                 args.sharegpt_output_len, args.seed + variant)
    rng = np.random.default_rng([args.seed + 1, variant] if variant else args.seed + 1)
    if args.dataset == "chat-like":
        return [(rng.integers(100, vocab - 100, size=i).tolist(), o)
                for i, o in chat_like_lengths(args.num_prompts, args.max_model_len, args.seed)]
    lengths = random_lengths(args.num_prompts, args.input_len, args.output_len, args.random_range_ratio, args.seed)
    longest = args.random_prefix_len + max(i + o for i, o in lengths)
    if longest > args.max_model_len:
        raise ValueError(f"the random dataset's longest request ({args.random_prefix_len} prefix + input + output "
                         f"tokens = {longest}) exceeds --max-model-len {args.max_model_len}")
    prefix = np.random.default_rng([args.seed + 2, variant]).integers(100, vocab - 100, size=args.random_prefix_len)
    return [(prefix.tolist() + rng.integers(100, vocab - 100, size=i).tolist(), o) for i, o in lengths]


def random_lengths(n: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[tuple[int, int]]:
    """(input, output) token counts of the random dataset: `input_len` / `output_len`, or with `ratio` > 0 each
    drawn uniformly from [len * (1 - ratio), len * (1 + ratio)] (at least 1), seeded."""
    if ratio == 0:
        return [(input_len, output_len)] * n
    rng = np.random.default_rng([seed, 3])

    def draw(length):
        return rng.integers(max(1, int(length * (1 - ratio))), int(length * (1 + ratio)) + 1, size=n).tolist()

    return list(zip(draw(input_len), draw(output_len)))


def sharegpt_exchanges(path: str) -> list[tuple[str, str]]:
    """(first prompt, its reply) of each conversation of a ShareGPT JSON file that has both as text."""
    if not path:
        raise ValueError("--dataset sharegpt needs --dataset-path (a ShareGPT JSON file)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"--dataset-path {path!r}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset-path {path!r} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path!r}: expected a JSON list of conversations, got {type(data).__name__}")
    exchanges = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            prompt, reply = turns[0].get("value"), turns[1].get("value")
            if isinstance(prompt, str) and isinstance(reply, str):
                exchanges.append((prompt, reply))
    return exchanges


def sharegpt_requests(path: str, model: str, num_prompts: int, max_model_len: int, output_len: int | None = None,
                      seed: int = 0) -> list[tuple[list[int], int]]:
    """`num_prompts` requests from a ShareGPT file's first exchanges, in a seeded shuffle: the prompt's token ids
    (the model's tokenizer, with the special tokens it adds by default) and the reply's token count (or
    `output_len`); exchanges under `SHAREGPT_MIN_LEN` tokens either way or longer than `max_model_len` together
    are skipped."""
    from jengine.tokenizer import load_tokenizer

    exchanges = sharegpt_exchanges(path)
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"--dataset sharegpt needs the model's tokenizer, and {model!r} has none (a model "
                         "directory with one: benchmarks/bench_model_dir.py)")
    order = np.random.default_rng(seed).permutation(len(exchanges))
    requests = []
    for i in order:
        if len(requests) == num_prompts:
            break
        prompt, reply = exchanges[i]
        ids = tokenizer(prompt).input_ids
        out = output_len or len(tokenizer(reply, add_special_tokens=False).input_ids)
        if len(ids) >= SHAREGPT_MIN_LEN and out >= SHAREGPT_MIN_LEN and len(ids) + out <= max_model_len:
            requests.append((list(ids), out))
    if len(requests) < num_prompts:
        raise ValueError(f"--dataset-path {path!r}: {len(requests)} of its {len(exchanges)} exchanges fit "
                         f"(at least {SHAREGPT_MIN_LEN} tokens each way, at most --max-model-len {max_model_len} "
                         f"together), fewer than --num-prompts {num_prompts}")
    return requests


def model_shape(model: str) -> dict:
    """The reference shape numbers of a model directory or preset, read from its config.json."""
    import os

    from jengine.presets import resolve_model

    with open(os.path.join(resolve_model(model)[0], "config.json")) as f:
        cfg = json.load(f)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or hidden // hq
    per_layer = hidden * d * (2 * hq + 2 * hkv) + 3 * hidden * cfg["intermediate_size"] + 2 * hidden
    return {"config": cfg, "layers": layers, "hq": hq, "hkv": hkv, "head_dim": d, "vocab": cfg["vocab_size"],
            "layer_params": layers * per_layer + hidden, "head_params": cfg["vocab_size"] * hidden}


def roofline(model: str, lengths: list[tuple[int, int]], max_num_seqs: int, dtype_bytes: int = 2,
             flops: float = H200_BF16_FLOPS, bandwidth: float = H200_COPY_BW,
             kv_dtype_bytes: int | None = None) -> dict:
    """Lower bound on a workload's time: prefill at `flops`, decode streaming weights + KV at `bandwidth`.

    Prefill: 2 FLOPs per weight per prompt token (lm head once per request) + causal attention (QK and PV).
    Decode: each step streams all non-embedding weights once; steps >= output tokens / max_num_seqs; each
    decode token reads its whole context's K and V (`kv_dtype_bytes` per value; default dtype_bytes).
    """
    s = model_shape(model)
    attn = 4 * s["layers"] * s["hq"] * s["head_dim"]  # FLOPs per visible query-key pair
    kv_per_token = 2 * s["layers"] * s["hkv"] * s["head_dim"] * (kv_dtype_bytes or dtype_bytes)
    prompt = sum(i for i, _ in lengths)
    out = sum(o for _, o in lengths)
    prefill_flops = (2 * s["layer_params"] * prompt + 2 * s["head_params"] * len(lengths)
                     + attn * sum(i * (i + 1) / 2 for i, _ in lengths))
    steps = max(max(o for _, o in lengths), -(-out // max(1, min(max_num_seqs, len(lengths)))))
    weight_bytes = (s["layer_params"] + s["head_params"]) * dtype_bytes
    kv_bytes = kv_per_token * sum(o * i + o * (o - 1) / 2 for i, o in lengths)
    t_prefill, t_decode = prefill_flops / flops, (steps * weight_bytes + kv_bytes) / bandwidth
    return {"prefill_tflop": prefill_flops / 1e12, "decode_steps": steps,
            "decode_weight_gb": steps * weight_bytes / 1e9,
            "decode_kv_gb": kv_bytes / 1e9, "bound_s": t_prefill + t_decode, "prefill_bound_s": t_prefill,
            "decode_bound_s": t_decode, "peak_tflops": flops / 1e12, "peak_tb_s": bandwidth / 1e12,
            "bound_output_tok_s": out / (t_prefill + t_decode)}


def percentiles(values, name: str, unit_scale: float = 1e3) -> dict:
    """mean / p50 / p99 (/ max) of `values` (seconds) in ms, keyed `<name>_mean_ms` etc."""
    v = np.asarray(values, dtype=float) * unit_scale
    if v.size == 0:
        return {f"{name}_{k}_ms": None for k in ("mean", "p50", "p99", "max")}
    return {f"{name}_mean_ms": float(v.mean()), f"{name}_p50_ms": float(np.percentile(v, 50)),
            f"{name}_p99_ms": float(np.percentile(v, 99)), f"{name}_max_ms": float(v.max())}


def print_table(rows: list[dict], columns: list[str], fmt: str = "{:.2f}") -> None:
    """A fixed-width table of the given columns (missing -> '-')."""
    def cell(v):
        if v is None:
            return "-"
        return fmt.format(v) if isinstance(v, float) else str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))


class CompileCounter:
    """Counts programs built while active: `count` backend-compile events (the event tests/test_no_recompile.py
    listens to; it also fires for a program loaded from the persistent cache), `cache_hits` those loaded."""

    def __init__(self):
        self.count = 0
        self.cache_hits = 0

    def _listener(self, event, duration, **kwargs):
        if event == COMPILE_EVENT:
            self.count += 1

    def _hit_listener(self, event, **kwargs):
        if event == CACHE_HIT_EVENT:
            self.cache_hits += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        jax.monitoring.register_event_listener(self._hit_listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)
        jax.monitoring.unregister_event_listener(self._hit_listener)
