"""The OpenAI-compatible server, as a real subprocess, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from test_server_harness import API_KEY, CHAT, MODEL, Server, tokenize_chat

from jengine import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "JAX compiles", "a"]
GREEDY_EXTRA = {"ignore_eos": True, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def llm():
    """The server's engine in this process, to hold its answers to."""
    return LLM(MODEL, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
               seq_buckets=(8,), use_tqdm_on_load=False)


def _ids(logprobs_tokens) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]



def test_health_version_and_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completions_equal_llm_generate(client, llm):
    async def all_at_once():
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key=API_KEY, max_retries=0, timeout=60)
        return await asyncio.gather(*(aclient.completions.create(
            model=MODEL, prompt=p, max_tokens=12, temperature=0, logprobs=0, extra_body=GREEDY_EXTRA)
            for p in PROMPTS))

    served = [_ids(r.choices[0].logprobs.tokens) for r in asyncio.run(all_at_once())]
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert served == [e.outputs[0].token_ids for e in expected]


def test_the_engine_on_a_thread_of_the_server_serves_the_same_streams(client):
    """`--engine-in-process` (the engine on a thread, not in a child process): the same streamed tokens."""
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=10, temperature=0, logprobs=0, stream=True,
              extra_body=GREEDY_EXTRA)
    want = [t for c in client.completions.create(**kw) for t in _ids(c.choices[0].logprobs.tokens)]
    srv = Server("--engine-in-process")
    try:
        other = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        got = [t for c in other.completions.create(**kw) for t in _ids(c.choices[0].logprobs.tokens)]
        assert srv.wait_idle()["jengine:generation_tokens_total"] == 10
    finally:
        assert srv.stop() == 0
    assert got == want and len(got) == 10


def test_streamed_completion_text_equals_the_non_streamed_one(client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_choices_equal_the_non_streamed_ones_with_n_echo_logprobs_and_stop(client):
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(ch for ch in text[3:] if ch.strip())
    kw = dict(model=MODEL, prompt=["Hello", "abc"], max_tokens=12, temperature=1.0, n=2, seed=3, logprobs=1,
              echo=True, stop=[stop], extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    texts, tokens, finish = {}, {}, {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.tokens:  # offsets go on from the text streamed so far, as in vLLM
                assert c.logprobs.text_offset[0] == len(texts.get(c.index, ""))
                assert c.logprobs.text_offset == sorted(c.logprobs.text_offset)
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, []) + (c.logprobs.tokens if c.logprobs else [])
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(texts) == [0, 1, 2, 3]
    for c in whole.choices:
        assert (texts[c.index], tokens[c.index], finish[c.index]) == (c.text, c.logprobs.tokens, c.finish_reason)


def test_chat_top_logprobs_are_the_k_most_likely_even_when_the_sampled_token_is_not(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                         max_tokens=12, temperature=2.0, seed=7, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= min(c.logprob, c.top_logprobs[1].logprob)
               for c in content)
    # Most draws at temperature 2 fall outside the top 2; their logprob is then below both listed ones.
    outside = [c for c in content if c.token not in {t.token for t in c.top_logprobs}]
    assert outside and all(c.logprob <= c.top_logprobs[1].logprob for c in outside)


def test_chat_streaming_with_usage_and_logprobs(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == 6
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def test_continuous_usage_stats_put_each_choices_running_count_on_every_completion_chunk(client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=7, temperature=1.0, seed=5, n=2, logprobs=0, stream=True,
              extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream_options=CONTINUOUS, **kw))
    *choice_chunks, last = chunks
    counted = {0: 0, 1: 0}
    for chunk in choice_chunks:
        (c,) = chunk.choices
        counted[c.index] += len(c.logprobs.tokens)
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == \
            (5, counted[c.index], 5 + counted[c.index])
    assert counted == {0: 7, 1: 7} and len(choice_chunks) > 2
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 14)
    plain = list(client.completions.create(stream_options={"include_usage": True}, **kw))
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]


def test_continuous_usage_stats_count_up_on_every_chat_chunk_from_zero(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=6, temperature=0,
              logprobs=True, stream=True, extra_body={"ignore_eos": True})
    *chunks, last = list(client.chat.completions.create(stream_options=CONTINUOUS, **kw))
    prompt = last.usage.prompt_tokens
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0
    seen = 0
    for chunk in chunks:
        seen += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == \
            (prompt, seen, prompt + seen)
    assert seen == 6 and last.choices == [] and last.usage.completion_tokens == 6 and prompt > 0


def _plain_prompt_logprobs(out) -> list:
    """LLM's prompt logprobs as the server writes them (token ids as keys)."""
    return [None if pos is None else {str(t): (lp.rank, lp.logprob) for t, lp in pos.items()}
            for pos in out.prompt_logprobs]


