"""Online serving against `jengine serve` over HTTP (vLLM's benchmark_serving): streaming completions.

    python benchmarks/serving.py --launch-server --model jengine/llama-3.1-8b --request-rate 16 \\
        --num-prompts 1000 --input-len 512 --output-len 256 --max-num-seqs 256
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rate inf --dataset chat-like

Requests arrive as a Poisson process at --request-rate (inf: all at once), at most --max-concurrency in
flight; several --max-concurrency values run the same request lengths once per value against one server
(a sweep: one summary each, and with --plot a throughput / latency vs concurrency PNG beside the CDFs),
each value with other prompt tokens, so that the server's prefix cache holds none of them. A second run
with the same --seed sends the same prompts again, and the prefix cache then skips their prefill: each
run reports `prefix_cache_hit_rate` (prompt tokens found / looked up, from the server's /metrics).
Each asks for its output length with ignore_eos, streams, and also asks for logprobs=0 so every
token produces a chunk even for models without a tokenizer (the dummy presets). Reports TTFT, TPOT
(per request: (latency - TTFT) / (tokens - 1)), ITL (gaps between chunks), E2E: mean / p50 / p99, request
throughput, output tok/s and goodput (requests/s meeting every --goodput SLO, e.g. ttft:500 tpot:50).
Flags this program does not know are passed to `jengine serve` when --launch-server is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
from common import (
    add_dataset_flags,
    environment,
    make_requests,
    model_shape,
    percentiles,
    positive_float,
    positive_int,
    print_table,
    write_json,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(model: str, port: int, extra: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    """Start `jengine serve` as a child process and wait until /health answers; (process, log path)."""
    import httpx

    log = tempfile.NamedTemporaryFile("w", prefix="jengine-serve-", suffix=".log", delete=False)
    # -P: the installed jengine, not a `jengine/` directory in the working directory (the repo root holds
    # one without the packages the install maps in, e.g. jengine.kernels_pallas)
    cmd = [sys.executable, "-P", "-m", "jengine.cli", "serve", model, "--port", str(port), "--uvicorn-log-level",
           "warning", *extra]
    print("launching: " + " ".join(cmd) + f"  (log: {log.name})")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"jengine serve exited with {proc.returncode}:\n" + open(log.name).read()[-4000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                print(f"server ready after {time.perf_counter() - t0:.1f}s")
                return proc, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"jengine serve did not answer /health within {timeout}s; log: {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client, url: str, payload: dict) -> dict:
    """Stream one completion; token arrival times and counts."""
    start = time.perf_counter()
    times, counts, usage, error = [], [], None, None
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = str(chunk["error"])
                        continue
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        lp = choice.get("logprobs")
                        n = len(lp["tokens"]) if lp and lp.get("tokens") is not None else int(bool(choice["text"]))
                        if n:
                            times.append(time.perf_counter())
                            counts.append(n)
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        error = repr(e)
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else sum(counts)
    return {"ok": error is None and bool(times), "error": error, "latency": end - start, "tokens": tokens,
            "ttft": times[0] - start if times else None, "itl": np.diff(times).tolist() if times else []}


def prefix_cache_counters(base_url: str) -> tuple[float, float] | None:
    """(prompt tokens looked up, found) in the server's prefix cache, from its /metrics; None without them."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    totals = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    names = ("jengine:prefix_cache_queries_total", "jengine:prefix_cache_hits_total")
    return tuple(totals[n] for n in names) if all(n in totals for n in names) else None


def prefix_hit_rate(before, after) -> float | None:
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between `n` request arrivals at `rate` req/s on average: gamma-distributed with shape
    `burstiness` (1: exponential, a Poisson process; below 1 burstier, above 1 more even), as vLLM's
    benchmark draws them; all zero at an infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    if burstiness == 1.0:
        return rng.exponential(1.0 / rate, n).tolist()
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), n).tolist()


