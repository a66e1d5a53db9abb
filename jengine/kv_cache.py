"""The paged KV cache on the device: sizing from free memory, allocation, page copies and swapping.

Page moves (copy-on-write copies, swap out to host, swap in) go through two jitted functions of a
fixed number of pages (`PAGE_CHUNK`), padded by repeating the last id, so they compile once.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jengine.config import ModelConfig
from jengine.engine_config import EngineConfig
from jengine.kernels_pallas.ragged_paged_attention import kv_cache_shape

PAGE_CHUNK = 8
_CPU_DEFAULT_BYTES = 256 << 20  # no memory statistics on the CPU backend: a modest fixed pool
JAX_MEM_FRACTION = 0.75  # JAX's own default for XLA_PYTHON_CLIENT_MEM_FRACTION


def page_bytes(cfg: ModelConfig, block_size: int, dtype) -> int:
    """Bytes of one page across all layers (K and V)."""
    per_layer = int(np.prod(kv_cache_shape(1, block_size, cfg.num_key_value_heads, cfg.head_dim)))
    return per_layer * cfg.num_hidden_layers * jnp.dtype(dtype).itemsize


def activation_reserve(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """Rough peak of a step's temporaries (the widest layer activations, in the model's dtype whatever the
    cache's, and the logits), plus the buffers the runner keeps for every bucket's logits `[S, V]` f32 and
    hidden states `[T, H]`. `ecfg` resolved (its bucket lists filled in)."""
    tokens = ecfg.max_num_batched_tokens
    width = 2 * cfg.intermediate_size + 4 * cfg.hidden_size + 3 * cfg.num_attention_heads * cfg.head_dim
    itemsize = jnp.dtype(cfg.dtype).itemsize
    kept = 4 * cfg.vocab_size * sum(ecfg.seq_buckets) + itemsize * cfg.hidden_size * sum(ecfg.token_buckets)
    return 2 * tokens * width * itemsize + 4 * ecfg.max_num_seqs * cfg.vocab_size * 4 + kept


# When the client gives XLA no allocator limit (its VMM allocator keeps none), XLA's GPU scheduler plans
# each program for 80% of the device's memory, and logs "exceeds the base limit" for a program whose
# arguments pass that. On an H200 under SKIP_TEMP (the VMM allocator) every run whose weights and KV
# cache passed it failed at run time (illegal memory accesses, segfaults: four runs at
# gpu_memory_utilization 0.85-0.9) and the run within it did not (benchmarks/RESULTS.md, sessions
# 16-17), so a stat-less GPU's limit stays inside it.
XLA_ASSUMED_MEMORY_FRACTION = 0.8


def device_memory(device=None) -> dict | None:
    """The device's memory as the engine sizes against it: `limit` (the bytes JAX's allocator may
    hand out), `in_use`, and `total` (the device's memory: limit / XLA_PYTHON_CLIENT_MEM_FRACTION).

    A GPU whose allocator keeps no statistics (XLA's VMM allocator, which
    `--xla_gpu_command_buffer_update_mode=SKIP_TEMP` selects) is sized from the driver's total memory
    and the live arrays on it, its limit capped at `XLA_ASSUMED_MEMORY_FRACTION` of the device. None on
    backends without memory statistics (CPU)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    fraction = _client_mem_fraction()
    if stats and "bytes_limit" in stats:
        limit = int(stats["bytes_limit"])
        total = int(limit / fraction) if 0 < fraction <= 1 else limit
        return {"total": total, "limit": limit, "in_use": int(stats.get("bytes_in_use", 0))}
    total = cuda_total_memory(device) if getattr(device, "platform", None) == "gpu" else None
    if total is None:
        return None
    limit = int(total * min(fraction if 0 < fraction <= 1 else 1.0, XLA_ASSUMED_MEMORY_FRACTION))
    return {"total": total, "limit": limit, "in_use": live_bytes(device)}


def _client_mem_fraction() -> float:
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEM_FRACTION))
    except ValueError:
        return JAX_MEM_FRACTION


