"""Sizing the KV pool from device memory: gpu_memory_utilization is a fraction of the whole device."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from jengine import kv_cache
from jengine.config import ModelConfig
from jengine.engine_config import EngineConfig
from jengine.kv_cache import activation_reserve, device_memory, num_device_pages, page_bytes
from jengine.presets import resolve_model

GB = 10**9


class FakeDevice:
    def __init__(self, limit, in_use):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def configs(util=0.9):
    model_dir, _ = resolve_model("jengine/tiny-llama")
    cfg = ModelConfig.from_model_dir(model_dir)
    ecfg = EngineConfig(model="jengine/tiny-llama", max_model_len=256, gpu_memory_utilization=util)
    ecfg = ecfg.resolve(cfg, "gpu", 1)
    return cfg, ecfg


@pytest.mark.parametrize("util", [0.5, 0.9])
def test_budget_is_a_fraction_of_the_whole_device(monkeypatch, util):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    cfg, ecfg = configs(util)
    device = FakeDevice(limit=92 * GB, in_use=10 * GB)  # a 100 GB device
    assert device_memory(device) == {"total": 100 * GB, "limit": 92 * GB, "in_use": 10 * GB}
    expected = (int(100 * GB * util) - 10 * GB - activation_reserve(cfg, ecfg)) // page_bytes(
        cfg, ecfg.block_size, cfg.dtype)
    assert num_device_pages(cfg, ecfg, cfg.dtype, device=device) == expected


def test_budget_never_exceeds_what_the_allocator_holds(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    cfg, ecfg = configs(0.9)
    device = FakeDevice(limit=50 * GB, in_use=10 * GB)  # 0.9 of the 100 GB device is beyond the 50 GB pool
    expected = (40 * GB - activation_reserve(cfg, ecfg)) // page_bytes(cfg, ecfg.block_size, cfg.dtype)
    assert num_device_pages(cfg, ecfg, cfg.dtype, device=device) == expected


def test_an_8bit_cache_reserves_the_same_activations_and_kept_buffers(monkeypatch):
    """Activations and the runner's kept hidden states are in the model's dtype, whatever the cache's."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    cfg, ecfg = configs(0.9)
    device = FakeDevice(limit=92 * GB, in_use=10 * GB)
    fp8 = jax.numpy.dtype("float8_e4m3fn")
    reserve = activation_reserve(cfg, ecfg)
    assert reserve > 2 * ecfg.max_num_batched_tokens * cfg.hidden_size * 2  # bf16 activations at least
    expected = (90 * GB - 10 * GB - reserve) // page_bytes(cfg, ecfg.block_size, fp8)
    assert num_device_pages(cfg, ecfg, fp8, device=device) == expected


@pytest.mark.parametrize("value", [None, "junk", "0"])
def test_unset_or_unusable_fraction_falls_back_to_jax_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", value)
    total = device_memory(FakeDevice(limit=75 * GB, in_use=0))["total"]
    assert total == (100 * GB if value != "0" else 75 * GB)


