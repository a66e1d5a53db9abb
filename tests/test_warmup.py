"""Warm-up's compile pool: its threads yield the cores to the thread that lowers programs for them."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from jengine import warmup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_compile_pool_threads_run_nicer_than_the_thread_that_lowers():
    mine = _nice()
    with warmup.compile_pool(3) as pool:
        theirs = set(pool.map(lambda _: _nice(), range(12)))
    assert theirs == {min(19, mine + warmup.COMPILE_NICENESS)}
    assert _nice() == mine  # the caller keeps its priority


def test_compile_pool_threads_stop_at_the_lowest_priority(monkeypatch):
    """A thread already near the lowest priority stays at 19 instead of failing."""
    monkeypatch.setattr(warmup, "COMPILE_NICENESS", 40)
    with warmup.compile_pool(1) as pool:
        assert pool.submit(_nice).result() == 19


# XLA's pool for `ShapeUtil::ForEachIndexParallel` (literal work of its compiler passes, such as constant folding),
# made by the first compile that needs it: in a process whose first such compile ran in a pool thread (the whole
# test suite), it keeps that thread's priority. It did no work while a CPU engine generated (0 ticks over 8 x 64
# tokens, against 10 for XLA's Eigen pool; session 48).
COMPILE_TIME_POOLS = {"tf_foreach"}


def test_no_thread_is_left_at_the_pools_priority_after_an_engine_is_built(tmp_path):
    """The pools' threads end with warm-up; threads XLA or JAX made meanwhile that keep running (their runtimes')
    must not inherit the lower priority, or serving would run below it."""
    from jengine import LLM, SamplingParams

    mine = _nice()
    llm = LLM("jengine/tiny-llama", max_model_len=64, token_buckets=(16,), seq_buckets=(2,), max_num_seqs=2,
              max_num_batched_tokens=16, compilation_cache_dir=str(tmp_path), use_tqdm_on_load=False)
    llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    niced = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
        except OSError:  # ended meanwhile
            continue
        name = name.split("(", 1)[1]
        if int(rest.split()[16]) != mine and name not in COMPILE_TIME_POOLS:  # the nice level, field 19 of stat
            niced[tid] = name
    assert not niced
