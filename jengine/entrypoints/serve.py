"""`jengine serve MODEL`: the OpenAI-compatible HTTP server (uvicorn), flags named as vLLM's.

SIGTERM / Ctrl-C: uvicorn stops accepting connections and waits for the responses in flight; then the
app's shutdown drains the engine, and the process exits 0.

The engine runs in a child process (`jengine.engine_core`), so the HTTP side and the engine loop do not
share one GIL; `--engine-in-process` runs it on a thread of the server's process instead.
`--data-parallel-size N` serves N engine replicas behind the one front end, each in a process of its own
(`jengine.engine_replicas`; on TPUs, and with `--engine-in-process`, all in one: `DataParallelEngine`).
Multi-host (`--coordinator-address/--num-processes/--process-id`, or JENGINE_*): every process builds
the same engine; process 0 serves HTTP and the others follow its commands in lockstep
(`jengine.multihost_serving`); SIGTERM goes to process 0 only, which then stops the others.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading

from jengine.entrypoints.tool_calls import ToolCallingConfig
from jengine.entrypoints.tool_parsers import TOOL_PARSERS
from jengine.presets import DEFAULT_MODEL


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _joined(lists: list[tuple[int, ...]] | None) -> tuple[int, ...] | None:
    """`--token-buckets 8,64 256` -> (8, 64, 256)."""
    return None if lists is None else tuple(x for part in lists for x in part)


def _chat_template(value: str) -> str:
    """`--chat-template`: a file holding the template, else the template itself (as vLLM reads it)."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read the chat template file {value!r}: {e}") from None
    if not any(ch in value for ch in "{}\n"):  # neither a file nor anything a template would hold
        raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a Jinja template")
    return value


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from jengine.cli import add_engine_args, add_multihost_args

    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Start an OpenAI-compatible server (/v1/completions, "
                              "/v1/chat/completions, /v1/embeddings, /v1/models, /tokenize, /metrics, ...).")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"HF model directory, Orbax directory or preset (default {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $JENGINE_API_KEY if set)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    p.add_argument("--token-buckets", type=_int_list, nargs="+", default=None,
                   help="token-count buckets to compile, comma- or space-separated (default: derived)")
    p.add_argument("--seq-buckets", type=_int_list, nargs="+", default=None,
                   help="sequence-count buckets to compile, comma- or space-separated (default: derived)")
    p.add_argument("--chat-template", type=_chat_template, default=None,
                   help="the chat template for every chat request, a file or the Jinja text itself (default: the "
                   "tokenizer's)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template sent in a request (a template is code the server runs)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="read the model's tool calls where tool_choice is 'auto' (the default when a request has "
                   "tools); needs --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help=f"how tool calls are read from the model's output: {' | '.join(TOOL_PARSERS)}")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="leave a request's tools out of the chat template when its tool_choice is 'none'")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries an X-Request-Id header: the request's, else a new random one")
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine on a thread of the server's process, not in a process of its own "
                   "(always so with --num-processes > 1)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    add_engine_args(p)
    add_multihost_args(p)
    p.set_defaults(func=run_server)
    return p


def run_server(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    tool_calling = ToolCallingConfig(enable_auto_tool_choice=args.enable_auto_tool_choice,
                                     tool_call_parser=args.tool_call_parser,
                                     exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none)
    from jengine import distributed
    from jengine.cli import multihost_settings

    multihost = multihost_settings(args)
    if multihost[1] not in (None, 1) and args.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} is not supported with "
                         f"--num-processes {multihost[1]} (multi-host serving runs one replica across the hosts)")
    # before anything touches a device; a "run" of one process needs no lockstep
    multi_process = distributed.initialize(*multihost) and multihost[1] > 1
    import uvicorn

    from jengine.async_llm import AsyncLLM
    from jengine.cli import engine_kwargs
    from jengine.engine_config import EngineConfig
    from jengine.engine_core import build_serving_engine
    from jengine.engine_replicas import start_engine
    from jengine.entrypoints.api_server import build_app
    from jengine.metrics import EngineMetrics
    from jengine.tokenizer import load_tokenizer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger(__name__)
    api_key = args.api_key or os.environ.get("JENGINE_API_KEY") or None
    name = args.served_model_name or args.model
    kwargs = engine_kwargs(args)
    kwargs.update(token_buckets=_joined(args.token_buckets), seq_buckets=_joined(args.seq_buckets))
    config = EngineConfig(model=args.model, **kwargs)
    progress = sys.stderr.isatty()
    if multi_process or args.engine_in_process:
        engine, embedding_programs = build_serving_engine(config, progress)
    else:  # a process per data-parallel replica (one on TPUs)
        engine = start_engine(config, progress=progress, stats=True)
        embedding_programs = engine.embedding_programs
    if multi_process:
        from jengine import multihost_serving

        if not distributed.is_main_process():
            log.info("process %d follows process 0's requests", multihost[2])
            steps = multihost_serving.follow(engine)
            log.info("process 0 stopped the run after %d steps", steps)
            return 0
        engine = multihost_serving.LeaderEngine(engine)
    llm = None
    try:
        metrics = EngineMetrics(name)
        llm = AsyncLLM.from_engine(engine, stat_logger=metrics.record, on_abort=lambda _: metrics.record_aborted())
        app = build_app(llm, name, tokenizer=load_tokenizer(args.model), api_key=api_key, metrics=metrics,
                        chat_template=args.chat_template, trust_request_chat_template=args.trust_request_chat_template,
                        tool_calling=tool_calling, request_id_headers=args.enable_request_id_headers)
        log.info("serving %s as %r on http://%s:%d (%d replica(s) x %d device(s)%s; %d buckets compiled in %.1fs, "
                 "%d embedding lengths)", args.model, name, args.host, args.port, args.data_parallel_size,
                 args.tensor_parallel_size, f", {multihost[1]} processes" if multi_process else "",
                 engine.num_compiled_buckets, engine.startup_seconds, embedding_programs)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_keep_alive=5)
        _draining_server_class()(config).run()
    finally:
        if llm is not None:
            llm.shutdown(drain=False, timeout=30)  # closes the engine: a multi-host leader stops its followers
        elif hasattr(engine, "close"):  # an engine process, a multi-host leader
            engine.close()
    return 0


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, but a SIGTERM/SIGINT that drained cleanly exits 0 instead of re-raising."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return DrainingServer
