"""The engine in a process of its own (`jengine serve`'s default), as vLLM's V1 engine core runs.

In one process the HTTP side (one SSE chunk per request per step) and the engine loop share one GIL:
the engine's host work per step stretches while the event loop holds it. Here the child process runs
the engine loop (take the commands that came, step, send the step's outputs) and the server process
keeps only the HTTP side.

`EngineProcess` is the server's handle. To `AsyncLLM` it looks like an engine (`add_request`,
`abort_request`, `step`, `has_unfinished_requests`, `drain`, `embed`, `close`), and `AsyncLLM` drives it
from its engine thread as it drives an `LLMEngine`; every call is a message to the child, and `step()`
returns whatever outputs arrived (waiting at most `POLL_SECONDS`). A reader thread empties the child's
pipe all the time, so neither side can block the other with a full pipe.

On the wire, outputs are tuples (pickling 200 dataclass outputs cost ~10x more on a CPU: RESULTS.md,
session 29), their logprobs the engine's flat lists, and a request's prompt (text and token ids)
travels with its first output only. An error a request causes
(`add_request`'s validation) comes back as a `RequestError` among the outputs. If the child dies, the
next `step()` raises `EngineDeadError` and `AsyncLLM` fails every request.

CUMULATIVE outputs repeat everything each step, so they cost O(length) on the wire per step; the server
asks for DELTA (streams) or FINAL_ONLY outputs only.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from typing import Any

from jengine.outputs import CompletionOutput, RequestOutput
from jengine.request import RequestMetrics

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.002  # how long `step()` waits for outputs before the engine thread looks at its commands
_EOF = ("eof",)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an error inside a step, or shutdown); no request can be served."""


@dataclasses.dataclass
class RequestError:
    """In `step()`'s outputs: the request `request_id` was refused (its `error`, e.g. a ValueError)."""

    request_id: str
    error: BaseException


def build_serving_engine(config, progress: bool, devices=None) -> tuple[Any, int]:
    """The engine `jengine serve` runs (data-parallel replicas when asked; `devices`: one replica's
    group) with its embedding programs compiled; (engine, number of embedding programs)."""
    from jengine.data_parallel import build_engine
    from jengine.entrypoints import pooling

    # (a cold start's build helpers store the embedding programs beside the forwards)
    engine = build_engine(config, progress=progress, devices=devices, embedding_programs=True)
    replicas = getattr(engine, "replicas", [engine])
    for replica in replicas:  # the grammar compiler made while the embedding programs load, not at a request
        replica.prepare_structured_outputs()
    # /v1/embeddings must not compile while serving (data-parallel replicas embed on replica 0)
    return engine, pooling.warmup(replicas[0])


# ---------------------------------------------------------------------- the wire format of outputs

def _pack(out: RequestOutput, announced: set[str]) -> tuple:
    """`out` as plain values; the prompt only when `announced` has not seen the request yet."""
    rid = out.request_id
    prompt = None
    if rid not in announced:
        announced.add(rid)
        prompt = (out.prompt, out.prompt_token_ids)
    if out.finished:
        announced.discard(rid)
    m = out.metrics
    return (rid, out.finished, (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time),
            prompt, [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                      c.stop_reason) for c in out.outputs], out.prompt_logprobs)


def _unpack(packed: tuple, prompts: dict[str, tuple]) -> RequestOutput:
    rid, finished, times, prompt, outputs, prompt_logprobs = packed
    if prompt is not None:
        prompts[rid] = prompt
    text, ids = prompts.pop(rid) if finished else prompts[rid]
    return RequestOutput(rid, text, ids, [CompletionOutput(*c) for c in outputs], finished,
                         RequestMetrics(*times), prompt_logprobs)


