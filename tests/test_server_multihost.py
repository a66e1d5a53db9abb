"""Multi-host `jengine serve` on one machine: two processes (2 CPU devices each, loopback coordinator,
gloo collectives) run one engine at tensor_parallel_size 4 across both. Process 0 serves HTTP and
process 1 follows its commands; the completions must be what one process at TP 1 generates, and a
SIGTERM to process 0 must stop both cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile

import httpx
import openai
import pytest
from test_server_harness import API_KEY, MODEL, SMALL_ENGINE, Server, free_port

from jengine import LLM, SamplingParams
from jengine.entrypoints.pooling import embed

PROMPTS = ["Hello, my name is", "The capital of France is", "JAX compiles", "a"]
ENGINE = ["--dtype", "float32", "--tensor-parallel-size", "4"]
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


@pytest.fixture(scope="module")
def pair():
    """(process 0 as a Server, process 1's Popen, process 1's log file)."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **TWO_DEVICES, "JENGINE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "JENGINE_NUM_PROCESSES": "2", "JENGINE_PROCESS_ID": "1"}  # process 1 from the environment, as on pods
    follower = subprocess.Popen([sys.executable, "-m", "jengine.cli", "serve", MODEL, *SMALL_ENGINE, *ENGINE],
                                env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        leader = Server(*ENGINE, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
                        "--process-id", "0", env=TWO_DEVICES)
    except BaseException:
        follower.kill()
        raise
    yield leader, follower, log
    for proc in (leader.proc, follower):
        if proc.poll() is None:
            proc.kill()


def _follower_output(log) -> str:
    log.seek(0)
    return log.read()[-3000:]


def _reference_engine() -> LLM:
    return LLM(MODEL, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
               token_buckets=(16, 64), seq_buckets=(8,), use_tqdm_on_load=False)


def test_two_process_server_generates_what_one_process_does_and_stops_on_sigterm(pair):
    leader, follower, log = pair
    greedy = dict(model=MODEL, max_tokens=10, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    llm = _reference_engine()
    expected = llm.generate(PROMPTS + ["Hello"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
    # a stop string taken from the middle of a greedy completion: the served one must end right before it
    text = expected[-1].outputs[0].text
    stop = next(ch for ch in text[3:] if ch.strip())
    with_stop = text[: text.index(stop)]

    async def together():
        client = openai.AsyncOpenAI(base_url=f"{leader.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def abandoned_stream():  # read a few chunks, then hang up: process 0 aborts, process 1 must too
            body = {"prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=120) as http, http.stream(
                    "POST", f"{leader.url}/v1/completions", json=body, headers=leader.headers) as r:
                async for i, _ in _aenumerate(r.aiter_lines()):
                    if i == 3:
                        return

        return await asyncio.gather(
            *(client.completions.create(prompt=p, **greedy) for p in PROMPTS),
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True}),
            abandoned_stream())

    *served, stopped, _ = asyncio.run(together())
    assert [[int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens] for r in served] == \
        [e.outputs[0].token_ids for e in expected[:-1]]
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (with_stop, "stop")

    m = leader.wait_idle()
    assert (m["jengine:num_requests_running"], m["jengine:kv_cache_usage_perc"]) == (0, 0)
    assert m["jengine:request_success_total[abort]"] == 1
    # still in lockstep after the abort: a later request matches too
    again = openai.OpenAI(base_url=f"{leader.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = again.completions.create(prompt=PROMPTS[0], **greedy)
    assert [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens] == expected[0].outputs[0].token_ids
    emb = again.embeddings.create(model=MODEL, input=[[5, 6, 7, 8]]).data[0].embedding  # one program on both
    assert max(abs(a - b) for a, b in zip(emb, embed(llm.engine, [5, 6, 7, 8]), strict=True)) < 1e-5

    leader.proc.send_signal(signal.SIGTERM)
    assert leader.proc.wait(60) == 0, leader.proc.stdout.read()[-3000:]
    assert follower.wait(60) == 0, _follower_output(log)
    assert "process 0 stopped the run" in _follower_output(log)


async def _aenumerate(items):
    i = 0
    async for item in items:
        yield i, item
        i += 1
