"""Tool calling through the server, driven by the official openai client: tools and tool-call history reach the
chat template; tool_choice "required" and a named function constrain the output to calls; "auto" reads the
calls the output makes with the server's --tool-call-parser (here forced by a regex, since a random-weight
model writes none of its own), streamed or whole."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from test_server_harness import MODEL, Server, tokenize_chat

TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }}={{ t | tojson }};{% endfor %}"
            "{{ '\\n' }}{% endif %}{% for m in messages %}[{{ m['role'] }}]"
            "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}CALL {{ c['id'] }} {{ c['function']['name'] }}"
            "({{ c['function']['arguments']['city'] }}){% endfor %}"
            "{% elif m['role'] == 'tool' %}RESULT {{ m['tool_call_id'] }}: {{ m['content'] }}"
            "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
                   "additionalProperties": False}}}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": SMALL, "b": SMALL}, "required": ["a", "b"],
                                  "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
CHAT = [{"role": "user", "content": "hi"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model's JSON whitespace never ends


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "template.jinja"
    path.write_text(TEMPLATE)
    srv = Server("--chat-template", str(path), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--exclude-tools-when-tool-choice-none", "--max-model-len", "1024")  # tools make long prompts
    yield srv
    assert srv.stop() == 0


def _text(ids: list[int]) -> str:
    return bytes(ids).decode()  # the byte tokenizer: one id per byte


def _calls(message_calls) -> list[tuple[str, str]]:
    """(name, arguments text) of a message's calls."""
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in message_calls)
    return [(c.function.name, c.function.arguments) for c in message_calls]


def _streamed(chunks) -> dict[int, dict]:
    """Per choice: its content, finish_reason and calls as a client puts the deltas together."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": "", "finish_reason": None, "calls": {}})
            got["content"] += c.delta.content or ""
            got["finish_reason"] = c.finish_reason or got["finish_reason"]
            for t in c.delta.tool_calls or ():
                if t.index not in got["calls"]:
                    assert t.id.startswith("chatcmpl-tool-") and t.type == "function" and t.function.name
                    got["calls"][t.index] = [t.function.name, ""]
                else:
                    assert t.id is None and t.function.name is None
                got["calls"][t.index][1] += t.function.arguments or ""
    for got in choices.values():
        got["calls"] = [(name, args) for _, (name, args) in sorted(got["calls"].items())]
    return choices


def test_tools_and_tool_call_history_reach_the_chat_template(server, client):
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = tokenize_chat(server, messages=history, tools=TOOLS)
    tools = "".join(f"{t['function']['name']}={json.dumps(_as_sent(t))};" for t in TOOLS)
    assert _text(ids) == (f"TOOLS:{tools}\n[user]weather?\n[assistant]CALL call_1 get_weather(Oslo)\n"
                          "[tool]RESULT call_1: sunny\n[assistant] ")
    assert _text(tokenize_chat(server, messages=history)).startswith("[user]weather?\n")
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required",
                                         max_tokens=40, temperature=0, extra_body=COMPACT)
    assert out.usage.prompt_tokens == len(ids)


def _as_sent(tool: dict) -> dict:
    """A tool as the template gets it: every field of vLLM's, null where the request left it out."""
    function = tool["function"]
    return {"type": "function", "function": {"name": function["name"], "description": function.get("description"),
                                             "parameters": function.get("parameters")}}


def test_tool_choice_none_leaves_tools_out_of_the_template_with_the_servers_flag(server, client):
    with_tools, without = len(tokenize_chat(server, tools=TOOLS)), len(tokenize_chat(server))
    assert with_tools > without
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=2, temperature=0)
    assert client.chat.completions.create(tool_choice="none", **kw).usage.prompt_tokens == without
    assert client.chat.completions.create(tool_choice="auto", **kw).usage.prompt_tokens == with_tools


def test_required_tool_choice_returns_calls_of_the_given_tools_streamed_or_whole(client):
    """Without parallel calls the grammar allows one (a random model would add calls until max_tokens)."""
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0.7,
              seed=5, n=2, parallel_tool_calls=False, extra_body=COMPACT)
    whole = client.chat.completions.create(**kw)
    streamed = _streamed(client.chat.completions.create(stream=True, **kw))
    names = set()
    for choice in whole.choices:
        [(name, text)] = _calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        args = json.loads(text)
        if name == "get_weather":
            assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 6
        else:
            assert name == "add" and set(args) == {"a", "b"} and all(type(v) is int and 0 <= v <= 99
                                                                    for v in args.values())
        assert streamed[choice.index] == {"content": "", "finish_reason": "tool_calls", "calls": [(name, text)]}
        names.add(name)
    assert names == {"get_weather", "add"}  # this seed's two samples call one tool each


