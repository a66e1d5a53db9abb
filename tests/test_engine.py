"""The engine's greedy output equals transformers' token for token under every scheduling mode."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from jengine import LLM, SamplingParams
from jengine.generate import greedy_generate, prompt_logits
from jengine.loader import load_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "models", "llama")
GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _hf_cases():
    data = np.load(os.path.join(FIXTURE, "expected.npz"))
    n = len([k for k in data.files if k.startswith("prompt_")])
    return [(data[f"prompt_{i}"].tolist(), data[f"greedy_{i}"].tolist()) for i in range(n)]


HF_CASES = _hf_cases()


def _make_llm(**kw):
    args = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                token_buckets=(8, 64), seq_buckets=(4,), use_tqdm_on_load=False)
    args.update(kw)
    return LLM(FIXTURE, **args)


def _assert_no_leak(llm):
    bm = llm.engine.scheduler.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()


def _greedy_tokens(llm, prompts):
    outs = llm.generate([list(p) for p in prompts], GREEDY16, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm():
    return _make_llm()


def test_greedy_one_request_at_a_time_matches_transformers(llm):
    for prompt, expected in HF_CASES:
        assert _greedy_tokens(llm, [prompt]) == [expected]
    _assert_no_leak(llm)


def test_greedy_batch_matches_transformers(llm):
    prompts = [p for p, _ in HF_CASES]
    assert _greedy_tokens(llm, prompts) == [e for _, e in HF_CASES]
    _assert_no_leak(llm)


def test_chunked_prefill_with_tiny_budget_matches_transformers():
    # A fixed pool: on a GPU, engines built earlier in the process still hold device memory, and sizing
    # the pool from what was free found "only 0 KV pages" (H200 runs, benchmarks/RESULTS.md).
    # Off: chunks beside running decodes (the server's order); test_prefill_first_* below has it on.
    llm = _make_llm(max_num_batched_tokens=8, token_buckets=(8,), max_num_seqs=4, num_gpu_blocks_override=64,
                    prefill_first=False)
    prompts = [p for p, _ in HF_CASES]
    assert _greedy_tokens(llm, prompts) == [e for _, e in HF_CASES]
    _assert_prompt_logprobs_match_logits(llm, HF_CASES[3][0])  # a prompt split over five chunks
    _assert_no_leak(llm)


def test_prefill_first_with_chunks_and_preemption_matches_transformers():
    # Prompt steps hold no decodes; four prompts over 8-token chunks, on a pool small enough that the
    # decodes preempt each other.
    cfg, params = load_model(FIXTURE, dtype="float32")
    prompts = [p for p, _ in HF_CASES] + [HF_CASES[3][0][i : i + 32] for i in range(2)]
    expected = [e for _, e in HF_CASES] + [greedy_generate(cfg, params, p, 16, stop_at_eos=False) for p in prompts[-2:]]
    llm = _make_llm(max_num_batched_tokens=8, token_buckets=(8,), max_num_seqs=4, num_gpu_blocks_override=8,
                    prefill_first=True)
    assert _greedy_tokens(llm, prompts) == expected
    assert llm.engine.stats["preemptions"] > 0
    _assert_no_leak(llm)


def test_prefill_first_is_a_server_and_cli_flag():
    import argparse

    from jengine.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["prefill_first"] is None  # by entry point: see below
    assert engine_kwargs(parser.parse_args(["--prefill-first"]))["prefill_first"] is True
    assert engine_kwargs(parser.parse_args(["--prefill-first", "--no-prefill-first"]))["prefill_first"] is False


def test_the_offline_llm_runs_prompts_first_unless_told_otherwise(llm):
    # an engine built from a config (AsyncLLM, the server) keeps it off, and a value given stays:
    # test_engine_config.py
    assert llm.engine.config.prefill_first is True and llm.engine.scheduler.prefill_first is True


def _assert_prompt_logprobs_match_logits(llm, prompt, k=2):
    cfg, params = load_model(FIXTURE, dtype="float32")
    logits = prompt_logits(cfg, params, prompt)
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    ranks_seen = []
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        # 2e-3: on a GPU, f32 matmuls may run in TF32.
        own = logprobs[pos - 1, prompt[pos]]
        assert entry[prompt[pos]].logprob == pytest.approx(own, abs=2e-3)
        top = np.argsort(-logprobs[pos - 1])[:k]
        assert {int(t) for t in top} <= set(entry) and len(entry) <= k + 1
        assert [entry[int(t)].rank for t in top] == list(range(1, k + 1))
        # The prompt token's rank over the whole vocabulary, in or out of the top k (within the tolerance).
        rank = entry[prompt[pos]].rank
        assert np.sum(logprobs[pos - 1] > own + 2e-3) <= rank <= np.sum(logprobs[pos - 1] >= own - 2e-3)
        ranks_seen.append(rank)
    assert max(ranks_seen) > 20  # some prompt tokens sit outside the 20 the device ranks by place


def test_prompt_logprobs_match_the_models_logits_even_for_a_cached_prefix(llm):
    prompt = HF_CASES[3][0]
    llm.generate([prompt], GREEDY16, use_tqdm=False)  # its full pages are now in the prefix cache
    _assert_prompt_logprobs_match_logits(llm, prompt)
    _assert_no_leak(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs_exact(mode):
    # 6 usable pages of 16 tokens: three 32-token prompts fill them at admission, and each needs a
    # third page to decode, so requests are preempted and resumed.
    cfg, params = load_model(FIXTURE, dtype="float32")
    base = HF_CASES[3][0]
    prompts = [base[i : i + 32] for i in range(4)]
    expected = [greedy_generate(cfg, params, p, 16, stop_at_eos=False) for p in prompts]
    llm = _make_llm(num_gpu_blocks_override=7, preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=128,
                    token_buckets=(8, 128))
    assert _greedy_tokens(llm, prompts) == expected
    assert llm.engine.stats["preemptions"] > 0
    _assert_no_leak(llm)


def test_prefix_caching_skips_shared_prefill_and_keeps_outputs(llm):
    cfg, params = load_model(FIXTURE, dtype="float32")
    shared = [(7 * t + 3) % 256 for t in HF_CASES[3][0][:32]]  # two full pages, not cached yet
    prompts = [shared + [5 + i, 7 + i, 11 + i] for i in range(3)]
    expected = [greedy_generate(cfg, params, p, 16, stop_at_eos=False) for p in prompts]
    before = llm.engine.stats["computed_prompt_tokens"]
    assert _greedy_tokens(llm, prompts[:1]) == expected[:1]
    first = llm.engine.stats["computed_prompt_tokens"] - before
    assert first == len(prompts[0])
    assert _greedy_tokens(llm, prompts[1:]) == expected[1:]
    rest = llm.engine.stats["computed_prompt_tokens"] - before - first
    assert rest == 2 * (len(prompts[1]) - len(shared))
    _assert_no_leak(llm)


def test_request_output_is_the_same_alone_and_in_a_full_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = HF_CASES[2][0]
    alone = llm.generate([prompt], [seeded], use_tqdm=False)[0].outputs[0].token_ids
    others = [HF_CASES[i][0] for i in (0, 1, 3)]
    batch = llm.generate(others[:1] + [prompt] + others[1:],
                         [SamplingParams(temperature=1.0, max_tokens=10), seeded,
                          GREEDY16, SamplingParams(temperature=0.5, seed=7)], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    _assert_no_leak(llm)


def test_start_up_freezes_the_heap_so_full_collections_do_not_stall_steps():
    gc.unfreeze()
    llm = _make_llm()
    assert gc.get_freeze_count() > 10_000  # JAX, the programs, the engine: out of the collector's reach
    assert _greedy_tokens(llm, [HF_CASES[0][0]])[0] == HF_CASES[0][1][:16]
    _assert_no_leak(llm)


def test_a_step_that_needs_the_last_tokens_launches_its_forward_before_reading_them(llm):
    """Penalties (also multi-token bad words, structured outputs) need each row's previous token on the host
    for the sampling tables: the next forward is launched first, so it runs while those tokens come back."""
    engine, calls = llm.engine, []
    forward, resolve = engine.runner.launch_forward, engine._resolve

    def spy_forward(*a, **k):
        calls.append("forward")
        return forward(*a, **k)

    def spy_resolve(*a, **k):
        calls.append("resolve")
        return resolve(*a, **k)

    engine.runner.launch_forward, engine._resolve = spy_forward, spy_resolve
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3)
        plain = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
        calls.clear()
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        engine.runner.launch_forward, engine._resolve = forward, resolve
    assert len(out) == 6 and len(set(out)) >= len(set(plain))  # the penalty applied (no more repeats)
    # every step after the first: its forward, then the previous step's tokens
    assert calls[:2] == ["forward", "forward"] and calls.count("forward") == 6
    assert all(calls[i:i + 2] == ["forward", "resolve"] for i in range(1, 2 * 5, 2))
    assert not engine._history  # finished requests leave the set of rows that need their last token
    engine.add_request("aborted", [5, 6], params)
    assert engine._history == {"aborted"}
    engine.abort_request("aborted")
    assert not engine._history
    _assert_no_leak(llm)


def test_penalties_from_kept_windows_equal_penalties_counted_every_step(llm, monkeypatch):
    from jengine.penalty_window import PenaltyWindow, count_penalty_window

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.3)
    prompts = [[5, 6, 7, 5], [9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8]]
    kept = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(PenaltyWindow, "rows", lambda self, p, o, V, W: count_penalty_window(p, o, V, W))
    counted = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert kept == counted and all(len(k) == 24 for k in kept)
    _assert_no_leak(llm)
