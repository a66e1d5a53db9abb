"""Chat templates through the server: the model's template with vLLM's options (continue_final_message,
chat_template_kwargs, documents, reasoning_effort), a server-wide template file, and requests' own templates
(only with --trust-request-chat-template)."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server_harness import API_KEY, CHAT, MODEL, Server, tokenize_chat

FILE_TEMPLATE = ("{% if shout %}LOUD {% endif %}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def test_continue_final_message_renders_the_last_message_open(server, client):
    from jengine.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    conv = [*CHAT, {"role": "assistant", "content": "Sure, the"}]
    want = tok.encode(tok.apply_chat_template(conv, tokenize=False, continue_final_message=True),
                      add_special_tokens=False)
    assert tok.decode(want).endswith("<|start_header|>assistant<|end_header|>Sure, the")
    opts = {"continue_final_message": True, "add_generation_prompt": False}
    r = httpx.post(f"{server.url}/tokenize", json={"messages": conv, **opts}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    out = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=2, temperature=0, extra_body=opts)
    assert out.usage.prompt_tokens == len(want)


def test_chat_template_kwargs_reach_the_models_template(server, client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw)
    thinking_off = client.chat.completions.create(
        **{**kw, "extra_body": {**kw["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}})
    assert thinking_off.usage.prompt_tokens == plain.usage.prompt_tokens == len(tokenize_chat(server))
    # transformers lets template variables override the special tokens the template prints
    ids = tokenize_chat(server, chat_template_kwargs={"bos_token": "BOS"})
    assert ids == list(b"BOS") + tokenize_chat(server)[1:]


def test_a_requests_chat_template_is_refused_without_the_trust_flag(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=30,
                   json={"messages": CHAT, "chat_template": "{{ messages[0]['content'] }}"})
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def templated_server(tmp_path_factory):
    """A server with a default chat template from a file, which also takes requests' own templates."""
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(FILE_TEMPLATE)
    srv = Server("--chat-template", str(path), "--trust-request-chat-template")
    yield srv
    assert srv.stop() == 0


def test_chat_template_file_renders_every_chat_request_and_a_trusted_request_may_bring_its_own(templated_server):
    srv = templated_server
    other = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert tokenize_chat(srv) == list(b"[user] hi\n[assistant] ")
    assert tokenize_chat(srv, chat_template_kwargs={"shout": True}) == list(b"LOUD [user] hi\n[assistant] ")
    assert tokenize_chat(srv, chat_template="{{ messages[0]['content'] }}!") == list(b"hi!")
    kw = dict(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert other.chat.completions.create(**kw).usage.prompt_tokens == len("[user] hi\n[assistant] ")
    loud = other.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"shout": True}})
    assert loud.usage.prompt_tokens == len("LOUD [user] hi\n[assistant] ")
    own = other.chat.completions.create(**kw, extra_body={"chat_template": "{{ messages[0]['content'] }}!"})
    assert own.usage.prompt_tokens == 3


def test_documents_and_reasoning_effort_reach_the_chat_template(templated_server):
    other = openai.OpenAI(base_url=f"{templated_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    docs = [{"title": "a", "text": "abc"}, {"title": "b", "text": "de"}]
    out = other.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={
        "documents": docs, "chat_template": "{% for d in documents %}{{ d['text'] }};{% endfor %}"})
    assert out.usage.prompt_tokens == len("abc;de;")
    show = {"chat_template": "{{ reasoning_effort }}/{{ enable_thinking }}", "return_token_ids": True}
    off = {"enable_thinking": False}
    for extra, text in (({}, "/"), ({"reasoning_effort": "low"}, "low/True"),
                        ({"reasoning_effort": "none"}, "none/False"),
                        ({"reasoning_effort": "high", "chat_template_kwargs": off}, "high/False")):
        out = other.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={**show, **extra})
        assert bytes(out.prompt_token_ids).decode() == text


def test_render_chat_adds_the_tokenizers_special_tokens_only_when_asked():
    from jengine.tokenizer import render_chat

    class Tokenizer:
        chat_template = "unused"

        def apply_chat_template(self, conversation, tokenize, **kw):
            return "".join(d["text"] for d in kw.get("documents") or ()) + conversation[-1]["content"]

        def encode(self, text, add_special_tokens):
            return [1] * add_special_tokens + list(text.encode())

    assert render_chat(Tokenizer(), CHAT, add_generation_prompt=True) == list(b"hi")
    assert render_chat(Tokenizer(), CHAT, add_generation_prompt=True, add_special_tokens=True,
                       documents=[{"text": "d"}]) == [1, *b"dhi"]


def test_serve_cli_chat_template_is_a_file_or_the_template_itself(tmp_path, capsys):
    from jengine.cli import build_parser

    parser = build_parser()
    path = tmp_path / "t.jinja"
    path.write_text(FILE_TEMPLATE)
    args = parser.parse_args(["serve", MODEL])
    assert (args.chat_template, args.trust_request_chat_template) == (None, False)
    args = parser.parse_args(["serve", MODEL, "--chat-template", str(path), "--trust-request-chat-template"])
    assert (args.chat_template, args.trust_request_chat_template) == (FILE_TEMPLATE, True)
    assert parser.parse_args(["serve", MODEL, "--chat-template", "{{ x }}"]).chat_template == "{{ x }}"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", MODEL, "--chat-template", str(tmp_path / "missing.jinja")])
    assert "is neither a file nor a Jinja template" in capsys.readouterr().err