def _portable(error: BaseException) -> BaseException:
    """`error` if it pickles, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


# ---------------------------------------------------------------------- the child

def _child_main(config, commands, events, progress: bool, with_stats: bool, log_level: int,
                replica: tuple[int, int] | None = None) -> None:
    # Ctrl-C in a terminal reaches this process too; the server drains its requests first and then stops
    # the engine (if the server dies, the pipe's end does). SIGTERM keeps its default: the server's exit
    # sends one to a child that is still starting (multiprocessing ends daemonic children so), and a
    # child that ignored it was waited for forever.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        devices = None
        if replica is not None:
            from jengine.engine_replicas import pin_replica

            devices = pin_replica(*replica)
        engine, programs = build_serving_engine(config, progress, devices)
        events.send(("ready", {"config": engine.config, "model_config": engine.model_config,
                               "sampling_defaults": engine.sampling_defaults,
                               "num_compiled_buckets": engine.num_compiled_buckets,
                               "startup_seconds": engine.startup_seconds, "kv_cache_tokens": engine.kv_cache_tokens,
                               "embedding_programs": programs}))
    except BaseException as e:  # noqa: BLE001 - the server reports it
        logger.exception("the engine could not start")
        events.send(("failed", _portable(e)))
        return
    try:
        _CoreLoop(engine, commands, events, with_stats).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the server is gone
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine loop failed")
        events.send(("dead", _portable(e)))


class _CoreLoop:
    def __init__(self, engine, commands, events, with_stats: bool):
        self.engine, self.commands, self.events, self.with_stats = engine, commands, events, with_stats
        self.announced: set[str] = set()  # requests whose prompt went out with an output

    def run(self) -> None:
        engine, commands = self.engine, self.commands
        while True:
            if not engine.has_unfinished_requests():
                commands.poll(None)  # idle: sleep until a command (or the server's end) comes
            while commands.poll():
                if not self._apply(commands.recv()):
                    engine.drain()
                    return
            if not engine.has_unfinished_requests() and self.with_stats:  # e.g. all aborted: gauges to 0
                self._send("stats", self._stats())
            if engine.has_unfinished_requests():
                outputs = engine.step()
                if outputs or self.with_stats:
                    self._send("step", [_pack(o, self.announced) for o in outputs], self._stats())

    def _stats(self) -> dict | None:
        if not self.with_stats:
            return None
        from jengine.metrics import snapshot

        return snapshot(self.engine)

    def _send(self, *message) -> None:
        self.events.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _apply(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, priority, arrival = cmd
            try:
                self.engine.add_request(rid, prompt, params, priority=priority, arrival_time=arrival)
            except Exception as e:  # the caller's error; the engine is fine
                self._send("error", rid, _portable(e))
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
            self.announced.discard(cmd[1])
        elif kind == "call":
            _, call_id, fn = cmd
            try:
                result, error = fn(self.engine), None
            except Exception as e:
                result, error = None, _portable(e)
            self._send("result", call_id, result, error)
        elif kind == "stop":
            return False
        return True


# ---------------------------------------------------------------------- the server's handle

class EngineProcess:
    """An engine (`build_serving_engine(config)`) in a child process, with an engine's interface.

    Every method but `metrics_snapshot` must be called from one thread (AsyncLLM's engine thread).
    `startup_timeout`: seconds to wait for the child's engine (None: as long as it takes). `replica`:
    (index, devices per replica) of one data-parallel replica (`jengine.engine_replicas`); `notify`: an
    event set whenever the child sends something."""

    def __init__(self, config, *, progress: bool = True, stats: bool = False, startup_timeout: float | None = None,
                 replica: tuple[int, int] | None = None, notify: threading.Event | None = None):
        t0 = time.perf_counter()
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this process's threads
        child_commands, self._commands = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        self._events_conn, child_events = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_child_main, name="jengine-engine-core", daemon=True,
                                    args=(config, child_commands, child_events, progress, stats,
                                          logging.getLogger().getEffectiveLevel(), replica))
        self._process.start()
        child_commands.close()
        child_events.close()
        self._dead: BaseException | None = None
        if not self._events_conn.poll(startup_timeout):
            self.close()
            raise TimeoutError(f"the engine did not start within {startup_timeout} s")
        try:
            kind, payload = self._events_conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"the engine process exited with {self._process.exitcode} while starting (its error "
                               "is in the log above; a spawned process re-imports the main script, which needs "
                               "an `if __name__ == '__main__':` guard and cannot come from stdin)") from None
        if kind == "failed":
            self._process.join(30)
            raise payload
        for key, value in payload.items():
            setattr(self, key, value)
        self.startup_seconds = time.perf_counter() - t0  # the child's own, plus starting the process
        # Each add gets an id of its own in the child, so that outputs of an aborted request still on the
        # way can never be taken for those of a later request under the same id.
        self._wire: dict[str, str] = {}  # request id -> its id in the child, while added and not ended
        self._caller: dict[str, str] = {}  # the reverse
        self._adds = itertools.count()
        self._prompts: dict[str, tuple] = {}  # id in the child -> (prompt, prompt token ids), from its first output
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._results: dict[int, tuple] = {}
        self._call_ids = itertools.count()
        self._snapshot: dict | None = None
        self._notify = notify
        self._held: list = []  # outputs that arrived during a `call`, for the next `step()`
        self._reader = threading.Thread(target=self._read, name="jengine-engine-events", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ the engine's interface

    @functools.cached_property
    def tokenizer(self):
        """A tokenizer of this process, loaded when first asked for (the server keeps its own)."""
        from jengine.tokenizer import load_tokenizer

        return load_tokenizer(self.config.model)

    def add_request(self, request_id: str, prompt, params=None, *, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        if request_id in self._wire:
            raise ValueError(f"request id {request_id!r} is already in use")
        wire = f"{request_id}@{next(self._adds)}"
        self._send(("add", wire, prompt, params, priority, time.time() if arrival_time is None else arrival_time))
        self._wire[request_id], self._caller[wire] = wire, request_id

    def abort_request(self, request_id: str) -> None:
        wire = self._wire.get(request_id)
        if wire is not None:
            self._end(wire)
            self._send(("abort", wire))

    def has_unfinished_requests(self) -> bool:
        return bool(self._wire)

    def num_unfinished_requests(self) -> int:
        return len(self._wire)

    def step(self, timeout: float = POLL_SECONDS) -> list[RequestOutput | RequestError]:
        """The outputs that arrived, waiting at most `timeout` seconds for the first."""
        outputs, self._held = self._held, []
        try:
            event = self._events.get_nowait() if outputs or timeout <= 0 else self._events.get(timeout=timeout)
        except queue.Empty:
            return outputs
        while True:
            self._take(event, outputs)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return outputs

    def drain(self) -> list:
        return []

    def call(self, fn) -> Any:
        """`fn(engine)` in the child, between steps (`fn` must pickle); outputs that arrive meanwhile
        wait for the next `step()`."""
        call_id = next(self._call_ids)
        self._send(("call", call_id, fn))
        while call_id not in self._results:
            self._take(self._events.get(), self._held)
        result, error = self._results.pop(call_id)
        if error is not None:
            raise error
        return result

    def embed(self, token_ids: list[int]) -> list[float]:
        from jengine.entrypoints.pooling import embed

        return self.call(functools.partial(embed, token_ids=list(token_ids)))

    def metrics_snapshot(self) -> dict | None:
        """The child's last `jengine.metrics.snapshot` (with `stats=True`), None before the first step."""
        return self._snapshot

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (after the step it is in) and wait for it; kill it if it does not end."""
        try:
            self._send(("stop",))
        except (OSError, EngineDeadError):
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    # ------------------------------------------------------------------ plumbing

    def _send(self, message: tuple) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine process stopped: {self._dead!r}") from self._dead
        try:
            self._commands.send(message)
        except (OSError, ValueError) as e:  # the child is gone (its end of the pipe closed)
            raise EngineDeadError("the engine process is gone") from e

    def _read(self) -> None:
        """Reader thread: everything the child sends, decoded, into `_events` (then an end marker)."""
        try:
            while True:
                event = pickle.loads(self._events_conn.recv_bytes())
                if event[0] in ("step", "stats") and event[-1] is not None:
                    self._snapshot = event[-1]  # the metrics see it at once, even while no request runs
                if event[0] != "stats":
                    self._events.put(event)
                    if self._notify is not None:
                        self._notify.set()
        except (EOFError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - an undecodable message ends the run like a dead child
            logger.exception("reading the engine's events failed")
            self._events.put(("dead", RuntimeError(f"unreadable engine event: {e!r}")))
        self._events.put(_EOF)
        if self._notify is not None:
            self._notify.set()

    def _end(self, wire: str) -> str:
        request_id = self._caller.pop(wire)
        del self._wire[request_id]
        self._prompts.pop(wire, None)
        return request_id

    def _take(self, event: tuple, outputs: list) -> None:
        kind = event[0]
        if kind == "step":
            for p in event[1]:
                request_id = self._caller.get(p[0])
                if request_id is None:  # aborted here while the child produced it
                    continue
                out = _unpack(p, self._prompts)
                out.request_id = request_id
                if out.finished:
                    self._end(p[0])
                outputs.append(out)
        elif kind == "error":
            _, wire, error = event
            if wire in self._caller:
                outputs.append(RequestError(self._end(wire), error))
        elif kind == "result":
            self._results[event[1]] = event[2:]
        elif kind == "dead":
            self._dead = event[1]
            raise EngineDeadError(f"the engine process failed: {event[1]!r}") from event[1]
        elif kind == "eof":
            self._events.put(_EOF)  # every later wait sees it too
            self._process.join(5)
            self._dead = self._dead or EngineDeadError(f"the engine process exited ({self._process.exitcode})")
            raise EngineDeadError(f"the engine process stopped: {self._dead!r}")
