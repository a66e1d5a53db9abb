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
