"""The FastAPI app: OpenAI-compatible routes over one `AsyncLLM`, plus health, tokenizer and metrics.

Every error a client can cause comes back as an OpenAI error body with a 4xx status; `--api-key`
guards every /v1 route. The engine is built before the app (compilation happens once, at start-up).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import jengine
from jengine.async_llm import AsyncLLM
from jengine.entrypoints.errors import APIError, validation_message
from jengine.entrypoints.openai_serving import OpenAIServing
from jengine.entrypoints.pooling import embed
from jengine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from jengine.entrypoints.tool_calls import ToolCallingConfig
from jengine.metrics import EngineMetrics


class ApiKeyMiddleware:
    """Plain ASGI middleware (streaming and disconnects pass through untouched): /v1 needs the key."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware:
    """vLLM's `--enable-request-id-headers`: every HTTP response carries an X-Request-Id header, the request's
    own or a new random one (hex)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _unless_disconnected(raw: Request, coro):
    """Await `coro`, cancelling it (and so aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return Response(status_code=499)


def build_app(llm: AsyncLLM, model_name: str, *, tokenizer=None, api_key: str | None = None,
              metrics: EngineMetrics | None = None, shutdown_engine: bool = True, chat_template: str | None = None,
              trust_request_chat_template: bool = False, tool_calling: ToolCallingConfig | None = None,
              request_id_headers: bool = False) -> FastAPI:
    """The ASGI app; `tokenizer` is the API thread's own copy (the engine thread keeps its own). Chat
    templates are applied here, never in the engine: `chat_template` is the server's default one.
    `tool_calling`: the server's tool-call options (none: only required and named tool choices).
    `request_id_headers`: every response carries an X-Request-Id header (`RequestIdHeaderMiddleware`)."""
    serving = OpenAIServing(llm, model_name, tokenizer, chat_template=chat_template,
                            trust_request_chat_template=trust_request_chat_template, tool_calling=tool_calling)
    max_model_len = llm.engine.config.max_model_len
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if shutdown_engine:  # uvicorn has finished every in-flight response by now; drain the rest
            await llm.shutdown_async(drain=True)

    app = FastAPI(title="jengine OpenAI-compatible server", version=jengine.__version__, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        message, param = validation_message(exc.errors())
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(APIError)
    async def _api(request, exc):
        return exc.response()

    @app.exception_handler(ValueError)
    async def _value(request, exc):
        return APIError.from_exception(exc).response()

    @app.exception_handler(Exception)
    async def _other(request, exc):
        return APIError.from_exception(exc).response()

    @app.get("/health")
    async def health():
        return Response(status_code=200 if llm.is_running else 503)

    @app.get("/version")
    async def version():
        return {"version": jengine.__version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render() if metrics else b"", media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jengine", "root": llm.engine.config.model,
                                            "max_model_len": max_model_len}]}

    async def _respond(raw: Request, make):
        result = await make
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        make = serving.create_completion(req, raw.headers.get("x-request-id"))
        if req.stream:
            return await _respond(raw, make)
        return await _unless_disconnected(raw, _respond(raw, make))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        make = serving.create_chat_completion(req, raw.headers.get("x-request-id"))
        if req.stream:
            return await _respond(raw, make)
        return await _unless_disconnected(raw, _respond(raw, make))

    def _need_tokenizer():
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; send token ids")
        return tokenizer

    def _encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return list(_need_tokenizer().encode(text, add_special_tokens=add_special_tokens))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("send exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            ids = serving.chat_prompt(req)
        else:
            ids = _encode(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        vocab = llm.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ValueError(f"tokens must be in [0, {vocab})")
        return {"prompt": _need_tokenizer().decode(req.tokens)}

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        serving.check_model(req.model)
        if req.dimensions is not None:
            raise ValueError("dimensions is not supported")
        data, total = [], 0
        for i, item in enumerate(req.inputs()):
            ids = _encode(item) if isinstance(item, str) else list(item)
            total += len(ids)
            vector = await llm.run(lambda engine, ids=ids: embed(engine, ids))
            if req.encoding_format == "base64":
                vector = base64.b64encode(np.asarray(vector, np.float32).tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        return {"object": "list", "data": data, "model": model_name,
                "usage": {"prompt_tokens": total, "total_tokens": total}}

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if request_id_headers:  # added last: outermost, so refusals of the key get the header too
        app.add_middleware(RequestIdHeaderMiddleware)
    return app
