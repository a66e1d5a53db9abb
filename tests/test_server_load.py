"""The server under load, under fuzzed bodies and under SIGTERM (one server for the module; SIGTERM last)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_harness import MODEL, Server


@pytest.fixture(scope="module")
def server():
    srv = Server(api_key=None)
    yield srv
    srv.stop()


async def _stream(client: httpx.AsyncClient, i: int, disconnect: bool) -> tuple[str, str | None, bool]:
    body = {"model": MODEL, "prompt": f"request {i}:", "max_tokens": 6, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, finish, done = "", None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            if disconnect:
                break  # leave mid-stream: the server must abort the request
    return text, finish, done


def test_128_concurrent_streams_with_a_quarter_disconnecting(server):
    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(_stream(client, i, disconnect=i % 4 == 0) for i in range(128)))

    before = server.metrics().get("jengine:request_success_total[length]", 0)
    results = asyncio.run(main())
    completed = [r for i, r in enumerate(results) if i % 4]
    assert len(completed) == 96
    assert all(done and finish == "length" for _, finish, done in completed)
    m = server.wait_idle()
    assert (m["jengine:num_requests_running"], m["jengine:num_requests_waiting"]) == (0, 0)
    assert m["jengine:kv_cache_usage_perc"] == 0
    finished = m["jengine:request_success_total[length]"] - before
    assert 96 <= finished <= 128 and finished + m["jengine:request_success_total[abort]"] >= 128


_junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**20), st.floats(allow_nan=True),
                  st.text(st.characters(exclude_categories=()), max_size=6),  # lone surrogates too
                  st.lists(st.integers(-2, 400), max_size=4), st.dictionaries(
                      st.text(max_size=3), st.integers(-5, 5), max_size=2))


def _bodies(junk: bool):
    """(path, body) strategies: in-range values, or with `junk` also values of any type and range."""

    def maybe(valid):
        return st.one_of(*[valid] * 5, _junk) if junk else valid

    sampling = {
        "model": maybe(st.just(MODEL)),
        "n": maybe(st.integers(1, 3)),
        "temperature": maybe(st.floats(0, 2)),
        "top_p": maybe(st.floats(0.01, 1)),
        "top_k": maybe(st.integers(-1, 500)),
        "min_p": maybe(st.floats(0, 1)),
        "presence_penalty": maybe(st.floats(-2, 2)),
        "frequency_penalty": maybe(st.floats(-2, 2)),
        "repetition_penalty": maybe(st.floats(0.01, 3)),
        "seed": maybe(st.integers(0, 2**63 - 1)),
        "stop": maybe(st.one_of(st.text(min_size=1, max_size=3),
                                st.lists(st.text(min_size=1, max_size=3), max_size=3))),
        "stop_token_ids": maybe(st.lists(st.integers(0, 383), max_size=3)),
        "min_tokens": maybe(st.integers(0, 1)),
        "logit_bias": maybe(st.dictionaries(st.integers(0, 383).map(str), st.floats(-100, 100), max_size=3)),
        "stream": st.booleans(),
        "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "ignore_eos": maybe(st.booleans()),
    }
    prompt = maybe(st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 400), max_size=8),
                             st.lists(st.text(min_size=1, max_size=5), max_size=3)))
    max_tokens = maybe(st.integers(1, 6))  # always given: chat's default (None) would run to max_model_len
    messages = maybe(st.lists(st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "system", "assistant"])),
                                                     "content": maybe(st.text(max_size=12))}), max_size=3))
    completion = st.fixed_dictionaries({"prompt": prompt, "max_tokens": max_tokens}, optional={
        **sampling, "logprobs": maybe(st.integers(0, 5)), "echo": maybe(st.booleans())})
    chat = st.fixed_dictionaries({"messages": messages, "max_tokens": max_tokens}, optional={
        **sampling, "logprobs": maybe(st.booleans()), "top_logprobs": maybe(st.integers(0, 5))})
    return st.one_of(
        st.tuples(st.just("/v1/completions"), completion),
        st.tuples(st.just("/v1/chat/completions"), chat),
        st.tuples(st.just("/tokenize"), st.fixed_dictionaries({}, optional={"prompt": maybe(st.text(max_size=20)),
                                                                             "messages": messages})),
        st.tuples(st.just("/detokenize"),
                  st.fixed_dictionaries({"tokens": maybe(st.lists(st.integers(0, 383), max_size=10))})),
        st.tuples(st.just("/v1/embeddings"), st.fixed_dictionaries({"input": prompt}, optional={"model": _junk})),
    )


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
        assert "InternalServerError" not in response.text, response.text


_FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("junk", [False, True], ids=["well_typed", "ill_typed"])
@_FUZZ
@given(data=st.data())
def test_fuzzed_bodies_never_get_a_5xx(server, junk, data):
    path, body = data.draw(_bodies(junk=junk))
    _check(httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"}))


@_FUZZ
@given(raw=st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode)))
def test_fuzzed_raw_bytes_never_get_a_5xx(server, raw):
    r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    _check(r)


def test_fuzzing_left_nothing_running(server):
    m = server.wait_idle()
    assert (m["jengine:num_requests_running"], m["jengine:num_requests_waiting"],
            m["jengine:kv_cache_usage_perc"]) == (0, 0, 0)


def test_sigterm_drains_streams_in_flight_then_exits_cleanly(server):
    """Runs last: it stops the module's server."""
    body = {"model": MODEL, "prompt": "drain", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started, results = threading.Barrier(5), []

    def consume():
        last, finish = 0.0, None
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            started.wait()
            for line in lines:
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    finish = chunk["choices"][0]["finish_reason"] or finish
                    last = time.monotonic()
        results.append((finish, last))

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0
    assert [finish for finish, _ in results] == ["length"] * 4
    assert max(last for _, last in results) > signalled  # they were still streaming when the signal came
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)
