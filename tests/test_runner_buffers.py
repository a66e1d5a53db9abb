"""The buffers a step's programs write their outputs over (logits, hidden states, sampled ids) keep
their addresses from step to step, and on GPUs each forward is loaded twice and a bucket's steps take
the copies in turn: XLA re-records the commands of a CUDA graph whose buffers moved since its last run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jengine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("jengine/tiny-llama", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
               token_buckets=(4, 16), seq_buckets=(2, 4), num_gpu_blocks_override=64, compilation_cache_dir=None,
               prefill_first=False, use_tqdm_on_load=False)  # off: mixed steps (prompt chunks beside decodes)


def _addresses(runner) -> dict:
    buffers = {"prev_ids": runner.prev_ids}
    buffers.update({("logits", s): x for s, x in runner.logits_buffers.items()})
    buffers.update({("hidden", t): x for t, x in runner.hidden_buffers.items()})
    assert not any(x.is_deleted() for x in buffers.values())
    return {name: x.unsafe_buffer_pointer() for name, x in buffers.items()}


def test_warmup_makes_every_buckets_buffers(llm):
    runner = llm.engine.runner
    buckets = runner.buckets()
    assert set(runner.logits_buffers) == {s for _, s in buckets}
    assert set(runner.hidden_buffers) == {t for t, _ in buckets}


def test_warmup_runs_every_program_it_made(llm, monkeypatch):
    """Each executable's first run (slow on the host: XLA records its CUDA graphs) belongs to start-up:
    warm-up runs every forward, sampler variant and prompt-logprobs program once."""
    runner = llm.engine.runner
    ran = []
    real = type(runner).program
    monkeypatch.setattr(type(runner), "program", lambda self, kind, *key: ran.append((kind, *key)) or real(
        self, kind, *key))
    llm.engine.builder._run_every_program(runner.buckets())
    assert set(ran) == set(runner.compiled)
    assert {k[0] for k in ran} == {"forward", "sample", "top_logprobs", "mask", "prompt_logprobs"}


def test_steps_leave_every_buffer_where_the_last_run_left_it(llm):
    runner = llm.engine.runner
    prompts = [[1, 2, 3], list(range(5, 25)), [7] * 9]  # prefill chunks, mixed steps and decodes
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, presence_penalty=0.5)]
    # A first run uses every bucket once (and on the CPU a donated buffer may move once), then none moves.
    first = llm.generate(prompts, params, use_tqdm=False)
    before, steps = _addresses(runner), llm.engine.stats["steps"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 4, 3]
    assert outs[0].outputs[0].token_ids == first[0].outputs[0].token_ids  # greedy: the same tokens again
    assert llm.engine.stats["steps"] - steps >= 6
    assert _addresses(runner) == before


# Copied forwards forced on the CPU, in a process with no compilation cache: a CPU copy of an executable that JAX
# loaded from its persistent cache would lack its kernels, and in this process earlier tests enabled it.
_COPIES_SCRIPT = """
import json
import jengine.runner
if %(copied)r:
    jengine.runner.stores_loaded_executables = lambda: True
from jengine import LLM, SamplingParams
llm = LLM("jengine/tiny-llama", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(4, 16),
          seq_buckets=(2, 4), num_gpu_blocks_override=64, compilation_cache_dir=None, use_tqdm_on_load=False)
