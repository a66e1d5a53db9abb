"""Prometheus metrics mirroring vLLM's (`vllm:` names with a `jengine:` prefix).

`EngineMetrics.record(engine, outputs)` is the `AsyncLLM` stat logger: it runs on the engine thread
after every iteration, sets the gauges from the scheduler (a `snapshot`, taken in the engine's own
process), advances the counters by what changed since the previous call and observes the latency
histograms of the requests that finished. With data-parallel replicas the gauges and counters are
summed over the replicas (KV usage is their mean) and `jengine:engine_generation_tokens{engine="i"}`
shows how the work spread.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jengine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_FINISH_REASONS = ("stop", "length", "abort")


class EngineMetrics:
    """The metric families of one served model, in their own registry (several can live in a process)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r, m = self.registry, {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(**m)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(**m)

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**m)

        self.running = gauge("jengine:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("jengine:num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("jengine:num_requests_swapped", "Requests whose KV cache is swapped to host memory.")
        self.kv_usage = gauge("jengine:kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full).")
        self.prefix_queries = counter("jengine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("jengine:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("jengine:num_preemptions", "Requests preempted (recompute or swap).")
        self.prompt_tokens = counter("jengine:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("jengine:generation_tokens", "Generated tokens.")
        finished = Counter("jengine:request_success", "Finished requests by finish reason.",
                           ["model_name", "finished_reason"], registry=r)
        self.finished = {reason: finished.labels(model_name=model_name, finished_reason=reason)
                         for reason in _FINISH_REASONS}
        self.ttft = hist("jengine:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = hist("jengine:time_per_output_token_seconds", "Time per output token after the first.",
                         _LATENCY_BUCKETS)
        self.e2e = hist("jengine:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue_time = hist("jengine:request_queue_time_seconds", "Time from arrival to first scheduling.",
                               _LATENCY_BUCKETS)
        self.engine_generation_tokens = Counter(
            "jengine:engine_generation_tokens", "Generated tokens per engine (data-parallel replica).",
            ["model_name", "engine"], registry=r)
        self._model_name = model_name
        self.iteration_tokens = hist("jengine:iteration_tokens_total", "Tokens computed per engine iteration.",
                                     _TOKEN_BUCKETS)
        self._last: dict[str, float] = {}

    def _advance(self, counter, key: str, value: float) -> float:
        delta = value - self._last.get(key, 0)
        self._last[key] = value
        if delta > 0:
            counter.inc(delta)
        return delta

    def record(self, engine, outputs: list[RequestOutput]) -> None:
        s = snapshot(engine)
        if s is not None:  # None: an engine in another process that has not stepped yet
            self._record_engine(s, bool(outputs))
        for out in outputs:
            if out.finished:
                self.record_finished(out)

    def _record_engine(self, s: dict, stepped: bool) -> None:
        self.running.set(s["num_requests_running"])
        self.waiting.set(s["num_requests_waiting"])
        self.swapped.set(s["num_requests_swapped"])
        self.kv_usage.set(s["kv_cache_usage_perc"])
        self._advance(self.prefix_queries, "prefix_cache_queries", s["prefix_cache_queries"])
        self._advance(self.prefix_hits, "prefix_cache_hits", s["prefix_cache_hits"])
        self._advance(self.preemptions, "num_preemptions", s["num_preemptions"])
        st = s["stats"]
        self._advance(self.prompt_tokens, "prompt_tokens", st["prompt_tokens"])
        generated = self._advance(self.generation_tokens, "generation_tokens", st["generation_tokens"])
        for i, tokens in enumerate(s["replica_generation_tokens"]):
            self._advance(self.engine_generation_tokens.labels(model_name=self._model_name, engine=str(i)),
                          f"generation_tokens/{i}", tokens)
        prefill = st["computed_prompt_tokens"] - self._last.get("computed_prompt_tokens", 0)
        self._last["computed_prompt_tokens"] = st["computed_prompt_tokens"]
        if stepped:
            self.iteration_tokens.observe(generated + prefill)

    def record_finished(self, out: RequestOutput) -> None:
        for o in out.outputs:
            if o.finish_reason in self.finished:
                self.finished[o.finish_reason].inc()
        m = out.metrics
        if m.finished_time is None:
            return
        self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            num_tokens = max(len(o.token_ids) for o in out.outputs)
            if num_tokens > 1:
                self.tpot.observe(max(0.0, m.finished_time - m.first_token_time) / (num_tokens - 1))

    def record_aborted(self, count: int = 1) -> None:
        self.finished["abort"].inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def snapshot(engine) -> dict | None:
    """What `EngineMetrics.record` reads of an engine: its scheduler's stats (several replicas' summed,
    KV cache usage averaged), its `stats` counters and each replica's generated tokens. An engine in
    another process hands over the one its process made (`metrics_snapshot()`)."""
    own = getattr(engine, "metrics_snapshot", None)
    if own is not None:
        return own()
    replicas = getattr(engine, "replicas", None)
    if replicas:
        return merge_snapshots([snapshot(r) for r in replicas])
    return {**engine.scheduler.stats(), "stats": dict(engine.stats),
            "replica_generation_tokens": [engine.stats["generation_tokens"]]}


def merge_snapshots(snapshots: list[dict | None]) -> dict | None:
    """Several replicas' snapshots as one: counts summed, KV cache usage averaged, generated tokens
    listed per replica. A replica without one yet (it has not stepped) counts as zeros; None if none has."""
    known = [s for s in snapshots if s is not None]
    if not known:
        return None
    zero = {key: 0 for key in known[0] if key not in ("stats", "replica_generation_tokens")}
    zero.update(stats=dict.fromkeys(known[0]["stats"], 0), replica_generation_tokens=[0])
    snapshots = [zero if s is None else s for s in snapshots]
    total = {key: sum(s[key] for s in snapshots) for key in zero if key not in ("stats", "replica_generation_tokens")}
    total["kv_cache_usage_perc"] /= len(snapshots)
    total["stats"] = {key: sum(s["stats"][key] for s in snapshots) for key in zero["stats"]}
    total["replica_generation_tokens"] = [t for s in snapshots for t in s["replica_generation_tokens"]]
    return total
