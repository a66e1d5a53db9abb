"""The executable cache: a warm start loads every step program without tracing, lowering or compiling it.

Engine starts run in fresh processes (with different string-hash seeds), so a hit also proves that a
program's key is the same in another process. The key and file tests run in this process on small
jitted functions.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine import executable_cache
from jengine.config import ModelConfig
from jengine.executable_cache import ExecutableCache, code_digest, describe, source_digest

_SCRIPT = """
import functools, json, os, sys, jax
lowerings, traces = [], []
lower = jax.stages.Traced.lower
jax.stages.Traced.lower = lambda self, *a, **k: lowerings.append(1) or lower(self, *a, **k)
import jengine.runner
for name in ("_forward", "_sample", "_top_logprobs", "_mask_logits", "_prompt_logprobs"):  # each runs only while traced
    fn = getattr(jengine.runner, name)
    setattr(jengine.runner, name, functools.wraps(fn)(lambda *a, _fn=fn, **k: traces.append(1) or _fn(*a, **k)))
import jengine.warmup
reloads, reload = [], jengine.warmup.reload
jengine.warmup.reload = lambda compiled: reloads.append(1) or reload(compiled)
if os.environ.get("COPIES"):  # copied decode forwards, as on GPUs (each copy's first run checks it works)
    jengine.runner.stores_loaded_executables = lambda: True
from jengine import LLM, SamplingParams
llm = LLM("jengine/tiny-llama", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
          token_buckets=(2, 16) if os.environ.get("COPIES") else (16,),
          seq_buckets=(2,), compilation_cache_dir=sys.argv[1], use_tqdm_on_load=False)
out = llm.generate(["The cache"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
runner = llm.engine.runner
print(json.dumps({"hits": llm.engine.builder.executable_cache_hits, "programs": len(runner.compiled),
                  "lowerings": len(lowerings), "traces": len(traces), "tokens": out[0].outputs[0].token_ids,
                  "copied": len(runner.copies), "reloads": len(reloads),
                  "copies": jengine.runner.FORWARD_COPIES}))
"""


def _start(cache_dir, hash_seed: int, copies: bool = False) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed), COPIES="1" if copies else "")
    out = subprocess.run([sys.executable, "-P", "-c", _SCRIPT, str(cache_dir)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _entries(cache_dir) -> list:
    return sorted((cache_dir / "jengine-executables").glob("*/*.jexe"))  # one directory per code version


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A first start into an empty cache: (its report, the cache directory it filled)."""
    cache_dir = tmp_path_factory.mktemp("cold")
    return _start(cache_dir, hash_seed=1), cache_dir


def test_first_start_stores_one_file_per_program(cold):
    first, cache_dir = cold
    assert first["hits"] == 0
    assert first["lowerings"] == first["programs"] == len(_entries(cache_dir)) == 11  # forward, 7 samplers, 3 more
    assert first["traces"] == first["programs"]


def test_second_start_loads_every_program_without_tracing_or_lowering(cold, tmp_path):
    first, cold_dir = cold
    shutil.copytree(cold_dir, tmp_path, dirs_exist_ok=True)
    second = _start(tmp_path, hash_seed=2)
    assert second["hits"] == second["programs"] == first["programs"]
    assert second["lowerings"] == second["traces"] == 0
    assert second["tokens"] == first["tokens"]


def test_copied_forwards_load_every_copy_from_the_entry(tmp_path):
    first = _start(tmp_path, hash_seed=4, copies=True)  # compiled: the other copies are reloads of the first
    assert first["copied"] == 1 and first["reloads"] == first["copies"] - 1 >= 1
    second = _start(tmp_path, hash_seed=5, copies=True)
    assert second["copied"] == 1 and second["reloads"] == 0 and second["hits"] == second["programs"]
    assert second["tokens"] == first["tokens"]


def test_corrupt_entry_is_compiled_again_and_rewritten(cold, tmp_path):
    first, cold_dir = cold
    shutil.copytree(cold_dir / "jengine-executables", tmp_path / "jengine-executables")  # not JAX's cache:
    bad = _entries(tmp_path)[0]  # the program is really compiled, so it can be stored again
    bad.write_bytes(bad.read_bytes()[:1000])
    third = _start(tmp_path, hash_seed=3)
    assert third["hits"] == first["programs"] - 1 and third["lowerings"] == third["traces"] == 1
    assert third["tokens"] == first["tokens"]
    assert ExecutableCache(tmp_path / "jengine-executables").load(bad.stem) is not None


def _fresh(fn):
    """`fn` plus a constant no earlier run compiled, so that JAX's own persistent cache (enabled in this
    process by any engine test that ran before) cannot serve it: only a real compile can be stored."""
    # One of 2^20 constants (under 1e-3): with only 1000, a machine that keeps JAX's cache between runs
    # (a developer's) met an earlier run's constant within a few dozen runs and the store was skipped.
    salt = np.float32((uuid.uuid4().int % (1 << 20) + 1) / (1 << 30))
    return lambda x, *rest: fn(x + salt, *rest)


def _key(*args, program="f", **kw):
    return ExecutableCache("unused").key(program, [describe(a) for a in args], **kw)


def test_key_is_equal_for_equal_programs_and_changes_with_what_matters(monkeypatch):
    x8 = jnp.ones(8)
    base = _key(x8, closure=("cfg",), statics=(3,))
    assert _key(jnp.zeros(8), closure=("cfg",), statics=(3,)) == base  # values of the inputs do not matter
    assert _key(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=x8.sharding), closure=("cfg",), statics=(3,)) == base
    assert _key(x8, closure=("cfg",), statics=(3,), program="g") != base
    assert _key(jnp.ones(16), closure=("cfg",), statics=(3,)) != base  # another bucket shape
    assert _key(x8.astype(jnp.bfloat16), closure=("cfg",), statics=(3,)) != base
    assert _key(np.ones(8, np.float32), closure=("cfg",), statics=(3,)) != base  # a host array, not a device one
    assert _key((x8,), closure=("cfg",), statics=(3,)) != base  # another pytree around the same leaf
    assert _key(x8, closure=("other cfg",), statics=(3,)) != base
    assert _key(x8, closure=("cfg",), statics=(4,)) != base
    assert _key(x8, closure=("cfg",), statics=(3,), compiler_options={"xla_gpu_enable_triton_gemm": False}) != base
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert _key(x8, closure=("cfg",), statics=(3,)) != base
    monkeypatch.delenv("XLA_FLAGS")
    with jax.default_matmul_precision("highest"):  # JAX's trace context
        assert _key(x8, closure=("cfg",), statics=(3,)) != base


def test_a_model_config_is_keyed_on_every_field():
    # the key shows the config by its repr: a field left out of it (repr=False) would let a model that
    # differs only there load another model's programs
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    text = repr(cfg)
    assert all(f"{field.name}=" in text for part in (cfg, cfg.rope) for field in dataclasses.fields(part))
    other = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, theta=5e5))
    assert _key(jnp.ones(2), closure=(cfg,)) != _key(jnp.ones(2), closure=(other,))