def cuda_total_memory(device) -> int | None:
    """The device's memory in bytes from the CUDA driver (`cuDeviceTotalMem`; no context needed), or
    None where the driver cannot say."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    ordinal = getattr(device, "local_hardware_id", None)
    handle, size = ctypes.c_int(), ctypes.c_size_t()
    if (cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(handle), device.id if ordinal is None else ordinal)
            or cuda.cuDeviceTotalMem_v2(ctypes.byref(size), handle)):
        return None
    return int(size.value)


def live_bytes(device) -> int:
    """Bytes of the live JAX arrays (their shards) held on `device`."""
    return sum(shard.data.nbytes for a in jax.live_arrays() for shard in a.addressable_shards
               if shard.device == device)


def num_device_pages(cfg: ModelConfig, ecfg: EngineConfig, dtype, device=None, tp: int = 1) -> int:
    """How many pages fit in `gpu_memory_utilization` of the device's memory after weights and temporaries.

    As in vLLM, the fraction is of the device's whole memory (weights, temporaries and KV pages
    together), capped by what JAX's allocator holds. Under tensor parallelism (`tp` devices, `cfg`
    with the KV heads the devices hold) each device holds 1/tp of every page."""
    if ecfg.num_gpu_blocks_override:
        return ecfg.num_gpu_blocks_override
    mem = device_memory(device)
    if mem is not None:
        budget = min(int(mem["total"] * ecfg.gpu_memory_utilization), mem["limit"]) - mem["in_use"]
        budget -= activation_reserve(cfg, ecfg)
        pages = budget // (page_bytes(cfg, ecfg.block_size, dtype) // tp)
    else:  # host memory: a modest pool, never more than every sequence at full length needs
        pages = min(_CPU_DEFAULT_BYTES // (page_bytes(cfg, ecfg.block_size, dtype) // tp),
                    ecfg.max_num_seqs * ecfg.pages_per_seq + 1)
    if pages < ecfg.pages_per_seq + 1:
        raise ValueError(
            f"only {max(pages, 0)} KV pages fit in memory, fewer than one sequence of max_model_len="
            f"{ecfg.max_model_len} needs ({ecfg.pages_per_seq}); lower max_model_len or max_num_batched_tokens, "
            "or raise gpu_memory_utilization")
    return int(pages)


def num_host_pages(cfg: ModelConfig, ecfg: EngineConfig, dtype) -> int:
    return int(ecfg.swap_space * (1 << 30)) // page_bytes(cfg, ecfg.block_size, dtype)


def specs(cfg: ModelConfig, num_pages: int, block_size: int, dtype, sharding=None) -> list[jax.ShapeDtypeStruct]:
    """The shapes of `allocate`'s arrays (to trace programs over a cache that does not exist yet)."""
    shape = kv_cache_shape(num_pages, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)] * cfg.num_hidden_layers


def allocate(cfg: ModelConfig, num_pages: int, block_size: int, dtype, sharding=None) -> list[jax.Array]:
    """One zeroed cache array per layer (`sharding`: split by KV heads under tensor parallelism)."""
    shape = kv_cache_shape(num_pages, block_size, cfg.num_key_value_heads, cfg.head_dim)
    if sharding is None:
        return [jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)]
    return [jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.num_hidden_layers)]


@jax.jit
def _gather_pages(kv_caches, ids):  # ids [PAGE_CHUNK] -> [L, 2, Hkv, PAGE_CHUNK, ps, D]
    return jnp.stack([cache[:, :, ids] for cache in kv_caches])


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_pages(kv_caches, ids, pages):
    return [cache.at[:, :, ids].set(pages[i]) for i, cache in enumerate(kv_caches)]


def _chunks(ids: list[int]):
    for start in range(0, len(ids), PAGE_CHUNK):
        chunk = ids[start : start + PAGE_CHUNK]
        yield len(chunk), np.array(chunk + [chunk[-1]] * (PAGE_CHUNK - len(chunk)), np.int32)


def copy_pages(kv_caches: list, pairs: list[tuple[int, int]]) -> list:
    """Copy device pages src -> dst (copy-on-write of a shared partial page)."""
    if not pairs:
        return kv_caches
    for (_, src), (_, dst) in zip(_chunks([s for s, _ in pairs]), _chunks([d for _, d in pairs])):
        kv_caches = _scatter_pages(kv_caches, dst, _gather_pages(kv_caches, src))
    return kv_caches


class HostPagePool:
    """Host-memory copies of swapped-out pages: `[L, 2, Hkv, num_pages, ps, D]` in numpy."""

    def __init__(self, cfg: ModelConfig, num_pages: int, block_size: int, dtype):
        shape = (cfg.num_hidden_layers,) + kv_cache_shape(num_pages, block_size, cfg.num_key_value_heads,
                                                          cfg.head_dim)
        self.pages = np.zeros(shape, jnp.dtype(dtype)) if num_pages else None

    def swap_out(self, kv_caches: list, pairs: list[tuple[int, int]]) -> None:
        """Copy device pages to host pages, pairs of (device_page, host_page)."""
        for (n, dev), (_, host) in zip(_chunks([d for d, _ in pairs]), _chunks([h for _, h in pairs])):
            self.pages[:, :, :, host[:n]] = np.asarray(_gather_pages(kv_caches, dev))[:, :, :, :n]

    def swap_in(self, kv_caches: list, pairs: list[tuple[int, int]]) -> list:
        """Copy host pages back into device pages, pairs of (host_page, device_page)."""
        for (_, host), (_, dev) in zip(_chunks([h for h, _ in pairs]), _chunks([d for _, d in pairs])):
            kv_caches = _scatter_pages(kv_caches, dev, jnp.asarray(self.pages[:, :, :, host]))
        return kv_caches
