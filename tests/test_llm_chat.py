"""`LLM.chat`: a conversation is rendered with the tokenizer's chat template and generated like a prompt;
malformed conversations and options are ValueErrors naming what is wrong."""

import pytest

from jengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm():
    return LLM("jengine/tiny-llama", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
               token_buckets=(16, 64), seq_buckets=(4,), use_tqdm_on_load=False)


def test_chat_generates_from_the_rendered_template(llm):
    tok = llm.engine.tokenizer
    for conv in (HELLO, [{"role": "system", "content": "Be brief."}, *HELLO]):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        expected = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        out = llm.chat(conv, GREEDY, use_tqdm=False)
        assert len(out) == 1 and out[0].prompt_token_ids == ids and out[0].outputs[0].token_ids == expected
    two = llm.chat([HELLO, [{"role": "user", "content": "yo"}]], GREEDY, use_tqdm=False)
    one = llm.chat(HELLO, GREEDY, use_tqdm=False)[0]
    assert len(two) == 2 and two[0].outputs[0].token_ids == one.outputs[0].token_ids


@pytest.mark.parametrize(("messages", "kwargs", "message"), [
    (None, {}, "messages must be a conversation .* got NoneType"),
    ({"role": "user", "content": "hi"}, {}, "messages must be a conversation .* got dict"),
    ("hello", {}, "messages must be a conversation .* got str"),
    ([{"role": "user"}], {}, "messages must be a list of"),
    ([{"role": "user", "content": 5}], {}, "messages must be a list of"),
    ([{"role": None, "content": "hi"}], {}, "messages must be a list of"),
    ([[{"role": "user", "content": "hi"}], "x"], {}, "messages must be a list of"),
    (HELLO, {"chat_template": 5}, "chat_template must be a Jinja template string or None, got int"),
    (HELLO, {"add_generation_prompt": "yes"}, "add_generation_prompt must be True or False"),
    (HELLO, {"continue_final_message": 1, "add_generation_prompt": False}, "continue_final_message must be True or"),
    (HELLO, {"continue_final_message": True}, "continue_final_message and add_generation_prompt cannot both be"),
    (HELLO, {"chat_template_kwargs": ["shout"]}, "chat_template_kwargs must be a dict or None, got list"),
    (HELLO, {"chat_template_kwargs": {1: True}}, "chat_template_kwargs keys must be strings, got 1"),
    *[(HELLO, {"chat_template_kwargs": {key: False}}, f"chat_template_kwargs may not set '{key}'")
      for key in ("conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                  "chat_template")],
    (HELLO, {"chat_template": "{{ raise_exception('no system turns') }}"},
     "the chat template rejected the messages: no system turns"),
])
def test_bad_conversations_and_options_are_value_errors(llm, messages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    assert llm.engine.num_unfinished_requests() == 0


def test_continue_final_message_leaves_the_last_message_open(llm):
    tok = llm.engine.tokenizer
    conv = [*HELLO, {"role": "assistant", "content": "Sure, the"}]
    out = llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    text = tok.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert text.endswith("Sure, the") and out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    closed = llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False)[0].prompt_token_ids
    assert len(closed) > len(out.prompt_token_ids) and closed[:len(out.prompt_token_ids)] == out.prompt_token_ids
    assert len(out.outputs[0].token_ids) == 4


def test_chat_template_kwargs_are_variables_of_the_template(llm):
    tok = llm.engine.tokenizer
    shout = "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"
    loud = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=shout, chat_template_kwargs={"shout": True})[0]
    quiet = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=shout, chat_template_kwargs={"shout": False})[0]
    assert tok.decode(loud.prompt_token_ids) == "LOUD hi" and tok.decode(quiet.prompt_token_ids) == "hi"
    # the model's own template ignores variables it does not use (Qwen3's enable_thinking, say)
    plain = llm.chat(HELLO, GREEDY, use_tqdm=False)[0].prompt_token_ids
    assert llm.chat(HELLO, GREEDY, use_tqdm=False,
                    chat_template_kwargs={"enable_thinking": False})[0].prompt_token_ids == plain


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}}
TOOLS_TEMPLATE = ("{% for t in tools or [] %}TOOL {{ t['function']['name'] }}: {{ t['function']['description'] }};"
                  "{% endfor %}{% for m in messages %}[{{ m['role'] }}]{% for c in m['tool_calls'] or [] %}"
                  "CALL {{ c['function']['name'] }}({{ c['function']['arguments']['city'] }}){% endfor %}"
                  "{{ m['content'] }}{% endfor %}")


def test_tools_and_tool_call_history_reach_the_template(llm):
    tok = llm.engine.tokenizer
    conv = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    out = llm.chat(conv, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE, tools=[WEATHER],
                   add_generation_prompt=False)[0]
    assert tok.decode(out.prompt_token_ids) == ("TOOL get_weather: Weather now;[user]hi[assistant]"
                                                "CALL get_weather(Oslo)[tool]cold")
    plain = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE)[0]
    assert tok.decode(plain.prompt_token_ids) == "[user]hi"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tools": {"type": "function"}}, "tools must be a list of tool dicts, got dict"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, r"tools\[0\]: function.name: String should"),
    ({"tools": [{"type": "function"}]}, r"tools\[0\]: function: Field required"),
    ({"tools": [WEATHER, WEATHER]}, r"tools\[1\].function.name 'get_weather' repeats tools\[0\]'s"),
    ({"tools": [WEATHER], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set 'tools'"),
])
def test_bad_tools_are_value_errors(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE, **kwargs)
    bad_call = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls: function: Field required"):
        llm.chat(bad_call, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE)