def _served(prompt_logprobs) -> list:
    return [None if pos is None else {t: (e["rank"], e["logprob"]) for t, e in pos.items()}
            for pos in prompt_logprobs]


def test_prompt_logprobs_of_completions_equal_the_engines_for_the_same_prompt(client, llm):
    from jengine.tokenizer import load_tokenizer

    ids = [72, 101, 108, 108, 111, 44, 32]
    out = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": 3, "ignore_eos": True})
    first, second = out.choices[0].prompt_logprobs, out.choices[2].prompt_logprobs
    assert out.choices[1].prompt_logprobs == first and len(first) == 7 and len(second) == 3
    assert first[0] is None and all(len(pos) in (3, 4) and str(t) in pos for t, pos in zip(ids[1:], first[1:]))
    want = llm.generate([ids, ids[:3]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
                        use_tqdm=False)
    for served, expected in ((first, want[0]), (second, want[1])):
        got, exp = _served(served), _plain_prompt_logprobs(expected)
        assert [None if p is None else {t: r for t, (r, _) in p.items()} for p in got] == \
            [None if p is None else {t: r for t, (r, _) in p.items()} for p in exp]
        assert all(abs(got[i][t][1] - exp[i][t][1]) < 1e-4 for i in range(1, len(exp)) for t in exp[i])
    tok = load_tokenizer(MODEL)
    assert all(e["decoded_token"] == tok.decode([int(t)]) for pos in first[1:] for t, e in pos.items())
    assert out.choices[0].logprobs is None  # prompt_logprobs alone add no completion logprobs
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=1).choices[0].prompt_logprobs is None
    # 0 is allowed with stream (vLLM's rule); without echo they stay out of the streamed logprobs
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, logprobs=0, stream=True,
                                         extra_body={"prompt_logprobs": 0, "ignore_eos": True})
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed if c.choices and c.choices[0].logprobs) == 2


