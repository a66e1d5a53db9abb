"""The persistent compilation cache: a second start loads the step programs instead of compiling.

The executable cache in front of it (tests/test_executable_cache.py) is emptied between the starts, so
the second start reaches JAX's cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

_SCRIPT = """
import json, sys, jax
hits = []
HIT = "/jax/compilation_cache/cache_hits"
jax.monitoring.register_event_listener(lambda e, **k: hits.append(e) if e == HIT else None)
from jengine import LLM
from jengine.executable_cache import stores_loaded_executables
llm = LLM("jengine/tiny-llama", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,),
          seq_buckets=(2,), compilation_cache_dir=sys.argv[1], use_tqdm_on_load=False)
print(json.dumps({"hits": len(hits), "buckets": llm.engine.num_compiled_buckets,
                  "stores_loaded": stores_loaded_executables()}))
"""


def _start(cache_dir) -> dict:
    out = subprocess.run([sys.executable, "-P", "-c", _SCRIPT, str(cache_dir)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_start_hits_the_persistent_compilation_cache(tmp_path):
    first = _start(tmp_path)
    assert first["buckets"] == 1 and first["hits"] == 0
    assert any(tmp_path.iterdir()), "the first start wrote nothing to the cache"
    shutil.rmtree(tmp_path / "jengine-executables")
    second = _start(tmp_path)
    assert second["hits"] >= 1
    # what JAX loaded from its cache is stored only where XLA serializes it whole (not on the CPU)
    assert bool(list((tmp_path / "jengine-executables").glob("*/*.jexe"))) == second["stores_loaded"]


_BOUND_SCRIPT = """
import json, os, sys, jax, jax.numpy as jnp
from jengine.executable_cache import enable_jax_cache
enable_jax_cache(sys.argv[1])
for n in range(1, 4):
    jax.jit(lambda x: x * n + 1)(jnp.ones(n))
files = os.listdir(sys.argv[1])
print(json.dumps({"bound": jax.config.jax_compilation_cache_max_size,
                  "entries": sum(f.endswith("-cache") for f in files),
                  "access_times": sum(f.endswith("-atime") for f in files)}))
"""


def _bounded(cache_dir, env=None) -> dict:
    out = subprocess.run([sys.executable, "-P", "-c", _BOUND_SCRIPT, str(cache_dir)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_jax_cache_is_bounded_least_recently_used_first(tmp_path):
    from jengine.executable_cache import JAX_CACHE_MAX_BYTES

    got = _bounded(tmp_path)
    assert got["bound"] == JAX_CACHE_MAX_BYTES
    assert got["entries"] >= 3 and got["access_times"] == got["entries"]  # the LRU cache's access times


def test_a_bound_the_user_set_is_kept(tmp_path):
    got = _bounded(tmp_path, {"JAX_COMPILATION_CACHE_MAX_SIZE": "1"})  # smaller than any entry: none stored
    assert got["bound"] == 1 and got["entries"] == 0
