"""Build helper processes (jengine/build_helpers.py): who gets them, and a cold start that uses them
loads what they stored and generates what an engine without them does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jengine import build_helpers


@pytest.mark.parametrize("missing,cpus,platform,single,expected", [
    (18, 16, "gpu", True, 3),  # the 8B start-up: three helpers beside warm-up
    (18, 8, "gpu", True, 2),  # four cores each
    (18, 2, "gpu", True, 0),
    (5, 16, "gpu", True, 0),  # too few forwards to pay for a helper's start
    (6, 16, "gpu", True, 1),
    (18, 16, "cpu", True, 0),  # the compile pool needs those cores
    (18, 16, "tpu", True, 0),  # a TPU host's chips belong to one process
    (18, 16, "gpu", False, 0),  # tensor parallel: not yet
])
def test_helper_count(missing, cpus, platform, single, expected):
    assert build_helpers.helper_count(missing, cpus, platform, single) == expected


@pytest.mark.parametrize("room,expected", [(None, 3), (5, 3), (2, 2), (1, 1), (0, 0)])
def test_helper_count_within_the_memory_room(room, expected):
    assert build_helpers.helper_count(18, 16, "gpu", True, room) == expected


class _FakeGpu:
    platform = "gpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


@pytest.mark.parametrize("total_gib,expected", [(79.65, 2), (140.4, 4), (40.0, 0)])
def test_memory_room_counts_helpers_that_fit_beside_the_engines_allocator(monkeypatch, total_gib, expected):
    """The 8B shape's largest weight (the LM head, 0.98 GiB) on an 80 GB H100, a 141 GB H200 and a 40 GB A100,
    the engine's allocator holding 92% of each (two helpers are what ran best on the H100; `helper_count` caps the
    H200's four at MAX_HELPERS)."""
    import jax
    import numpy as np

    from jengine import kv_cache

    total = int(total_gib * 2**30)
    monkeypatch.setattr(kv_cache, "cuda_total_memory", lambda device: total)
    params = {"lm_head": jax.ShapeDtypeStruct((128256, 4096), np.dtype("bfloat16")),
              "norm": jax.ShapeDtypeStruct((4096,), np.dtype("bfloat16"))}
    gpu = _FakeGpu({"bytes_limit": int(0.92 * total), "bytes_in_use": 0})
    assert build_helpers.memory_room(params, gpu) == expected
    assert build_helpers.memory_room(params, _FakeGpu({})) is None  # no allocator limit: no bound


def test_shares_give_the_main_process_half_a_helpers_share():
    assert build_helpers.shares(list(range(18)), 3) == [[0, 1], [2, 5, 8, 11, 14, 17], [3, 6, 9, 12, 15],
                                                        [4, 7, 10, 13, 16]]
    assert build_helpers.shares(list(range(3)), 2) == [[], [0, 2], [1]]
    assert build_helpers.shares([1, 2], 0) == [[1, 2]]


_SCRIPT = """
import json, sys
from jengine import LLM, SamplingParams, build_helpers
helpers = int(sys.argv[2])
build_helpers.helper_count = lambda *a: helpers  # the CPU gets none by default
if sys.argv[3] == "failing":
    build_helpers.sys = type("sys", (), {"executable": "false", "path": sys.path})  # each helper exits 1 at once
elif sys.argv[3] == "decoy":  # a working directory holding another `jengine`: the helpers must not import it
    import os
    os.makedirs(os.path.join(sys.argv[1], "decoy", "jengine"))
    with open(os.path.join(sys.argv[1], "decoy", "jengine", "__init__.py"), "w") as f:
        f.write("raise ImportError('the decoy jengine was imported')")
    os.chdir(os.path.join(sys.argv[1], "decoy"))
llm = LLM("jengine/tiny-llama", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
          token_buckets=(16, 32, 64), seq_buckets=(2, 4), compilation_cache_dir=sys.argv[1], use_tqdm_on_load=False,
          num_gpu_blocks_override=64)
builder = llm.engine.builder
outs = llm.generate([[1, 2, 3, 4, 5], [7, 8, 9]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps({"hits": builder.executable_cache_hits, "finished": builder.build_helpers_finished,
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


# The children start engines of their own. On a GPU this pytest process may hold most of the device
# already (an earlier test's engine: jengine sets XLA_PYTHON_CLIENT_MEM_FRACTION=0.92), so they neither
# preallocate nor size their KV cache from the memory (a fixed 64 pages).
_CHILD_ENV = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def _start(cache_dir, helpers: int, mode: str = "working") -> dict:
    out = subprocess.run([sys.executable, "-P", "-c", _SCRIPT, str(cache_dir), str(helpers), mode], capture_output=True,
                         text=True, timeout=600, env=_CHILD_ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """A cold start without helpers."""
    return _start(tmp_path_factory.mktemp("alone"), 0)


def test_a_cold_start_with_helpers_loads_their_forwards_and_generates_the_same(tmp_path, alone):
    with_helpers = _start(tmp_path, 2)
    # 3 forwards (T 16 / 32 / 64 at S 4), all three built by the helpers and loaded by warm-up
    assert with_helpers["finished"] == 2 and with_helpers["hits"] == 3
    assert alone["finished"] == 0 and alone["hits"] == 0
    assert with_helpers["tokens"] == alone["tokens"]


def test_helpers_import_the_engines_own_jengine_whatever_the_working_directory(tmp_path, alone):
    decoy = _start(tmp_path, 2, "decoy")
    assert decoy["finished"] == 2 and decoy["hits"] == 3
    assert decoy["tokens"] == alone["tokens"]


def test_helpers_that_fail_leave_their_forwards_to_warm_up(tmp_path, alone):
    failed = _start(tmp_path, 2, "failing")
    assert failed["finished"] == 0 and failed["hits"] == 0
    assert failed["tokens"] == alone["tokens"]


_SERVE_SCRIPT = """
import json, sys
from jengine import build_helpers
from jengine.engine_config import EngineConfig
from jengine.engine_core import build_serving_engine
build_helpers.helper_count = lambda *a: int(sys.argv[2])
config = EngineConfig(model="jengine/tiny-llama", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                      token_buckets=(16, 32, 64), seq_buckets=(2, 4), compilation_cache_dir=sys.argv[1],
                      num_gpu_blocks_override=64)
engine, programs = build_serving_engine(config, progress=False)
compiler = engine._guided._building  # a server makes the grammar compiler before requests come
print(json.dumps({"hits": engine.builder.executable_cache_hits, "programs": programs,
                  "grammar_compiler": compiler is not None and compiler.result() is not None}))
"""


def test_helpers_also_store_the_servers_embedding_programs(tmp_path):
    out = subprocess.run([sys.executable, "-P", "-c", _SERVE_SCRIPT, str(tmp_path), "2"], capture_output=True,
                         text=True, timeout=600, env=_CHILD_ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # 3 forwards and 4 embedding programs (padded lengths 16-128): warm-up builds one forward (its share,
    # 7 // 5 programs), the helpers the rest, which the engine and pooling.warmup load
    assert got == {"hits": 6, "programs": 4, "grammar_compiler": True}