def test_code_digest_changes_with_any_source_file(monkeypatch, tmp_path):
    source = tmp_path / "kernel.py"
    source.write_text("TILE = 64\n")
    monkeypatch.setattr(executable_cache, "_package_files", lambda: {str(source): "jengine/kernel.py"})
    try:
        code_digest.cache_clear()
        before = code_digest()
        code_digest.cache_clear()
        assert code_digest() == before
        source.write_text("TILE = 128\n")
        code_digest.cache_clear()
        assert code_digest() != before
    finally:
        code_digest.cache_clear()


def test_code_digest_covers_the_engine_models_and_kernels():
    names = set(executable_cache._package_files().values())
    assert {"jengine/runner.py", "jengine.models/llama.py", "jengine.kernels_pallas/swiglu_matmul.py",
            "jengine.kernels_pallas/ragged_paged_attention/gpu_mosaic.py"} <= names


def test_source_digest_follows_the_family_module_file(monkeypatch, tmp_path):
    module = tmp_path / "my_family.py"
    module.write_text("def forward(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forward = importlib.import_module("my_family").forward
    before = source_digest([forward])
    module.write_text("def forward(x):\n    return x + 1\n")
    assert source_digest([forward]) != before
    partial = functools.partial(forward, 2)  # wrappers and functions without a file still key
    assert source_digest([partial]) == source_digest([forward])
    assert source_digest([len]) == source_digest([len]) != source_digest([abs])


def test_stored_program_loads_and_runs(tmp_path):
    cache = ExecutableCache(tmp_path)
    f = jax.jit(_fresh(lambda x, y: (x @ y, x.sum())), donate_argnums=0)
    x, y = jnp.arange(16.0).reshape(4, 4), jnp.eye(4)
    traced = f.trace(x, y)
    key = _key(x, y)
    compiled = cache.compile(key, traced.lower())
    loaded = cache.load(key)
    assert loaded is not None and loaded.out_info == compiled.out_info
    expected = [np.asarray(a) for a in f(jnp.arange(16.0).reshape(4, 4), y)]
    assert all(np.array_equal(a, e) for a, e in zip(loaded(jnp.arange(16.0).reshape(4, 4), y), expected))


def test_unreadable_entries_are_misses(tmp_path):
    cache = ExecutableCache(tmp_path)
    traced = jax.jit(_fresh(lambda x: x + 1)).trace(jnp.ones(4))
    key = _key(jnp.ones(4))
    assert cache.load(key) is None  # nothing stored yet
    cache.compile(key, traced.lower())
    entry = Path(cache.directory) / f"{key}.jexe"
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])
    assert cache.load(key) is None  # truncated
    entry.write_bytes(b"not a pickle")
    assert cache.load(key) is None
    (Path(cache.directory) / f"{'0' * 64}.jexe").write_bytes(whole)
    assert cache.load("0" * 64) is None  # an entry under another key's name


