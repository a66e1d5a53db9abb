"""`benchmarks/kernels.py`'s parts: its timers, its batches (page orders, engine-shaped padding), its config
names, and the summaries of the Mosaic kernel's in-kernel profile (sizes tiny, CPU)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from test_benchmarks_smoke import BENCH


@pytest.fixture
def kernels():
    """The benchmark module (benchmarks/ on the path, as the scripts run)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module("kernels")


def _calls(kernels) -> str:
    """Calls per timing: a GPU runs the tiny launches in microseconds, so 4 of them net of the program's
    fixed cost measured nothing there (nan; session 46). 200 passed on an H200 (the rope+write test then
    takes ~140 s there, its programs unrolling 200 and 400 calls)."""
    return "4" if kernels.jax.default_backend() != "gpu" else "200"

def test_kernels_bench_times_net_of_program_cost(kernels, tmp_path):
    out = tmp_path / "k.json"
    for _ in range(3):  # on a loaded 2-core CPU the net time of 4 calls came out <= 0 (nan) once in several runs
        kernels.main(["--impl", "reference", "--mode", "decode", "--batch", "8", "--ctx", "2048",
                      "--calls", _calls(kernels), "--no-bundled", "--json", str(out)])
        (row,) = json.loads(out.read_text())["rows"]
        if row["us"] > 0:
            break
    assert (row["mode"], row["batch"], row["ctx"]) == ("decode", 8, 2048) and row["us"] > 0
    if kernels.jax.default_backend() != "gpu":  # CUPTI counts CUDA kernels: refused up front elsewhere
        with pytest.raises(SystemExit):
            kernels.main(["--impl", "reference", "--mode", "decode", "--batch", "8", "--ctx", "64", "--timer", "cupti"])