def test_prompt_logprobs_of_a_chat_sit_at_the_top_of_the_response_and_equal_the_engines(server, client, llm):
    messages = [{"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 0})
    ids = tokenize_chat(server, messages=messages)
    assert len(out.prompt_logprobs) == out.usage.prompt_tokens == len(ids) and out.prompt_logprobs[0] is None
    assert all(list(pos) == [str(t)] for t, pos in zip(ids[1:], out.prompt_logprobs[1:]))  # k=0: the token alone
    (want,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    got, exp = _served(out.prompt_logprobs), _plain_prompt_logprobs(want)
    assert all(got[i][t][0] == exp[i][t][0] and abs(got[i][t][1] - exp[i][t][1]) < 1e-4
               for i in range(1, len(ids)) for t in exp[i])
    # prompt_logprobs=0 is allowed with stream (vLLM's rule); a stream has no place for them
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                 extra_body={"prompt_logprobs": 0}))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_tokens_left_unset_fills_the_room_the_prompt_leaves_in_max_model_len(server, client):
    content = "x" * 230
    prompt = len(tokenize_chat(server, messages=[{"role": "user", "content": content}]))
    assert 230 < prompt < 250
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (256 - prompt, "length")
    # a completion's max_tokens is OpenAI's 16 when left out or sent null, as in vLLM
    none = client.completions.create(model=MODEL, prompt="Hi", max_tokens=None, extra_body={"ignore_eos": True})
    assert none.usage.completion_tokens == 16


def test_return_token_ids_puts_the_prompts_and_each_choices_ids_beside_the_text(server, client):
    extra = {"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
    kw = dict(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=0, extra_body=extra)
    whole = client.completions.create(**kw).choices[0]
    assert whole.prompt_token_ids == list(b"Hello") and whole.token_ids == _ids(whole.logprobs.tokens)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].prompt_token_ids == list(b"Hello") and len(whole.token_ids) == 5
    assert [getattr(c, "prompt_token_ids", None) for c in chunks[1:]] == [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    chat = dict(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, extra_body=extra)
    reply = client.chat.completions.create(**chat)
    assert reply.prompt_token_ids == tokenize_chat(server) and len(reply.choices[0].token_ids) == 4
    streamed = list(client.chat.completions.create(stream=True, **chat))
    assert streamed[0].prompt_token_ids == reply.prompt_token_ids
    assert [t for c in streamed[1:] for t in c.choices[0].token_ids] == reply.choices[0].token_ids
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=1).choices[0].token_ids is None


def test_chat_echo_prepends_the_message_the_reply_continues(client):
    conv = [*CHAT, {"role": "assistant", "content": "Sure, the"}]
    kw = dict(model=MODEL, messages=conv, max_tokens=4, temperature=0)
    opts = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    plain = client.chat.completions.create(**kw, extra_body=opts).choices[0].message
    echoed = client.chat.completions.create(**kw, extra_body={**opts, "echo": True})
    reply = echoed.choices[0].message
    assert (reply.role, reply.content) == ("assistant", "Sure, the" + plain.content)
    assert echoed.prompt_logprobs is not None and echoed.usage.completion_tokens == 4
    streamed = list(client.chat.completions.create(**kw, stream=True, extra_body={**opts, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Sure, the" + plain.content
    # after a generation prompt the reply is the assistant's own turn: nothing to echo
    turn = dict(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert client.chat.completions.create(**turn, extra_body={"echo": True}).choices[0].message.content == \
        client.chat.completions.create(**turn).choices[0].message.content


def test_a_requests_id_names_its_response_the_header_first_and_may_repeat(server, client):
    kw = dict(model=MODEL, prompt="Hi", max_tokens=2)
    assert client.completions.create(**kw, extra_body={"request_id": "mine"}).id == "cmpl-mine"
    chat = dict(model=MODEL, messages=CHAT, max_tokens=2)
    assert client.chat.completions.create(**chat, extra_headers={"X-Request-Id": "hdr"},
                                          extra_body={"request_id": "body"}).id == "chatcmpl-hdr"

    async def twice():
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key=API_KEY, max_retries=0, timeout=60)
        return await asyncio.gather(*(aclient.completions.create(**kw, extra_body={"request_id": "same"})
                                      for _ in range(2)))

    assert [r.id for r in asyncio.run(twice())] == ["cmpl-same"] * 2
    assert client.completions.create(**kw, extra_body={"priority": 0}).usage.completion_tokens == 2


def test_n_and_seed_give_reproducible_samples(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1.0, n=3, seed=7,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 24


def test_stop_echo_and_several_prompts(client):
    kw = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(prompt="Hello", **kw).choices[0].text
    stop = next(ch for ch in text[3:] if ch.strip())
    stopped = client.completions.create(prompt="Hello", stop=[stop], **kw).choices[0]
    assert stopped.text == text[: text.index(stop)] and stopped.finish_reason == "stop"
    assert client.completions.create(prompt="Hello", echo=True, **kw).choices[0].text == "Hello" + text
    multi = client.completions.create(prompt=["Hello", "abc"], **kw)
    assert [c.index for c in multi.choices] == [0, 1] and multi.choices[0].text == text


def test_echo_with_logprobs_scores_the_prompt_tokens(client):
    kw = dict(model=MODEL, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    choice = client.completions.create(prompt=[72, 101, 108, 108, 111], echo=True, logprobs=2, **kw).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == 5 + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_alone(client):
    kw = dict(model=MODEL, prompt=[72, 101, 108, 108, 111], echo=True, logprobs=1)
    alone = client.completions.create(max_tokens=0, **kw).choices[0]
    scored = client.completions.create(max_tokens=1, temperature=0, **kw).choices[0]
    assert alone.text == "Hello" and len(scored.text) > len("Hello") and alone.finish_reason == "length"
    assert alone.logprobs.tokens == scored.logprobs.tokens[:5] and alone.logprobs.token_logprobs[0] is None
    assert alone.logprobs.token_logprobs == scored.logprobs.token_logprobs[:5]
    streamed = [c.choices[0] for c in client.completions.create(max_tokens=0, stream=True, **kw) if c.choices]
    assert "".join(c.text for c in streamed) == "Hello"
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == alone.logprobs.tokens


def test_a_prompt_dict_of_ids_made_from_its_text_keeps_the_text_for_echo():
    from jengine.prompts import tokenize_prompt

    assert tokenize_prompt({"prompt": "hi", "prompt_token_ids": [104, 105]}, None, 256) == ("hi", [104, 105])
    assert tokenize_prompt({"prompt_token_ids": [1]}, None, 256) == (None, [1])
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 256\)"):
        tokenize_prompt({"prompt": "hi", "prompt_token_ids": [999]}, None, 256)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client):
    kw = dict(model=MODEL, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    ids = [5, 6, 7, 8, 9, 10, 11]
    tail = client.completions.create(prompt=ids[-4:], **kw)
    kw["extra_body"] = {"ignore_eos": True, "truncate_prompt_tokens": 4}
    cut = client.completions.create(prompt=ids, **kw)
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == tail.choices[0].text


def test_tokenize_detokenize_and_embeddings(server, client):
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "héllo"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"].endswith("héllo")
    emb = client.embeddings.create(model=MODEL, input=["hello", "world"])
    vecs = [d.embedding for d in emb.data]
    assert len(vecs) == 2 and len(vecs[0]) == 256 and vecs[0] != vecs[1]
    assert abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-4


def test_allowed_token_ids_and_bad_words_reach_the_engine_from_both_endpoints(client):
    extra = {"allowed_token_ids": [ord(c) for c in "abc"], "bad_words": ["b"], "ignore_eos": True}
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, seed=1,
                                           logprobs=0, extra_body={**extra, "return_tokens_as_token_ids": True})
    assert len(completion.choices[0].text) == 12 and set(completion.choices[0].text) <= {"a", "c"}
    assert set(_ids(completion.choices[0].logprobs.tokens)) <= {ord("a"), ord("c")}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                          temperature=0, extra_body=extra)
    text = chat.choices[0].message.content
    assert len(text) == 12 and set(text) <= {"a", "c"}


def test_tool_choice_auto_needs_a_server_started_with_enable_auto_tool_choice(client):
    tools = [{"type": "function", "function": {"name": "f"}}]  # no parameters: it takes none
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=tools,
                                       tool_choice="auto", max_tokens=2)
    err = e.value.body.get("error", e.value.body)
    assert e.value.status_code == 400 and err["param"] == "tool_choice" and err["type"] == "BadRequestError"
    assert err["message"].startswith('tool_choice "auto" (the default when tools are given) requires a server '
                                     "started with --enable-auto-tool-choice and --tool-call-parser")
    required = client.chat.completions.create(  # needs no parser: the output is constrained to calls
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required", max_tokens=40,
        parallel_tool_calls=False, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert [(c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls] == [("f", "{}")]
    assert required.choices[0].finish_reason == "tool_calls"


def test_plain_text_format_and_tool_choice_none_are_served(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    plain = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(response_format={"type": "text"}, **kw).choices[0].message.content == plain
    assert client.chat.completions.create(tools=tools, tool_choice="none", **kw).choices[0].message.content == plain


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_outputs_constrain_chat_and_completions(client):
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60, temperature=0.8, seed=3)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    compact = {"structured_outputs": {"disable_any_whitespace": True}}  # options stay beside response_format
    for stream in (False, True):
        out = client.chat.completions.create(response_format=fmt, extra_body=compact, stream=stream, **chat)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
        else:
            text = out.choices[0].message.content
        person = json.loads(text)
        assert set(person) == {"name", "age"} and type(person["age"]) is int and len(person["name"]) <= 8
    obj = client.chat.completions.create(response_format={"type": "json_object"}, **{**chat, "temperature": 0})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    done = dict(model=MODEL, prompt="Is it?", max_tokens=8, n=2, temperature=1.0, seed=1)
    choice = client.completions.create(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, **done)
    assert [c.text in ("yes", "no") for c in choice.choices] == [True, True]
    regex = client.completions.create(extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"}, **done)
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", c.text) for c in regex.choices)


def test_a_malformed_schema_is_a_bad_request_through_the_client(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=fmt)
    assert e.value.status_code == 400
    err = e.value.body.get("error", e.value.body)  # the client keeps the body's "error" object
    assert err["param"] == "response_format" and "properties must be an object" in err["message"]
    assert err["type"] == "BadRequestError"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_v1_routes_need_the_api_key(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings")):
        r = httpx.request(method, f"{server.url}{path}", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health", headers=headers).status_code == 200


def test_client_disconnect_mid_stream_aborts_and_frees_pages(server):
    body = {"prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
    before = server.metrics().get("jengine:request_success_total[abort]", 0)
    server.abandon_stream(body, after_lines=4)
    m = server.wait_idle()
    assert (m["jengine:num_requests_running"], m["jengine:kv_cache_usage_perc"]) == (0, 0)
    assert m["jengine:request_success_total[abort]"] == before + 1


def test_metrics_count_tokens_requests_and_latencies(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    m = server.wait_idle()
    assert m["jengine:prompt_tokens_total"] > 0 and m["jengine:generation_tokens_total"] >= 3
    assert m["jengine:request_success_total[length]"] >= 1
    assert m["jengine:prefix_cache_queries_total"] >= m["jengine:prefix_cache_hits_total"] >= 0
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "iteration_tokens_total"):
        assert m[f"jengine:{hist}_count"] >= 1, hist


def test_a_client_gone_before_a_non_streamed_reply_aborts_its_request(server):
    before = server.metrics().get("jengine:request_success_total[abort]", 0)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=0.15,
                   json={"prompt": "x", "max_tokens": 240, "n": 8, "ignore_eos": True})
    deadline = time.monotonic() + 20
    while server.metrics().get("jengine:request_success_total[abort]", 0) == before:
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.1)
    assert server.wait_idle()["jengine:kv_cache_usage_perc"] == 0
