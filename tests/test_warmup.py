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