runner = llm.engine.runner
forwards = {key[1]: c for key, c in runner.compiled.items() if key[0] == "forward"}
decode = {runner.trace_forward(b)[0][1] for b in runner.buckets() if b[0] <= runner.max_seqs}  # (4, S) buckets
runs = dict(runner._runs)
n = jengine.runner.FORWARD_COPIES
warm = all(runs.get(k) == n for k in decode) and all(runs.get(k) == 1 for k in set(forwards) - decode)
outs = llm.generate(%(prompts)r, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
print(json.dumps({"copied": runner.graphs and set(runner.copies) == decode and len(forwards) > len(decode),
                  "distinct": all(len({id(c) for c in (forwards[k], *runner.copies.get(k, ()))}) == n for k in decode),
                  "copies": n,
                  "warm": warm,
                  "most_runs": max(runner._runs[k] - runs.get(k, 0) for k in runner._runs),
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def _copies_run(prompts, copied: bool) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    script = _COPIES_SCRIPT % {"copied": copied, "prompts": prompts}
    proc = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_copied_forwards_take_turns_and_give_the_same_tokens(llm):
    """On GPUs the forward of each bucket decode steps can use is loaded `FORWARD_COPIES` times, and the
    bucket's steps take the copies in turn (each keeps its own CUDA graph); the tokens are those of one
    copy alone. The copies are forced on the CPU, so the tokens to match are the CPU's: the module's engine's
    where it runs on the CPU, else those of a CPU engine without copies (a GPU's logits differ in rounding)."""
    prompts = [[1, 2, 3], list(range(5, 25)), [7] * 9]
    copies = _copies_run(prompts, copied=True)
    assert copies["copied"] and copies["distinct"] and copies["copies"] >= 2
    assert copies["warm"]  # warm-up ran each copy of a copied forward once, and every other forward once
    assert copies["most_runs"] >= 2 * copies["copies"]  # a bucket ran on every copy, twice
    if jax.default_backend() == "cpu":
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    else:
        single = _copies_run(prompts, copied=False)
        assert not single["copied"]
        expected = single["tokens"]
    assert copies["tokens"] == expected


@pytest.mark.parametrize("num_tokens", [16, 48, 50])
def test_prompt_logprobs_in_chunks_equal_one_pass(monkeypatch, num_tokens):
    """Prompt logprobs loop over chunks on the device (the last one padded when T is not a multiple of
    the chunk); every position's logprob and top ids equal those of one pass over all T rows."""
    import jax.numpy as jnp
    import numpy as np

    from jengine import runner as runner_module
    from jengine.loader import load_model

    cfg, params = load_model(os.path.join(os.path.dirname(__file__), "fixtures", "models", "llama"), dtype="float32")
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(num_tokens, cfg.hidden_size)), jnp.float32)
    targets = jnp.asarray(rng.integers(-1, cfg.vocab_size, num_tokens), jnp.int32)  # -1: no next token

    def run(chunk):
        monkeypatch.setattr(runner_module, "PROMPT_LOGPROBS_CHUNK", chunk)
        return runner_module._prompt_logprobs(params, hidden, targets, cfg=cfg)  # eager: traced anew each time

    whole, chunked = run(num_tokens), run(16)
    for got, want in zip(chunked, whole, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_logprobs_batch_takes_its_top_logprobs_from_their_own_program_with_the_fused_results(llm):
    """Top logprobs are a program of their own after the sampling program (so the sampling variants have no
    top-logprobs twins): its sampled logprobs, ranks and top ids and logprobs are those of the sampling
    program that computes them itself."""
    import jax
    import numpy as np

    from jengine.runner import SAMPLER_VARIANTS
    from jengine.sampler import sample
    from jengine.sampling_tables import SamplingRow, build_sampling_tensors, sampler_switches

    runner = llm.engine.runner
    assert not any(v.top_logprobs for v in SAMPLER_VARIANTS)
    vocab, rows = runner.cfg.vocab_size, 4
    logits = jax.numpy.asarray(np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32))
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, top_p=0.8, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, seed=2, logprobs=5)]
    tensors = build_sampling_tensors([SamplingRow(p, [1, 2], []) for p in params], rows, vocab)
    switches = sampler_switches(tensors, vocab)
    assert switches.top_logprobs
    out, _ = runner.launch_sample((logits, None, None), tensors)
    fused = jax.jit(sample, static_argnames=switches._fields)(logits, tensors, **switches._asdict())
    tol = 0.0 if jax.default_backend() == "cpu" else 1e-5  # elsewhere two programs may round differently
    for got, want in zip(out, fused):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=tol if got.dtype.kind == "f" else 0)


def test_a_guided_batch_masks_the_logits_buffer_in_place_then_samples_as_an_unguided_one(llm):
    """Structured outputs: the runner masks the step's logits (a program of its own, over the donated logits
    buffer, which keeps its address) and then runs the sampling variant and top-logprobs program an unguided
    batch of the same options would: the results are those of one program sampling the masked logits."""
    import jax
    import numpy as np

    from jengine.sampler import apply_token_bitmask, sample
    from jengine.sampling_tables import SamplingRow, build_sampling_tensors, program_inputs, sampler_switches
    from jengine.structured_output import bitmask_words

    runner = llm.engine.runner
    vocab, rows = runner.cfg.vocab_size, 4
    words = bitmask_words(vocab)
    rng = np.random.default_rng(1)
    bitmask = rng.integers(0, 2**32, (3, words), dtype=np.uint64).astype(np.uint32).view(np.int32)  # 3 guided rows
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.9, top_p=0.8, seed=1),
              SamplingParams(temperature=1.1, top_k=5, seed=2)]
    tensors = build_sampling_tensors([SamplingRow(p, [1, 2], []) for p in params], rows, vocab, token_bitmask=bitmask)
    buffer = runner.logits_buffers[rows]
    address, logits = buffer.unsafe_buffer_pointer(), np.asarray(buffer).copy()
    out, _ = runner.launch_sample((buffer, None, None), tensors)
    assert runner.logits_buffers[rows].unsafe_buffer_pointer() == address
    masked = apply_token_bitmask(jax.numpy.asarray(logits), jax.numpy.asarray(tensors.token_bitmask))
    np.testing.assert_array_equal(np.asarray(runner.logits_buffers[rows]), np.asarray(masked))
    switches = sampler_switches(tensors, vocab)
    assert switches.top_logprobs and switches.filter_k
    fused = jax.jit(sample, static_argnames=switches._fields)(masked, program_inputs(tensors, switches),
                                                             **switches._asdict())
    tol = 0.0 if jax.default_backend() == "cpu" else 1e-5  # elsewhere two programs may round differently
    for got, want in zip(out, fused):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=tol if got.dtype.kind == "f" else 0)
    allowed = (np.asarray(tensors.token_bitmask)[np.arange(rows)[:, None], np.arange(vocab) // 32]
               >> (np.arange(vocab) % 32)) & 1
    assert all(allowed[r, int(t)] for r, t in enumerate(np.asarray(out.next_ids)[:3]))
