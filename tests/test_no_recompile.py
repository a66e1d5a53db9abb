"""After warm-up, no request mix, sampling option or scheduling event compiles anything new."""

from __future__ import annotations

import random

import jax
import pytest

from jengine import LLM, SamplingParams

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compile_counter():
    events = []

    def listener(event, duration, **kwargs):
        if event == _COMPILE_EVENT:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)


def _random_params(rng: random.Random) -> SamplingParams:
    options = dict(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.7:
        options.update(temperature=rng.choice([0.5, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9, 0.5]),
                       top_k=rng.choice([0, 5, 50]), min_p=rng.choice([0.0, 0.1]))
    else:
        options.update(temperature=0.0)
    if rng.random() < 0.3:
        options.update(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.2)
    if rng.random() < 0.3:
        options.update(logit_bias={rng.randrange(256): 5.0}, seed=rng.randrange(1000))
    if rng.random() < 0.3:
        options.update(logprobs=rng.randint(0, 5), n=rng.randint(1, 3), prompt_logprobs=rng.choice([None, 2]))
    if rng.random() < 0.2:
        options.update(stop=["ab"], stop_token_ids=[rng.randrange(256)], min_tokens=1)
    if rng.random() < 0.2:  # a one-token and a two-token word, and a bias table of allowed ids
        options.update(bad_words=["q", "ab"], allowed_token_ids=rng.sample(range(384), rng.choice([1, 3, 200])))
    elif rng.random() < 0.25:  # structured outputs: the guided sampling programs
        options.update(structured_outputs=rng.choice([{"regex": "[a-f0-9]{3,20}"}, {"choice": ["yes", "no"]},
                                                      {"json_object": True}]))
    return SamplingParams(**options)


def test_randomised_workload_compiles_nothing_after_warmup(compile_counter):
    # A pool small enough to preempt (swap), buckets small enough to warm up quickly.
    llm = LLM("jengine/tiny-llama", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
              token_buckets=(8, 32), seq_buckets=(4, 8), num_gpu_blocks_override=12, preemption_mode="swap",
              swap_space=0.05, use_tqdm_on_load=False)
    assert compile_counter, "warm-up should have compiled the buckets"
    compile_counter.clear()
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]
    guided = 0
    for _ in range(4):
        prompts, params = [], []
        for _ in range(rng.randint(1, 10)):
            own = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
            prompts.append(shared + own if rng.random() < 0.4 else own)
            params.append(_random_params(rng))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert len(outputs) == len(prompts)
        guided += sum(p.structured_outputs is not None for p in params)
    assert llm.engine.stats["preemptions"] > 0 and guided > 0
    assert compile_counter == [], f"{len(compile_counter)} compilations after warm-up"