def test_required_output_cut_short_is_content_whole_and_the_calls_so_far_streamed(client):
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=40, temperature=0.7,
              seed=1, extra_body=COMPACT)
    choice = client.chat.completions.create(**kw).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("length", None)
    assert choice.message.content.startswith('[{"name":"') and len(choice.message.content) >= 40
    streamed = _streamed(client.chat.completions.create(stream=True, **kw))[0]
    assert streamed["finish_reason"] == "length" and streamed["content"] == ""
    # each call streamed as far as the output went: the arguments are the output's own text
    assert streamed["calls"] and choice.message.content.startswith(
        "[" + "},".join(f'{{"name":"{name}","parameters":{args}' for name, args in streamed["calls"]))


def test_a_named_function_constrains_the_output_to_its_arguments(client):
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=60, temperature=0.7, seed=2, extra_body=COMPACT,
              tool_choice={"type": "function", "function": {"name": "add"}})
    whole = client.chat.completions.create(**kw)
    [(name, text)] = _calls(whole.choices[0].message.tool_calls)
    args = json.loads(text)
    assert name == "add" and set(args) == {"a", "b"} and all(type(v) is int and 0 <= v <= 99 for v in args.values())
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].message.content == ""
    streamed = _streamed(client.chat.completions.create(stream=True, **kw))
    assert streamed == {0: {"content": "", "finish_reason": "stop", "calls": [("add", text)]}}


def test_auto_reads_the_call_the_output_makes_streamed_or_whole(client):
    forced = {"structured_outputs": {"regex": r'Let me see\. <tool_call>\n\{"name": "get_weather", "arguments": '
                                              r'\{"city": "[a-z]{1,5}"\}\}\n</tool_call>'}}
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=120, temperature=1.0, seed=4, extra_body=forced)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    [(name, text)] = _calls(choice.message.tool_calls)
    assert name == "get_weather" and choice.message.content == "Let me see. " and choice.finish_reason == "tool_calls"
    assert re.fullmatch(r'\{"city": "[a-z]{1,5}"\}', text)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert _streamed(chunks) == {0: {"content": "Let me see. ", "finish_reason": "tool_calls",
                                     "calls": [("get_weather", text)]}}
    output = f'Let me see. <tool_call>\n{{"name": "get_weather", "arguments": {text}}}\n</tool_call>'
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == len(output)  # a token a byte


def test_auto_output_without_calls_is_the_plain_reply(server, client):
    prompt = tokenize_chat(server, tools=TOOLS)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
              logprobs=True)
    out = client.chat.completions.create(**kw).choices[0]
    assert "<tool_call>" not in plain and plain.strip()
    assert (out.message.content, out.message.tool_calls, out.finish_reason) == (plain, None, "length")
    assert len(out.logprobs.content) == 8
    assert _streamed(client.chat.completions.create(stream=True, **kw)) == {
        0: {"content": plain, "finish_reason": "length", "calls": []}}


BAD_TOOL_REQUESTS = [
    ("a tool without a name", {"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
    ("a tool of another type", {"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type"),
    ("parameters that are not a schema object", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": [1]}}]}, "tools.0.function.parameters"),
    ("two tools of one name", {"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools"),
    ("a named function not among the tools", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "get_time"}}}, "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("an unknown tool_choice", {"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ("required with a response_format", {"tools": TOOLS, "tool_choice": "required",
                                         "response_format": {"type": "json_object"}}, "tool_choice"),
    ("a named function with a structured_outputs constraint", {"tools": TOOLS, "structured_outputs": {"regex": "a"},
     "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ("required with parameters that do not compile", {"tool_choice": "required", "tools": [{
        "type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}]}, "tools"),
]


@pytest.mark.parametrize("name,body,param", BAD_TOOL_REQUESTS, ids=[c[0] for c in BAD_TOOL_REQUESTS])
def test_bad_tools_and_tool_choices_are_400s_naming_the_field(server, name, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=30,
                   json={"messages": CHAT, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "BadRequestError", r.text


def test_tokenize_checks_tools_too(server):
    r = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT, "tools": [{"function": {"name": 3}}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.function.name", r.text