def test_entries_of_other_code_versions_beyond_the_newest_are_removed(tmp_path):
    old = []
    for age, name in enumerate(["a" * 16, "b" * 16, "c" * 16]):  # oldest last
        version = tmp_path / name
        version.mkdir()
        (version / f"{'1' * 64}.jexe").write_bytes(b"entry")
        os.utime(version, (1e9 - age * 1000, 1e9 - age * 1000))
        old.append(version)
    (tmp_path / "notes").mkdir()  # not a version directory: left alone
    cache = ExecutableCache(tmp_path, keep_versions=2)
    assert not any(v.name == Path(cache.directory).name for v in old)
    traced = jax.jit(_fresh(lambda x: x - 1)).trace(jnp.ones(4))
    cache.compile(_key(jnp.ones(4)), traced.lower())  # the first store prunes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([Path(cache.directory).name, "a" * 16, "notes"])
    with pytest.raises(ValueError, match="keep_versions"):
        ExecutableCache(tmp_path, keep_versions=0)


def test_store_failure_is_ignored(tmp_path):
    (tmp_path / "file").write_text("")
    cache = ExecutableCache(tmp_path / "file" / "cache")  # cannot be created
    traced = jax.jit(_fresh(lambda x: x * 3)).trace(jnp.ones(4))
    compiled = cache.compile(_key(jnp.ones(4)), traced.lower())
    assert float(compiled(jnp.ones(4))[0]) == pytest.approx(3.0, abs=1e-2)


def test_no_key_without_the_jax_internals_it_reads(monkeypatch):
    # a JAX without them must not get a key built from less (the program is then compiled, not stored)
    from jax._src import config

    monkeypatch.delattr(config, "trace_context_names")
    assert _key(jnp.ones(4)) is None


_JIT_FIRST = """
import sys, jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1] + "/jax")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
from jengine.executable_cache import ExecutableCache, describe
cache = ExecutableCache(sys.argv[1] + "/exe")
f = jax.jit(lambda x, i: jnp.take(jnp.cos(x), i, axis=0) * 3.0 + x[:4].sum())
x, i = jnp.arange(64.0).reshape(8, 8), jnp.array([3, 1, 2, 0])
if sys.argv[2] == "jit-first":  # JAX's cache serves this call; compiling the program again reuses it in memory
    f(x, i)
traced = f.trace(x, i)
key = cache.key("f", [describe(x), describe(i)])
print(float(np.asarray((cache.load(key) or cache.compile(key, traced.lower()))(x, i)).sum()))
"""


def test_a_program_jax_handed_back_from_memory_is_stored_only_where_loaded_copies_run(tmp_path):
    # On the CPU an executable JAX loaded from its own cache serializes without its kernels. One run
    # through jax.jit first comes back from JAX's memory on a later compile, with no cache event; it was
    # stored, and the next process failed with "Function ... not found".
    def run(mode):
        out = subprocess.run([sys.executable, "-P", "-c", _JIT_FIRST, str(tmp_path), mode], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.strip().splitlines()[-1])

    first = run("plain")  # compiled, stored, and in JAX's cache
    shutil.rmtree(tmp_path / "exe")
    assert run("jit-first") == first
    assert run("plain") == first  # loads whatever the jit-first process stored


def test_the_command_line_sets_or_turns_off_the_cache_directory():
    import argparse

    from jengine.cli import add_engine_args, engine_kwargs
    from jengine.engine_config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cache_dir = lambda *argv: engine_kwargs(parser.parse_args(list(argv)))["compilation_cache_dir"]  # noqa: E731
    assert cache_dir() == EngineConfig.compilation_cache_dir
    assert cache_dir("--compilation-cache-dir", "/srv/cache") == "/srv/cache"
    assert cache_dir("--compilation-cache-dir", "none") is None
    assert cache_dir("--compilation-cache-dir", "None") is None
