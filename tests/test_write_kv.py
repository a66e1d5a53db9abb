"""`write_kv`: the step's new K/V rows scattered into the paged cache (Pallas GPU kernel in interpret mode
on CPU, and XLA's scatter), including 8-bit caches, against a NumPy model of the write."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_kernels import FP8

from jengine.kernels_pallas import ragged_paged_attention as rpa
from jengine.kernels_pallas.ragged_paged_attention import reference


@pytest.mark.parametrize("impl", ["gpu", "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_writes_every_real_slot_and_nothing_else(impl, dtype):
    import jax

    rng = np.random.default_rng(7)
    num_pages, page_size, hkv, d, t = 6, 8, 2, 32, 13
    cache = rng.standard_normal(reference.kv_cache_shape(num_pages, page_size, hkv, d)).astype(np.float32)
    k, v = (rng.standard_normal((t, hkv, d)).astype(np.float32) for _ in range(2))
    slots = rng.permutation(num_pages * page_size)[:t].astype(np.int32)
    slots[[2, 7, 12]] = -1  # padding tokens
    want = cache.copy()
    for i, s in enumerate(slots):
        if s >= 0:
            want[0, :, s // page_size, s % page_size] = k[i]
            want[1, :, s // page_size, s % page_size] = v[i]
    interpret = impl == "gpu" and jax.default_backend() != "gpu"
    fn = jax.jit(lambda c, k, v, s: rpa.write_kv(c, k, v, s, impl=impl, interpret=interpret), donate_argnums=0)
    got = fn(jnp.asarray(cache, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(slots))
    assert got.dtype == dtype
    want = jnp.asarray(want, dtype).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want))


@pytest.mark.parametrize("impl", ["gpu", "reference"])
@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
def test_write_kv_into_an_8bit_cache_rounds_and_saturates(impl, kv_dtype):
    import jax

    rng = np.random.default_rng(8)
    num_pages, page_size, hkv, d, t = 5, 8, 2, 32, 9
    top = float(jnp.finfo(kv_dtype).max)
    cache = jnp.asarray(rng.standard_normal(reference.kv_cache_shape(num_pages, page_size, hkv, d)), kv_dtype)
    k, v = (rng.standard_normal((t, hkv, d)).astype(np.float32) * 3 for _ in range(2))
    k[0, 0, :4] = [1e6, -1e6, top * 1.01, np.float32(0.1)]  # past the finite range: saturated, not NaN
    slots = rng.permutation(num_pages * page_size)[:t].astype(np.int32)
    slots[4] = -1
    want = np.array(cache.astype(jnp.float32))
    for i, s in enumerate(slots):
        if s >= 0:
            want[0, :, s // page_size, s % page_size] = np.asarray(jnp.asarray(np.clip(k[i], -top, top), kv_dtype),
                                                                   np.float32)
            want[1, :, s // page_size, s % page_size] = np.asarray(jnp.asarray(v[i], kv_dtype), np.float32)
    interpret = impl == "gpu" and jax.default_backend() != "gpu"
    fn = jax.jit(lambda c, k, v, s: rpa.write_kv(c, k, v, s, impl=impl, interpret=interpret), donate_argnums=0)
    got = fn(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    assert got.dtype == kv_dtype
    got = np.asarray(got.astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    s0 = slots[0]
    assert list(got[0, 0, s0 // page_size, s0 % page_size, :3]) == [top, -top, top]


def test_write_kv_names_bad_arguments():
    cache = jnp.zeros(reference.kv_cache_shape(2, 8, 2, 32))
    k = jnp.zeros((3, 2, 32))
    with pytest.raises(ValueError, match="write_kv: `slot_mapping`"):
        rpa.write_kv(cache, k, k, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="write_kv: `kv_cache`"):
        rpa.write_kv(cache[:, :1], k, k, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="write_kv: `impl`"):
        rpa.write_kv(cache, k, k, jnp.zeros((3,), jnp.int32), impl="cuda")


def test_write_kv_uses_the_kernel_on_gpus_only_for_large_steps(monkeypatch):
    from jengine.kernels_pallas.ragged_paged_attention import gpu_write_kv

    monkeypatch.setattr(rpa, "_default_impl", lambda: "gpu")
    monkeypatch.setattr(gpu_write_kv, "write_kv_gpu", lambda cache, *a, **kw: "kernel")
    cache = jnp.zeros(reference.kv_cache_shape(200, 8, 2, 32))
    for t, want in ((rpa.PALLAS_WRITE_MIN_TOKENS, "kernel"), (rpa.PALLAS_WRITE_MIN_TOKENS - 1, None)):
        k = jnp.zeros((t, 2, 32))
        out = rpa.write_kv(cache, k, k, jnp.full((t,), -1, jnp.int32))
        assert out == want if want else out.shape == cache.shape
    k = jnp.zeros((4, 2, 24))  # head size the Triton kernel cannot tile: the scatter, even when asked
    out = rpa.write_kv(jnp.zeros(reference.kv_cache_shape(2, 8, 2, 24)), k, k, jnp.zeros((4,), jnp.int32), impl="gpu")
    assert out.shape == (2, 2, 2, 8, 24)