def test_too_little_memory_names_the_remedies(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    cfg, ecfg = configs(0.9)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_device_pages(cfg, ecfg, cfg.dtype, device=FakeDevice(limit=92 * 10**6, in_use=90 * 10**6))


@pytest.mark.parametrize("env, before, expected", [
    ({}, "", "0.92"),
    ({}, "import jax; ", "0.92"),  # imported but no backend yet: still in time
    ({}, "import jax; jax.devices(); ", None),  # the backend started with JAX's default: leave it
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, "", "0.5"),
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, "", None),
])
def test_import_sets_the_allocator_fraction_only_when_unconfigured(env, before, expected):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")}
    code = before + "import os, jengine; print(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))"
    out = subprocess.run([sys.executable, "-P", "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == str(expected)


def test_warmup_compiles_against_the_cache_shapes_before_allocating_it(monkeypatch):
    # XLA's GEMM autotuning borrows device memory while compiling: the KV pool must not exist yet
    from jengine.engine import LLMEngine
    from jengine.runner import ModelRunner

    compiled_at_allocation = []
    real_allocate = ModelRunner.allocate_kv_cache

    def allocate(self):
        if self.kv_caches is None:
            compiled_at_allocation.append(len(self.compiled))
        real_allocate(self)

    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", allocate)
    engine = LLMEngine(EngineConfig(model="jengine/tiny-llama", max_model_len=128, max_num_seqs=4,
                                    max_num_batched_tokens=32, token_buckets=(16, 32), seq_buckets=(4,),
                                    compilation_cache_dir=None), progress=False)
    # allocated once, after every forward, sampling and prompt-logprobs program was compiled
    assert compiled_at_allocation == [len(engine.runner.compiled)] and compiled_at_allocation[0] > 2
    runner = engine.runner
    spec = kv_cache.specs(runner.cfg, runner.num_pages, runner.ecfg.block_size, runner.kv_dtype)[0]
    assert [c.shape for c in engine.runner.kv_caches] == [spec.shape] * engine.model_config.num_hidden_layers
    # a report where the device has memory statistics (GPUs), none where it has not (the CPU)
    assert (engine.kv_cache_memory is None) == (jax.devices()[0].memory_stats() is None)


def test_kv_memory_report_is_per_device_share_of_free_memory():
    import jax.numpy as jnp

    from jengine.engine import _kv_memory_report

    caches = [jnp.zeros((2, 2, 8, 16, 8), jnp.float32) for _ in range(3)]  # 3 x 16 KiB
    report = _kv_memory_report({"total": 10 << 20, "limit": 9 << 20, "in_use": 1 << 20}, caches)
    assert report["kv_bytes"] == 3 * 16384 and report["free_after_weights"] == 8 << 20
    assert report["kv_fraction_of_free"] == pytest.approx(3 * 16384 / (8 << 20))
    assert _kv_memory_report(None, caches) is None


def test_late_import_on_a_gpu_backend_names_what_did_not_apply():
    import jengine

    both = jengine._late_start_warning("gpu", env={})
    assert "XLA_FLAGS defaults" in both and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.92" in both
    flags = " ".join(f"{k}={v}" for k, v in jengine._XLA_DEFAULTS.items())
    only_memory = jengine._late_start_warning("gpu", env={"XLA_FLAGS": flags})
    assert "XLA_FLAGS" not in only_memory and "MEM_FRACTION" in only_memory
    assert jengine._late_start_warning("gpu", env={"XLA_FLAGS": flags, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}) is None
    assert jengine._late_start_warning("cpu", env={}) is None  # the defaults are GPU settings


def test_late_import_changes_no_environment_and_stays_quiet_on_cpu():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    code = ("import jax, os; jax.devices(); import jengine; "
            "print(os.environ.get('XLA_FLAGS'), os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))")
    out = subprocess.run([sys.executable, "-P", "-c", code], env={**clean, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "None None"
    assert "jengine could not apply" not in out.stderr


@pytest.mark.parametrize("bad", [0, 24, 256, "16", 16.0])
def test_unsupported_page_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="jengine/tiny-llama", block_size=bad)


def test_cli_block_size_flag_takes_the_engine_page_sizes_only(capsys):
    import argparse

    from jengine.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).block_size == EngineConfig.block_size
    assert parser.parse_args(["--block-size", "64"]).block_size == 64
    with pytest.raises(SystemExit):  # a usage error naming the choices, before any engine is built
        parser.parse_args(["--block-size", "24"])
    assert "--block-size" in capsys.readouterr().err


class StatlessGpu:
    """A GPU whose allocator keeps no statistics (XLA's VMM allocator)."""
    platform = "gpu"
    id = 0

    def memory_stats(self):
        return None


def test_gpu_without_allocator_statistics_is_sized_from_the_driver(monkeypatch):
    import jengine.kv_cache as kv_cache

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    monkeypatch.setattr(kv_cache, "cuda_total_memory", lambda device: 100 * GB)
    monkeypatch.setattr(kv_cache, "live_bytes", lambda device: 16 * GB)
    # The limit is XLA's own assumption for a client that reports none (80%), below 92% of the device.
    assert device_memory(StatlessGpu()) == {"total": 100 * GB, "limit": 80 * GB, "in_use": 16 * GB}
    cfg, ecfg = configs(0.9)
    per_page = page_bytes(cfg, ecfg.block_size, cfg.dtype)
    expected = (80 * GB - 16 * GB - activation_reserve(cfg, ecfg)) // per_page
    assert num_device_pages(cfg, ecfg, cfg.dtype, device=StatlessGpu()) == expected
    cfg, ecfg = configs(0.7)  # a utilisation under the cap is the budget
    expected = (70 * GB - 16 * GB - activation_reserve(cfg, ecfg)) // per_page
    assert num_device_pages(cfg, ecfg, cfg.dtype, device=StatlessGpu()) == expected
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # a smaller allocator pool still binds
    assert device_memory(StatlessGpu())["limit"] == 50 * GB


def test_no_driver_means_no_statistics(monkeypatch):
    import jengine.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "cuda_total_memory", lambda device: None)
    assert device_memory(StatlessGpu()) is None


def test_live_bytes_counts_the_arrays_on_the_device():
    import jax.numpy as jnp

    from jengine.kv_cache import live_bytes

    device = jax.local_devices()[0]
    before = live_bytes(device)
    x = jnp.zeros((1024, 256), jnp.float32)
    assert live_bytes(device) - before == x.nbytes


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_the_driver_total_agrees_with_the_allocator_view():
    """The fallback's total (driver) and the statistics' total (limit / fraction) are the same device."""
    from jengine.kv_cache import cuda_total_memory

    device = jax.local_devices()[0]
    total = cuda_total_memory(device)
    assert total is not None and total >= device.memory_stats()["bytes_limit"]
    assert abs(device_memory(device)["total"] - total) <= 0.02 * total


def test_xla_defaults_leave_a_setting_the_user_named_in_either_spelling(monkeypatch):
    import jengine

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_experimental_use_collective_kernels=")
    jengine._default_xla_flags()
    flags = os.environ["XLA_FLAGS"]
    assert "--xla_gpu_enable_command_buffer=" in flags and "one_shot_kernel" not in flags
    monkeypatch.setenv("XLA_FLAGS", "")
    jengine._default_xla_flags()
    assert "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false" in os.environ["XLA_FLAGS"]
