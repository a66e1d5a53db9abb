"""Unit tests of the benchmarks' helpers that need no engine run: profile_step's trace summaries and the engine
flags every benchmark shares (common.py). The programs' end-to-end runs are in test_benchmarks_smoke.py."""

from __future__ import annotations

import sys

import pytest
from test_benchmarks_smoke import BENCH


@pytest.fixture(autouse=True)
def _benchmarks_on_path():
    """benchmarks/ on the path, as the scripts run."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)


def test_profile_summary_separates_step_boundary_gaps_from_kernel_spacing():
    from profile_step import summarise

    # two steps (ns): kernels 1 ns apart inside a step, a 13 ns wait between the steps, one overlap
    events = [("gemm_a", 0, 10), ("ragged_paged_attention", 11, 10), ("gemm_b", 15, 2),
              ("gemm_a", 34, 10), ("loop_add_fusion", 45, 3)]
    s = summarise(events, steps=2, top_n=2)
    assert s["busy_ms"] * 2 == pytest.approx(33e-6) and s["idle_ms"] * 2 == pytest.approx(15e-6)
    assert s["largest_gap_ms"] * 2 == pytest.approx(14e-6)  # the 13 ns boundary + the largest other gap
    assert s["median_gap_us"] == pytest.approx(1e-3)
    assert s["categories_ms"]["attention"] * 2 == pytest.approx(10e-6) and len(s["top_kernels"]) == 2
    # The trace opens with the first step's input copy and a wait while the host launches that step:
    # neither is idle time between steps.
    lead = [("MemcpyH2D", -500, 2)]
    assert summarise(lead + events, steps=2, top_n=2)["idle_ms"] == pytest.approx(s["idle_ms"])
    widest = summarise(events, steps=2, top_n=0, gaps_n=1)["widest_gaps"]
    assert widest == [{"us": pytest.approx(0.013), "after": "ragged_paged_attention", "before": "gemm_a"}]


def test_profile_sequence_lists_kernels_in_start_order_with_gaps():
    from profile_step import sequence

    events = [("gemm_b", 15_000, 2_000), ("MemcpyH2D", 0, 5_000), ("gemm_a", 1_000, 10_000),
              ("ragged_paged_attention", 12_000, 10_000)]
    rows = sequence(events, 1, 2)  # copies are not listed; the second and third kernels by start
    assert [r["name"] for r in rows] == ["ragged_paged_attention", "gemm_b"]
    assert [r["start_us"] for r in rows] == [0.0, 3.0] and [r["us"] for r in rows] == [10.0, 2.0]
    assert [r["gap_us"] for r in rows] == [0.0, -7.0]  # gemm_b started 7 us before attention ended
    with_copies = sequence(events, 0, 2, copies=True)
    assert [r["name"] for r in with_copies] == ["MemcpyH2D", "gemm_a"]
    assert [r["gap_us"] for r in with_copies] == [0.0, -4.0]


def test_engine_flags_pass_the_compilation_cache_dir_or_turn_it_off():
    import argparse

    from common import add_engine_flags, engine_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert "compilation_cache_dir" not in engine_args(parser.parse_args([]))  # the engine's default
    assert engine_args(parser.parse_args(["--compilation-cache-dir", "none"]))["compilation_cache_dir"] is None
    assert engine_args(parser.parse_args(["--compilation-cache-dir", "/tmp/c"]))["compilation_cache_dir"] == "/tmp/c"
    # a benchmark's own choice (startup.py's fresh directory) wins over the flag
    args = parser.parse_args(["--compilation-cache-dir", "none"])
    assert engine_args(args, compilation_cache_dir="/tmp/own")["compilation_cache_dir"] == "/tmp/own"
    # an explicit None (compile_variance.py's children) means no caches, not the engine's default
    assert engine_args(parser.parse_args([]), compilation_cache_dir=None)["compilation_cache_dir"] is None
    # the KV page size: the engine's default unless asked
    assert "block_size" not in engine_args(parser.parse_args([]))
    assert engine_args(parser.parse_args(["--block-size", "64"]))["block_size"] == 64
    # prompt-only steps while prompts fill a step: the offline LLM's default (on) unless named
    assert "prefill_first" not in engine_args(parser.parse_args([]))
    assert engine_args(parser.parse_args(["--prefill-first"]))["prefill_first"] is True
    assert engine_args(parser.parse_args(["--no-prefill-first"]))["prefill_first"] is False
    # bad engine flags are usage errors, not tracebacks from the engine's constructor
    for bad in (["--block-size", "24"], ["--max-num-seqs", "0"], ["--token-buckets", "64", "-8"],
                ["--gpu-memory-utilization", "0"], ["-tp", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


@pytest.mark.parametrize("python", [False, True])
def test_traces_record_python_calls_only_when_asked(tmp_path, python):
    """profile_step.start_trace (latency.py / profile_step.py --trace): JAX's Python tracer, which slows the host,
    records the engine's Python functions only with `python`; the runtime's annotations stay."""
    import jax
    import jax.numpy as jnp
    from profile_step import host_events, load_trace, start_trace

    def engine_step_marker(x):  # a Python function the Python tracer records by name
        return jax.jit(lambda y: y * 2 + 1)(x).block_until_ready()

    start_trace(str(tmp_path), python=python)
    try:
        engine_step_marker(jnp.ones(8))
    finally:
        jax.profiler.stop_trace()
    names = [name for name, _, _ in host_events(load_trace(str(tmp_path)), steps=1, top_n=10_000)]
    assert any("engine_step_marker" in n for n in names) == python
    assert any(n.startswith("PjitFunction") for n in names)  # the runtime's own annotation of the jit call


def _dataset_args(*argv):
    import argparse

    from common import add_dataset_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="jengine/tiny-llama")
    parser.add_argument("--max-model-len", type=int, default=64)
    add_dataset_flags(parser, num_prompts=4, input_len=8, output_len=4)
    return parser.parse_args(list(argv))


def _sharegpt_file(tmp_path, conversations) -> str:
    import json

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(conversations)]))
    return str(path)


def _exchange(prompt: str, reply: str) -> list[dict]:
    return [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}, {"from": "human", "value": "more"}]


def test_sharegpt_requests_take_first_exchanges_tokenized_and_fitting(tmp_path):
    from common import make_requests

    from jengine.tokenizer import load_tokenizer

    tok = load_tokenizer("jengine/tiny-llama")  # byte-level: a token per byte
    fits = [_exchange(f"question number {i}", f"answer {i}!") for i in range(5)]
    skipped = [_exchange("hi", "a reply long enough"),  # a prompt of 2 tokens
               _exchange("a long enough prompt", "ok"),  # reply of 2 tokens
               _exchange("x" * 60, "y" * 10),  # 61 + 10 tokens > --max-model-len 64
               [{"from": "human", "value": "alone"}], "not a conversation"]
    path = _sharegpt_file(tmp_path, fits[:2] + skipped + fits[2:])
    args = _dataset_args("--dataset", "sharegpt", "--dataset-path", path, "--num-prompts", "5")
    requests = make_requests(args, vocab=261)
    expected = {(tuple(tok(f"question number {i}").input_ids), len(f"answer {i}!")) for i in range(5)}
    assert {(tuple(p), o) for p, o in requests} == expected  # every fitting exchange, none of the others
    assert requests == make_requests(args, vocab=261)  # seeded
    assert make_requests(args, vocab=261, variant=1) != requests  # another order for another sweep point
    forced = make_requests(_dataset_args("--dataset", "sharegpt", "--dataset-path", path, "--num-prompts", "3",
                                         "--sharegpt-output-len", "7"), vocab=261)
    assert len(forced) == 3 and {o for _, o in forced} == {7}


@pytest.mark.parametrize("argv, message", [
    (("--dataset", "sharegpt"), "needs --dataset-path"),
    (("--dataset-path", "x.json"), "need --dataset sharegpt"),
    (("--sharegpt-output-len", "5"), "need --dataset sharegpt"),
    (("--dataset", "sharegpt", "--dataset-path", "/nonexistent/x.json"), "No such file"),
])
def test_dataset_flags_are_checked(argv, message):
    from common import make_requests

    with pytest.raises(ValueError, match=message):
        make_requests(_dataset_args(*argv), vocab=261)


def test_sharegpt_file_errors_name_the_file(tmp_path):
    from common import make_requests

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        make_requests(_dataset_args("--dataset", "sharegpt", "--dataset-path", str(bad)), vocab=261)
    bad.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        make_requests(_dataset_args("--dataset", "sharegpt", "--dataset-path", str(bad)), vocab=261)
    few = _sharegpt_file(tmp_path, [_exchange("a long enough prompt", "a long enough reply")])
    with pytest.raises(ValueError, match="1 of its 1 exchanges fit.*fewer than --num-prompts 4"):
        make_requests(_dataset_args("--dataset", "sharegpt", "--dataset-path", few), vocab=261)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):  # a preset without one
        make_requests(_dataset_args("--dataset", "sharegpt", "--dataset-path", few, "--num-prompts", "1",
                                    "--model", "jengine/llama-3.1-8b"), vocab=128256)


def test_arrival_gaps_keep_the_rate_and_vary_with_burstiness():
    import numpy as np
    from serving import arrival_gaps

    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    poisson, bursty, even = (np.array(arrival_gaps(20000, 10.0, b, 0)) for b in (1.0, 0.25, 4.0))
    for gaps in (poisson, bursty, even):  # the mean gap is 1 / rate whatever the shape
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    cv = {name: g.std() / g.mean() for name, g in (("poisson", poisson), ("bursty", bursty), ("even", even))}
    assert cv["poisson"] == pytest.approx(1.0, rel=0.05)  # exponential gaps
    assert cv["bursty"] == pytest.approx(2.0, rel=0.1) and cv["even"] == pytest.approx(0.5, rel=0.1)  # 1/sqrt(k)
    assert arrival_gaps(5, 10.0, 1.0, 0) == np.random.default_rng(0).exponential(0.1, 5).tolist()


def test_random_dataset_ranges_and_shared_prefix():
    from common import make_requests

    fixed = make_requests(_dataset_args("--max-model-len", "256", "--num-prompts", "3"), vocab=1000)
    assert [(len(p), o) for p, o in fixed] == [(8, 4)] * 3  # the defaults: --input-len 8, --output-len 4
    args = _dataset_args("--max-model-len", "256", "--num-prompts", "200", "--input-len", "20", "--output-len", "10",
                         "--random-range-ratio", "0.5", "--random-prefix-len", "6")
    requests = make_requests(args, vocab=1000)
    prefix = requests[0][0][:6]
    assert all(p[:6] == prefix for p, _ in requests)  # every prompt opens with the shared prefix
    inputs, outputs = {len(p) - 6 for p, _ in requests}, {o for _, o in requests}
    assert min(inputs) == 10 and max(inputs) == 30 and len(inputs) > 15  # uniform over [20 * 0.5, 20 * 1.5]
    assert min(outputs) == 5 and max(outputs) == 15
    assert make_requests(args, vocab=1000) == requests  # seeded
    other = make_requests(args, vocab=1000, variant=1)  # a sweep's next point: same lengths, no shared prompt
    assert [(len(p), o) for p, o in other] == [(len(p), o) for p, o in requests] and other[0][0][:6] != prefix
    assert fixed == make_requests(_dataset_args("--max-model-len", "256", "--num-prompts", "3",
                                                "--random-range-ratio", "0"), vocab=1000)


@pytest.mark.parametrize("argv, message", [
    (("--random-range-ratio", "1"), r"must be in \[0, 1\)"),
    (("--random-range-ratio", "-0.1"), r"must be in \[0, 1\)"),
    (("--random-range-ratio", "nan"), r"must be in \[0, 1\)"),
    (("--dataset", "chat-like", "--random-prefix-len", "4"), "need --dataset random"),
    (("--input-len", "50", "--output-len", "10", "--random-prefix-len", "5"), "= 65\\) exceeds --max-model-len 64"),
    (("--input-len", "63", "--output-len", "10", "--random-range-ratio", "0.1"), "exceeds --max-model-len 64"),
])
def test_random_dataset_flags_are_checked(argv, message):
    from common import make_requests

    with pytest.raises(ValueError, match=message):
        make_requests(_dataset_args(*argv), vocab=1000)
