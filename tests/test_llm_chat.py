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
])
def test_bad_conversations_and_options_are_value_errors(llm, messages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    assert llm.engine.num_unfinished_requests() == 0
