"""`jengine serve --data-parallel-size 2` on two fake CPU devices: one front end, two engine replicas.

The server runs as a subprocess with XLA_FLAGS giving it two devices (this process keeps one); its
greedy completions must be what one engine (`LLM.generate`) produces, and concurrent requests must be
spread over both replicas.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from test_server_harness import API_KEY, MODEL, Server

from jengine import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "JAX compiles", "a", "Once upon a time", "b c"]
GREEDY_EXTRA = {"ignore_eos": True, "return_tokens_as_token_ids": True}
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


@pytest.fixture(scope="module")
def server():
    srv = Server("--data-parallel-size", "2", env=TWO_DEVICES)
    yield srv
    assert srv.stop() == 0


def _engine_tokens(server) -> dict[str, float]:
    """jengine:engine_generation_tokens_total per engine label."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in
            re.finditer(r'^jengine:engine_generation_tokens_total\{engine="(\d+)",[^}]*\} (\S+)', text, re.M)}



def test_dp2_greedy_completions_equal_one_engine_and_use_both_replicas(server):
    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        return await asyncio.gather(*(client.completions.create(
            model=MODEL, prompt=p, max_tokens=10, temperature=0, logprobs=0, extra_body=GREEDY_EXTRA)
            for p in PROMPTS))

    served = [[int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
              for r in asyncio.run(all_at_once())]
    llm = LLM(MODEL, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
              seq_buckets=(8,), use_tqdm_on_load=False)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert served == [e.outputs[0].token_ids for e in expected]

    m = server.wait_idle()
    per_engine = _engine_tokens(server)
    assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0  # both replicas generated
    assert sum(per_engine.values()) == m["jengine:generation_tokens_total"] == 10 * len(PROMPTS)
    assert m["jengine:request_success_total[length]"] == len(PROMPTS)
    assert m["jengine:prompt_tokens_total"] == sum(len(e.prompt_token_ids) for e in expected)


def test_dp2_abort_frees_pages_and_embeddings_run(server):
    before = server.metrics().get("jengine:request_success_total[abort]", 0)
    body = {"prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
    server.abandon_stream(body, after_lines=3)
    m = server.wait_idle()
    assert (m["jengine:num_requests_running"], m["jengine:kv_cache_usage_perc"]) == (0, 0)
    assert m["jengine:request_success_total[abort]"] == before + 1
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    vecs = [d.embedding for d in client.embeddings.create(model=MODEL, input=["hello", "world"]).data]
    assert len(vecs) == 2 and len(vecs[0]) == 256 and abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-4
