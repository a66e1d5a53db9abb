"""`AsyncLLM`: the engine loop on a background thread, streaming outputs to asyncio consumers.

JAX calls block, so the loop cannot run on the event loop. Every engine call (add, abort, step, and
anything submitted with `run`) happens on the one engine thread, fed through a command queue, so the
engine needs no lock. Outputs go back to each request's `asyncio.Queue` with
`loop.call_soon_threadsafe`. If the engine fails, every waiting caller gets the error; nobody hangs.
An engine with a `close()` (the multi-host leader, which then stops its followers; an `EngineProcess`,
whose child then exits) gets it called on the engine thread when the loop ends.

The engine may live in another process (`jengine.engine_core.EngineProcess`, what `jengine serve` runs):
the loop is the same, and a request the child refuses comes back as a `RequestError` among the outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from jengine.engine import LLMEngine
from jengine.engine_config import EngineConfig
from jengine.engine_core import EngineDeadError, RequestError
from jengine.outputs import RequestOutput
from jengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


_ABORTED = object()  # end-of-stream marker for a request aborted by the caller


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: Any) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the engine thread will not change while a consumer reads it: the metrics are the request's
    own (the outputs' token and logprob lists are new per output already, `request_groups.make_output`)."""
    return dataclasses.replace(out, metrics=dataclasses.replace(out.metrics))


class AsyncLLM:
    """An `LLMEngine` driven by a background thread; `generate` streams cumulative `RequestOutput`s.

    `AsyncLLM(model, **engine_args)` builds the engine (same keywords as `LLM`; unset, `prefill_first` is
    off here, where a burst of arrivals would stall the running streams, and on in `LLM`);
    `AsyncLLM.from_engine(engine)` wraps an existing one. `stat_logger(engine, outputs)` is called on the
    engine thread after every iteration and `on_abort(request_id)` when a live request is aborted
    (for metrics).
    """

    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None,
                 stat_logger: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 on_abort: Callable[[str], None] | None = None,
                 progress: bool = True, **engine_args):
        if engine is None:
            if model is None:
                raise ValueError("AsyncLLM needs a model (or an engine)")
            engine = LLMEngine(EngineConfig(model=model, **engine_args), progress=progress)
        self.engine = engine
        self.stat_logger = stat_logger
        self.on_abort = on_abort
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._drain = True
        self._thread = threading.Thread(target=self._loop, name="jengine-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine(cls, engine: LLMEngine, **kw) -> AsyncLLM:
        return cls(engine=engine, **kw)

    # ------------------------------------------------------------------ public API (event loop side)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}") from self._error
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine is shutting down")

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request until it finishes (of the params' `output_kind`: cumulative by
        default; when several cumulative outputs are waiting, only the newest is yielded).

        Errors the request causes (ValueError from validation) and engine failures are raised here.
        Leaving the iteration early (break, cancellation, client gone) aborts the request.
        """
        self._check_alive()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt, params, priority))
        finished = False
        coalesce = getattr(params, "output_kind", RequestOutputKind.CUMULATIVE) is RequestOutputKind.CUMULATIVE
        try:
            while True:
                item = await self._next(stream)
                # Cumulative outputs: when several are queued, only the newest matters.
                while (coalesce and not stream.queue.empty() and isinstance(item, RequestOutput)
                       and not item.finished):
                    item = stream.queue.get_nowait()
                if item is _ABORTED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def _next(self, stream: _Stream) -> Any:
        while True:
            try:
                return await asyncio.wait_for(stream.queue.get(), timeout=1.0)
            except TimeoutError:
                if not self._thread.is_alive() and stream.queue.empty():  # died without telling us
                    raise EngineDeadError("the engine loop has stopped") from self._error

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages; its `generate` ends quietly. Unknown ids are ignored."""
        if self._thread.is_alive():
            self._commands.put(("abort", request_id))

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread (between steps) and return its result."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", fn, loop, future))
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(future), timeout=1.0)
            except TimeoutError:
                if not self._thread.is_alive() and not future.done():
                    raise EngineDeadError("the engine loop has stopped") from self._error

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the loop; with `drain`, requests in flight finish first, otherwise they are aborted."""
        self._drain = drain
        self._stopping = True
        self._commands.put(("wake",))
        self._thread.join(timeout)

    async def shutdown_async(self, drain: bool = True, timeout: float | None = None) -> None:
        await asyncio.to_thread(self.shutdown, drain, timeout)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                if self._stopping and (idle or not self._drain):
                    break
                self._handle_commands(block=idle)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    refused = False
                    for out in outputs:
                        stream = self._streams.get(out.request_id)
                        if isinstance(out, RequestError):  # refused by an engine in another process
                            refused = True
                            if stream is not None:
                                self._streams.pop(out.request_id)
                                stream.put(out.error)
                        elif stream is not None:
                            stream.put(_snapshot(out))
                            if out.finished:
                                self._streams.pop(out.request_id, None)
                    self._log_stats([o for o in outputs if not isinstance(o, RequestError)] if refused else outputs)
                else:
                    self._log_stats([])
        except BaseException as e:  # noqa: BLE001 - every failure must reach the callers
            logger.exception("engine loop failed")
            self._error = e
        finally:
            self._fail_all()
            close = getattr(engine, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    logger.exception("closing the engine failed")

    def _log_stats(self, outputs: list[RequestOutput]) -> None:
        if self.stat_logger is None:
            return
        try:
            self.stat_logger(self.engine, outputs)
        except Exception:  # metrics must never take the engine down
            logger.exception("stat logger failed")

    def _handle_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt, params, priority = cmd
            stream = self._streams.get(request_id)
            if stream is None:  # aborted before it was added
                return
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority,
                                        arrival_time=time.time())
            except Exception as e:  # bad input: the caller's error, the engine is fine
                self._streams.pop(request_id, None)
                stream.put(e)
        elif kind == "abort":
            request_id = cmd[1]
            self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(_ABORTED)
                if self.on_abort is not None:
                    self.on_abort(request_id)
        elif kind == "call":
            _, fn, loop, future = cmd
            try:
                result, error = fn(self.engine), None
            except Exception as e:
                result, error = None, e
            _call_soon(loop, _settle, future, result, error)

    def _fail_all(self) -> None:
        error = (EngineDeadError(f"the engine loop failed: {self._error!r}") if self._error is not None
                 else EngineDeadError("the engine was shut down"))
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id)
            with contextlib.suppress(Exception):  # best effort: give the pages back
                self.engine.abort_request(request_id)
            stream.put(error)
        with contextlib.suppress(Exception):  # a step may still be on the device; settle it
            self.engine.drain()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "call":
                _call_soon(cmd[2], _settle, cmd[3], None, error)
            elif cmd[0] == "add" and cmd[1] in self._streams:
                self._streams.pop(cmd[1]).put(error)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's loop is closed; nobody is listening any more
        pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