def test_kernels_bench_times_the_rope_and_kv_write(kernels, tmp_path):
    out = tmp_path / "k.json"
    kernels.main(["--impl", "reference", "--mode", "decode", "--batch", "8", "--ctx", "256",
                  "--calls", _calls(kernels), "--no-bundled", "--write-kv", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    writes = {r["config"]: r for r in rows if r["config"].startswith("rope+write")}
    gpu = kernels.jax.default_backend() == "gpu"  # the Pallas kernel is timed there too
    assert sorted(writes) == (["rope+write Pallas", "rope+write XLA"] if gpu else ["rope+write XLA"])
    assert all(w["batch"] == 8 and "us" in w and "write_gb_s" in w for w in writes.values())
    assert not gpu or all(w["us"] > 0 for w in writes.values())  # a loaded 2-core CPU may net 4 calls to nan


def test_kernels_region_summary_reads_the_in_kernel_trace(kernels, tmp_path):
    """`region_summary` on a trace in the on-device profiler's format (ts = (globaltimer ns + cycles)
    / 1e3, one track per warpgroup, pid = 1 + SM): cycles per region, programs (tracks with a
    prologue) and how many programs each SM started together."""

    def track(tid, sm, start, blocks):
        events, t = [], start
        for name, cycles in [("prologue", 1000)] + [("wait", 300), ("qk", 200)] * blocks + [("epilogue", 500)]:
            events += [dict(name=name, ph="B", ts=t, pid=1 + sm, tid=tid),
                       dict(name=name, ph="E", ts=t + cycles / 1e3, pid=1 + sm, tid=tid)]
            t += cycles / 1e3 + 0.01
        return events

    events = track(1, 0, 100.0, 2) + track(2, 0, 100.2, 2) + track(3, 1, 100.1, 4) + track(4, 0, 130.0, 2)
    events += [dict(name="Init", ph="B", ts=100.0, pid=1, tid=9), dict(name="Init", ph="E", ts=100.1, pid=1, tid=9)]
    path = tmp_path / "k-1-trace.json"
    path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
    s = kernels.region_summary(str(path))
    assert s["programs"] == 4  # the Init-only track is not a program
    assert s["programs_per_sm_at_launch"] == {1: 1, 2: 1}  # SM 0 started two at once (the third later)
    wait = s["regions"]["wait"]
    assert wait["events"] == 10 and wait["cycles_per_event"] == pytest.approx(300)
    assert wait["cycles_per_program"] == pytest.approx(750)
    assert s["regions"]["prologue"]["cycles_per_event"] == pytest.approx(1000)


def test_kernels_region_profile_applies_to_the_transposed_mosaic_kernel_only(kernels):
    import jax

    args = kernels.make_batch(jax.random.key(0), [1] * 8, [640] * 8, page_size=16, dtype=jax.numpy.bfloat16,
                              kv_dtype=jax.numpy.float8_e4m3fn)
    table = kernels.transposed_config(None, args, 16)  # a decode bucket: the table's transposed tile
    assert table is not None and table.transposed and table.block_q == 1
    assert kernels.transposed_config(kernels.parse_config("mt:64,3,1,1"), args, 16).num_stages == 3
    for other in ("triton", "m:64,2,1", "4,32,1,4,1"):
        assert kernels.transposed_config(kernels.parse_config(other), args, 16) is None


@pytest.mark.parametrize("text", ["mt:64,2,4,1", "mt:64,2,1", "m:128,3,1,1,1", "m:64,2,1,,2", "4,32,1,4,1"])
def test_kernels_bench_config_names_round_trip(kernels, text):
    config = kernels.parse_config(text)
    assert kernels.parse_config(kernels.config_name(config)) == config
    assert kernels.parse_config("mt:64,2,4").transposed and not kernels.parse_config("m:64,2,4").transposed


def test_kernels_make_batch_page_orders(kernels):
    """`--page-order runs` gives each sequence consecutive cache pages; "random" permutes them; either
    way every sequence has pages of its own."""
    import numpy as np

    for order in ("random", "runs"):
        args = kernels.make_batch(kernels.jax.random.key(0), [1] * 3, [40, 64, 17], page_size=16,
                                  dtype=kernels.jnp.bfloat16, page_order=order)
        table = np.asarray(args[3])
        pages = [table[0, :3], table[1, :4], table[2, :2]]
        assert len(set(np.concatenate(pages))) == 9
        if order == "runs":
            assert list(np.concatenate(pages)) == list(range(9))
    with pytest.raises(ValueError, match="page_order"):
        kernels.make_batch(kernels.jax.random.key(0), [1], [40], page_size=16, dtype=kernels.jnp.bfloat16,
                           page_order="sorted")


def test_kernels_batches_pad_like_an_engine_step_and_attend_the_same(kernels, tmp_path):
    """--token-buckets / --seq-buckets / --max-model-len: q, the sequence rows and the page table grow as an
    engine's bucket does (batch 1 as 8 token rows, 8 sequence rows, 1024 tokens of table), and the real rows'
    attention is unchanged."""
    import numpy as np

    key, kw = kernels.jax.random.key(0), dict(page_size=16, dtype=kernels.jnp.float32, hq=4, hkv=2, d=16)
    plain = kernels.make_batch(key, [1, 1], [40, 17], **kw)
    padded = kernels.make_batch(key, [1, 1], [40, 17], num_tokens=8, num_seqs=8, max_model_len=1024, **kw)
    q, _, lens, table, cu, num_seqs = padded
    assert q.shape[0] == 8 and lens.shape == (8,) and table.shape == (8, 64) and cu.shape == (9,)
    assert list(np.asarray(lens)) == [40, 17] + [0] * 6 and list(np.asarray(cu)) == [0, 1] + [2] * 7
    assert int(num_seqs[0]) == 2
    attend = kernels.reference.ragged_paged_attention
    want = np.asarray(attend(*plain, sm_scale=0.25))
    got = np.asarray(attend(q.at[:2].set(plain[0]), *padded[1:], sm_scale=0.25))
    np.testing.assert_allclose(got[:2], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[2:], 0.0)  # padding rows
    out = tmp_path / "k.json"
    kernels.main(["--impl", "reference", "--mode", "decode", "--batch", "1", "--ctx", "64", "--calls", "2",
                  "--token-buckets", "8", "64", "--seq-buckets", "8", "--max-model-len", "256", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["batch"], row["ctx"], row["config"], row["bundled_us"]) == (1, 64, "table", None)