async def run_load(url: str, payloads: list[dict], rate: float, max_concurrency: int | None, seed: int,
                   burstiness: float = 1.0):
    import httpx

    gaps = arrival_gaps(len(payloads), rate, burstiness, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(client, payload):
        if semaphore is None:
            return await one_request(client, url, payload)
        async with semaphore:
            return await one_request(client, url, payload)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        # warm-up (connection, first request) on a one-token prompt, which leaves nothing in the prefix cache
        await one_request(client, url, {**payloads[0], "prompt": payloads[0]["prompt"][:1], "max_tokens": 4})
        tasks = []
        start = time.perf_counter()
        for payload, gap in zip(payloads, gaps):
            tasks.append(asyncio.create_task(limited(client, payload)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slos[name] = float(value) / 1e3
    return slos


def summarise(results: list[dict], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r["ok"]]
    for r in ok:
        r["tpot"] = (r["latency"] - r["ttft"]) / (r["tokens"] - 1) if r["tokens"] > 1 else None
    good = [r for r in ok if all((r["latency"] if k == "e2el" else r[k] or 0.0) <= v for k, v in slos.items())]
    out_tokens = sum(r["tokens"] for r in ok)
    summary = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
               "request_throughput": len(ok) / duration, "output_tok_s": out_tokens / duration,
               "goodput_req_s": len(good) / duration if slos else None, "output_tokens": out_tokens}
    summary.update(percentiles([r["ttft"] for r in ok], "ttft"))
    summary.update(percentiles([r["tpot"] for r in ok if r["tpot"] is not None], "tpot"))
    summary.update(percentiles([x for r in ok for x in r["itl"]], "itl"))
    summary.update(percentiles([r["latency"] for r in ok], "e2el"))
    return summary


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(runs: list[tuple[str, list[dict]]], path: str, title: str) -> None:
    """TTFT / TPOT / ITL CDFs, one curve per (label, results) run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, results in runs:
        ok = [r for r in results if r["ok"]]
        series = {"TTFT": [r["ttft"] for r in ok], "TPOT": [r["tpot"] for r in ok if r["tpot"] is not None],
                  "ITL": [x for r in ok for x in r["itl"]]}
        for ax, (name, values) in zip(axes, series.items()):
            v = np.sort(np.asarray(values) * 1e3)
            ax.plot(v, np.arange(1, len(v) + 1) / max(1, len(v)), label=label)
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of tokens")
            ax.grid(True, alpha=0.3)
    if len(runs) > 1:
        axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def plot_sweep(sweep: list[dict], path: str, title: str) -> None:
    """Output tok/s and mean / p99 TPOT and TTFT against the concurrency cap."""
    plt = _pyplot()
    x = [row["max_concurrency"] for row in sweep]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(x, [row["output_tok_s"] for row in sweep], marker="o")
    axes[0].set_ylabel("output tok/s")
    for ax, metric in zip(axes[1:], ("tpot", "ttft")):
        for stat in ("mean", "p99"):
            ax.plot(x, [row[f"{metric}_{stat}_ms"] for row in sweep], marker="o", label=stat)
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="jengine/llama-3.1-8b", help="served model (and the server's MODEL)")
    parser.add_argument("--base-url", default=None, help="a running server (default http://127.0.0.1:--port)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--launch-server", action="store_true", help="start `jengine serve` here (on a free port)")
    parser.add_argument("--server-timeout", type=positive_float, default=1800, help="seconds to wait for /health")
    parser.add_argument("--max-model-len", type=positive_int, default=2048,
                        help="clips chat-like lengths, bounds sharegpt's")
    add_dataset_flags(parser, num_prompts=1000, input_len=512, output_len=256)
    parser.add_argument("--request-rate", type=positive_float, default=float("inf"),
                        help="req/s on average; inf = all at once")
    parser.add_argument("--burstiness", type=positive_float, default=1.0,
                        help="arrivals' gamma shape at --request-rate: 1 Poisson, below 1 burstier, above 1 more even")
    parser.add_argument("--max-concurrency", type=positive_int, nargs="+", default=None,
                        help="requests in flight at most; several values: one run each (a sweep)")
    parser.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--no-token-logprobs", dest="token_logprobs", action="store_false",
                        help="do not ask for logprobs=0 (then chunks follow text deltas only)")
    parser.add_argument("--plot", default=None, help="write TTFT/TPOT/ITL CDFs to this PNG (matplotlib); "
                        "a sweep also writes <name>_sweep.png")
    parser.add_argument("--output-json", default=None)
    args, server_args = parser.parse_known_args(argv)
    slos = parse_goodput(args.goodput)
    if args.burstiness == float("inf"):
        parser.error("--burstiness must be finite (a gamma shape), got inf")
    caps = args.max_concurrency or [None]
    if any(c is not None and c < 1 for c in caps):
        parser.error(f"--max-concurrency values must be positive integers, got {args.max_concurrency}")

    try:  # every point's prompts, before a server starts
        requests = [make_requests(args, model_shape(args.model)["vocab"], variant) for variant in range(len(caps))]
    except ValueError as e:
        parser.error(str(e))

    proc = None
    if args.launch_server:
        args.port = free_port() if args.base_url is None else args.port
        if "--max-model-len" not in server_args:
            server_args += ["--max-model-len", str(args.max_model_len)]
        proc, _ = launch_server(args.model, args.port, server_args, args.server_timeout)
    elif server_args:
        parser.error(f"unrecognized arguments: {' '.join(server_args)} (engine flags need --launch-server)")
    base_url = args.base_url or f"http://127.0.0.1:{args.port}"
    url = base_url + args.endpoint
    try:
        runs = []
        for variant, cap in enumerate(caps):  # each point of a sweep sends prompts the server has not seen
            payloads = [{"model": args.model, "prompt": p, "max_tokens": o, "ignore_eos": True, "temperature": 0.0,
                         "stream": True, "stream_options": {"include_usage": True},
                         **({"logprobs": 0, "return_tokens_as_token_ids": True} if args.token_logprobs else {})}
                        for p, o in requests[variant]]
            print(f"{len(payloads)} requests ({args.dataset}), rate {args.request_rate} req/s "
                  f"(burstiness {args.burstiness}), "
                  f"max concurrency {cap or 'unlimited'} -> {url}")
            before = prefix_cache_counters(base_url)
            results, duration = asyncio.run(run_load(url, payloads, args.request_rate, cap, args.seed,
                                                     args.burstiness))
            runs.append((cap, results, duration, prefix_hit_rate(before, prefix_cache_counters(base_url))))
    finally:
        if proc is not None:
            stop_server(proc)
    sweep = []
    for cap, results, duration, hit_rate in runs:
        summary = summarise(results, duration, slos)
        sweep.append({"max_concurrency": cap, **summary, "prefix_cache_hit_rate": hit_rate})
        if hit_rate is not None and hit_rate > 0.05:
            print(f"note: the server's prefix cache held {hit_rate:.0%} of the prompt tokens (it has seen these "
                  "prompts: an earlier run with this --seed); prefill was skipped for them")
        errors = [r["error"] for r in results if not r["ok"]]
        if errors:
            print(f"{len(errors)} requests failed, first: {errors[0]}")
        print(f"max concurrency {cap or 'unlimited'}: duration {duration:.2f}s: "
              f"{summary['request_throughput']:.2f} req/s, {summary['output_tok_s']:.0f} output tok/s" +
              (f", goodput {summary['goodput_req_s']:.2f} req/s" if slos else ""))
        print_table([{"metric": m, **{k: summary[f"{m}_{k}_ms"] for k in ("mean", "p50", "p99", "max")}}
                     for m in ("ttft", "tpot", "itl", "e2el")], ["metric", "mean", "p50", "p99", "max"])
    if not any(r["ok"] for _, results, *_ in runs for r in results):
        first = next((r["error"] for _, results, *_ in runs for r in results), "no requests")
        raise SystemExit(f"serving.py: every request failed (first: {first}); is a server answering at {url}?")
    if args.plot:
        title = f"{args.model}, rate {args.request_rate}, {len(payloads)} requests"
        plot_cdfs([(f"concurrency {cap or 'unlimited'}", results) for cap, results, *_ in runs], args.plot, title)
        if len(runs) > 1:
            plot_sweep(sweep, os.path.splitext(args.plot)[0] + "_sweep.png", title)
    last_results = runs[-1][1]
    payload = {"env": environment(), "args": {**vars(args), "server_args": server_args}, "result": sweep[-1],
               "sweep": sweep if len(sweep) > 1 else None,
               "requests": [{k: r[k] for k in ("ok", "latency", "ttft", "tokens")} for r in last_results]}
    write_json(args.output_json, payload)
    return payload


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
