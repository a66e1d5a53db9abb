"""Which tokens a request may produce: `allowed_token_ids` (greedy takes the argmax over them, sampling stays
inside them) and `bad_words` (a banned word's last token, right after the rest of it), with their checks."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import FIXTURE, GREEDY16, HF_CASES, _assert_no_leak, _greedy_tokens, _make_llm

from jengine import SamplingParams
from jengine.generate import prompt_logits
from jengine.loader import load_model
from jengine.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def llm():
    return _make_llm()


def test_greedy_with_allowed_token_ids_takes_the_argmax_over_them(llm):
    prompt = HF_CASES[0][0]
    free = _greedy_tokens(llm, [prompt])[0]
    allowed = [t for t in range(3, 256, 7) if t not in free]  # none of the unconstrained choices
    constrained = GREEDY16.clone(allowed_token_ids=allowed, logprobs=0)
    outs = llm.generate([prompt, prompt], [constrained, GREEDY16], use_tqdm=False)
    out = outs[0].outputs[0]
    assert outs[1].outputs[0].token_ids == free  # the other row of the batch is unconstrained
    cfg, params = load_model(FIXTURE, dtype="float32")
    logits = prompt_logits(cfg, params, prompt + out.token_ids)[len(prompt) - 1 : -1]  # row i predicts output i
    assert out.token_ids == [allowed[int(np.argmax(row[allowed]))] for row in logits]
    # logprobs are the model's own, as with logit_bias (vLLM's raw_logprobs), whose first choice (free[0])
    # the first token is not
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    assert [entry[tok].logprob for tok, entry in zip(out.token_ids, out.logprobs)] == pytest.approx(
        [logprobs[i, tok] for i, tok in enumerate(out.token_ids)], abs=2e-3)
    assert out.logprobs[0][out.token_ids[0]].rank > 1
    _assert_no_leak(llm)


def test_sampled_tokens_stay_in_allowed_token_ids(llm):
    allowed = [5, 17, 42, 99, 200]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
              for seed in range(4)]
    tokens = [t for o in llm.generate([HF_CASES[1][0]] * 4, params, use_tqdm=False) for t in o.outputs[0].token_ids]
    assert len(tokens) == 48 and set(tokens) <= set(allowed) and len(set(tokens)) > 2
    _assert_no_leak(llm)


LETTERS = list(range(ord("a"), ord("z") + 1))


@pytest.fixture
def with_tokenizer(llm, monkeypatch):
    """The fixture model (vocabulary 256) with the byte tokenizer, which bad words need."""
    monkeypatch.setattr(llm.engine, "tokenizer", byte_tokenizer())
    return llm


def test_a_one_token_bad_word_from_the_output_is_never_sampled(with_tokenizer):
    prompt, greedy = list(b"hello world"), GREEDY16.clone(max_tokens=24)
    free = with_tokenizer.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    word = next(chr(t) for t in free.token_ids if 33 <= t < 127)  # printable and not a space: one byte
    assert word in free.text
    out = with_tokenizer.generate([prompt], greedy.clone(bad_words=[word]), use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(ord(word))
    assert out.token_ids[:first] == free.token_ids[:first] and out.token_ids[first] != ord(word)
    assert ord(word) not in out.token_ids and word not in out.text
    _assert_no_leak(with_tokenizer)


def test_a_two_token_bad_word_bans_its_last_token_only_right_after_its_first(with_tokenizer):
    """Within letters (allowed_token_ids), so that the text is the tokens. The word is the first pair of
    the unconstrained output whose second letter came earlier after another letter: that one stays. A
    word whose first letter ends the prompt bans nothing: vLLM matches the output only."""
    prompt, letters = list(b"hello world"), GREEDY16.clone(max_tokens=24, allowed_token_ids=LETTERS)
    free = with_tokenizer.generate([prompt], letters, use_tqdm=False)[0].outputs[0]
    ids = free.token_ids
    i = next(i for i in range(1, len(ids) - 1)
             if any(ids[j] == ids[i + 1] and ids[j - 1] != ids[i] for j in range(1, i + 1)))
    word, prompt_word = free.text[i : i + 2], chr(prompt[-1]) + free.text[0]
    assert word == chr(ids[i]) + chr(ids[i + 1]) and prompt_word not in free.text
    outs = with_tokenizer.generate([prompt, prompt], [letters.clone(bad_words=[word]),
                                                      letters.clone(bad_words=[prompt_word])], use_tqdm=False)
    out = outs[0].outputs[0]
    assert out.token_ids[: i + 1] == ids[: i + 1]  # the last letter earlier, after another one: kept
    assert out.token_ids[i + 1] != ids[i + 1] and word not in out.text
    assert outs[1].outputs[0].token_ids == ids
    _assert_no_leak(with_tokenizer)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(allowed_token_ids=[]), "allowed_token_ids must name at least one token"),
    (dict(allowed_token_ids=[3, 256]), r"allowed_token_ids has token ids outside the vocabulary \[0, 256\): \[256\]"),
    (dict(allowed_token_ids=["3"]), "allowed_token_ids must be token ids"),
    (dict(bad_words=["ok", 5]), "bad_words must be non-empty strings, got 5"),
    (dict(bad_words=["x"]), "bad_words need a tokenizer"),  # the fixture model has none
])
def test_bad_allowed_token_ids_and_bad_words_are_value_errors_naming_the_field(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2]], SamplingParams(**kwargs), use_tqdm=False)
    _assert_no_leak(llm)


def test_bad_words_outside_the_models_vocabulary_are_value_errors(with_tokenizer):
    with pytest.raises(ValueError, match=r"bad_words encode to token ids outside the vocabulary \[0, 256\): \[260\]"):
        with_tokenizer.generate([[1, 2]], SamplingParams(bad_words=["<|eot|>"]), use_tqdm=False)
    _assert_no_leak(with_tokenizer)
