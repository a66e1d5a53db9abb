"""vLLM's --enable-request-id-headers: every response carries X-Request-Id, the request's own or a new one."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from jengine.entrypoints.api_server import ApiKeyMiddleware, RequestIdHeaderMiddleware
from jengine.entrypoints.serve import add_serve_parser


def _app() -> TestClient:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.get("/v1/stream")
    async def stream():
        return StreamingResponse(iter(["data: 1\n\n", "data: [DONE]\n\n"]), media_type="text/event-stream")

    app.add_middleware(ApiKeyMiddleware, api_key="k")
    app.add_middleware(RequestIdHeaderMiddleware)
    return TestClient(app)


def test_a_response_carries_the_request_s_id_or_a_new_one():
    client = _app()
    auth = {"Authorization": "Bearer k"}
    given = client.get("/v1/models", headers={**auth, "X-Request-Id": "abc-123"})
    assert given.status_code == 200 and given.headers["x-request-id"] == "abc-123"
    assert given.headers.get_list("x-request-id") == ["abc-123"]
    fresh = [client.get("/v1/models", headers=auth).headers["x-request-id"] for _ in range(2)]
    assert all(len(rid) == 32 and int(rid, 16) >= 0 for rid in fresh) and fresh[0] != fresh[1]
    streamed = client.get("/v1/stream", headers={**auth, "X-Request-Id": "s1"})
    assert streamed.text == "data: 1\n\ndata: [DONE]\n\n" and streamed.headers["x-request-id"] == "s1"
    refused = client.get("/v1/models", headers={"X-Request-Id": "no-key"})  # the key's 401 has it too
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key"


def test_serve_takes_the_flag_off_by_default():
    import argparse

    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args(["m"]).enable_request_id_headers is False
    assert parser.parse_args(["m", "--enable-request-id-headers"]).enable_request_id_headers is True
