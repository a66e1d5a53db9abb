"""`rope_and_write_kv`: a step's fused Q/K/V projections split into heads, RoPE on Q and K, K/V written into the
paged cache (the Pallas GPU kernel in interpret mode on CPU, and XLA's ops), against a NumPy model, including
8-bit caches with and without a checkpoint's K/V scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_kernels import FP8

from jengine.kernels_pallas import ragged_paged_attention as rpa
from jengine.kernels_pallas.ragged_paged_attention import reference

NUM_PAGES, PAGE_SIZE, HQ, HKV, D, T = 6, 8, 4, 2, 32, 13


def _case(seed, t=T, scale=1.0):
    rng = np.random.default_rng(seed)
    qkv = (rng.standard_normal((t, (HQ + 2 * HKV) * D)) * scale).astype(np.float32)
    angles = rng.uniform(0, 100, (t, D // 2)).astype(np.float32)
    slots = rng.permutation(NUM_PAGES * PAGE_SIZE)[:t].astype(np.int32)
    slots[[2, 7, t - 1]] = -1  # padding tokens
    return qkv, np.cos(angles), np.sin(angles), slots


def _numpy_model(cache, qkv, cos, sin, slots, scales=None):
    """RoPE by the formula, in float64: q [T, Hq, D] and the cache's K/V rows as the model expects them."""
    heads = qkv.astype(np.float64).reshape(len(qkv), HQ + 2 * HKV, D)
    x1, x2 = heads[..., : D // 2], heads[..., D // 2 :]
    c, s = cos[:, None].astype(np.float64), sin[:, None].astype(np.float64)
    rotated = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    q, k, v = rotated[:, :HQ], rotated[:, HQ : HQ + HKV], heads[:, HQ + HKV :]
    if scales is not None:
        q, k, v = q * scales[0], k / scales[0], v / scales[1]
    want = cache.astype(np.float64)
    for i, slot in enumerate(slots):
        if slot >= 0:
            want[0, :, slot // PAGE_SIZE, slot % PAGE_SIZE] = k[i]
            want[1, :, slot // PAGE_SIZE, slot % PAGE_SIZE] = v[i]
    return q, want


def _run(impl, cache, qkv, cos, sin, slots, scales=None, q_dtype=None):
    interpret = impl == "gpu" and jax.default_backend() != "gpu"
    fn = jax.jit(lambda c, x, co, si, sl, sc: rpa.rope_and_write_kv(c, x, co, si, sl, num_q_heads=HQ, kv_scales=sc,
                                                                    q_dtype=q_dtype, impl=impl, interpret=interpret),
                 donate_argnums=0)
    return fn(cache, qkv, jnp.asarray(cos), jnp.asarray(sin), jnp.asarray(slots),
              None if scales is None else jnp.asarray(scales, jnp.float32))


@pytest.mark.parametrize("impl", ["gpu", "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rotates_q_and_k_and_writes_every_real_slot_and_nothing_else(impl, dtype):
    qkv, cos, sin, slots = _case(7)
    cache = np.random.default_rng(1).standard_normal(reference.kv_cache_shape(NUM_PAGES, PAGE_SIZE, HKV, D))
    qkv_d = jnp.asarray(qkv, dtype)
    q, got = _run(impl, jnp.asarray(cache, dtype), qkv_d, cos, sin, slots)
    assert q.shape == (T, HQ, D) and q.dtype == dtype and got.dtype == dtype
    want_q, want = _numpy_model(np.asarray(jnp.asarray(cache, dtype).astype(jnp.float32)),
                                np.asarray(qkv_d.astype(jnp.float32)), cos, sin, slots)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)  # one bf16 rounding
    np.testing.assert_allclose(np.asarray(q.astype(jnp.float32)), want_q, **tol)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, **tol)
    untouched = np.ones(NUM_PAGES * PAGE_SIZE, bool)
    untouched[slots[slots >= 0]] = False
    flat = lambda c: np.asarray(c.astype(jnp.float32)).reshape(2, HKV, -1, D)[:, :, untouched]  # noqa: E731
    np.testing.assert_array_equal(flat(got), flat(jnp.asarray(cache, dtype)))  # padding wrote nothing


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scales", [None, (0.5, 2.0)], ids=["no-scales", "scales"])
def test_kernel_matches_the_reference_bit_for_bit_into_an_8bit_cache(kv_dtype, scales):
    """The same roundings in the same order (RoPE in f32, then qkv's dtype, then the scale, then the cache's
    type, saturated): the kernel and XLA's ops give identical bits, values past the 8-bit range included."""
    qkv, cos, sin, slots = _case(8, scale=3.0)
    top = float(jnp.finfo(kv_dtype).max)
    qkv[0, (HQ + HKV) * D : (HQ + HKV) * D + 3] = [1e6, -1e6, top * 1.01]  # V past the finite range: saturated
    cache = np.asarray(jnp.asarray(np.random.default_rng(2).standard_normal(
        reference.kv_cache_shape(NUM_PAGES, PAGE_SIZE, HKV, D)), kv_dtype).astype(jnp.float32))
    x = jnp.asarray(qkv, jnp.bfloat16)
    q_k, got_k = _run("gpu", jnp.asarray(cache, kv_dtype), x, cos, sin, slots, scales)
    q_r, got_r = _run("reference", jnp.asarray(cache, kv_dtype), x, cos, sin, slots, scales)
    assert got_k.dtype == kv_dtype
    np.testing.assert_array_equal(np.asarray(q_k.astype(jnp.float32)), np.asarray(q_r.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(got_k.astype(jnp.float32)), np.asarray(got_r.astype(jnp.float32)))
    s0 = slots[0]  # 1e6 and -1e6 stay past the range at either scale: saturated, not NaN
    v_row = np.asarray(got_k[1, 0, s0 // PAGE_SIZE, s0 % PAGE_SIZE, :3].astype(jnp.float32))
    np.testing.assert_array_equal(v_row[:2], [top, -top])
    if scales is None:
        assert v_row[2] == top
    want_q, want = _numpy_model(cache, np.asarray(x.astype(jnp.float32)), cos, sin,
                                slots, scales)
    np.testing.assert_allclose(np.asarray(q_k.astype(jnp.float32)), want_q, rtol=2e-2, atol=2e-2)
    real = slots[1]
    got_row = np.asarray(got_k[:, :, real // PAGE_SIZE, real % PAGE_SIZE].astype(jnp.float32))
    np.testing.assert_allclose(got_row, want[:, :, real // PAGE_SIZE, real % PAGE_SIZE], rtol=0.13, atol=0.02)


@pytest.mark.parametrize("impl", ["gpu", "reference"])
@pytest.mark.parametrize("scales", [None, (0.5, 2.0)], ids=["no-scales", "scales"])
def test_q_in_float16_is_the_bf16_q_saturated(impl, scales):
    """`q_dtype=float16` (the Hopper attention's queries for an 8-bit cache): the same bits as rounding Q to bf16
    and converting that to f16, values past f16's range saturated; the cache is untouched by the choice."""
    qkv, cos, sin, slots = _case(9, scale=3.0)
    qkv[0, :2] = [1e6, -1e6]  # Q past f16's range (bf16 holds it)
    cos[0], sin[0] = 1.0, 0.0  # so the rotation keeps it there
    x = jnp.asarray(qkv, jnp.bfloat16)
    cache = np.random.default_rng(3).standard_normal(reference.kv_cache_shape(NUM_PAGES, PAGE_SIZE, HKV, D))
    q16, got16 = _run(impl, jnp.asarray(cache, FP8[0]), x, cos, sin, slots, scales, q_dtype=jnp.float16)
    q, got = _run(impl, jnp.asarray(cache, FP8[0]), x, cos, sin, slots, scales)
    assert q16.dtype == jnp.float16 and q.dtype == jnp.bfloat16
    top = float(jnp.finfo(jnp.float16).max)
    want = np.clip(np.asarray(q.astype(jnp.float32)), -top, top).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(q16), want)
    assert np.asarray(q16)[0, 0, 0] == top and np.asarray(q16)[0, 0, 1] == -top
    np.testing.assert_array_equal(np.asarray(got16.astype(jnp.float32)), np.asarray(got.astype(jnp.float32)))


def test_names_bad_arguments():
    qkv, cos, sin, slots = (jnp.asarray(a) for a in _case(3))
    cache = jnp.zeros(reference.kv_cache_shape(NUM_PAGES, PAGE_SIZE, HKV, D))
    call = lambda **kw: rpa.rope_and_write_kv(  # noqa: E731
        **{**dict(kv_cache=cache, qkv=qkv, cos=cos, sin=sin, slot_mapping=slots, num_q_heads=HQ), **kw})
    for bad, name in ((dict(slot_mapping=slots[:-1]), "slot_mapping"), (dict(kv_cache=cache[:, :1]), "qkv"),
                      (dict(kv_cache=cache[0]), "kv_cache"), (dict(qkv=qkv[:, :-D]), "qkv"),
                      (dict(num_q_heads=3), "num_q_heads"), (dict(cos=cos.astype(jnp.bfloat16)), "cos"),
                      (dict(sin=sin[:, :-1]), "sin"), (dict(kv_scales=jnp.ones(3)), "kv_scales"),
                      (dict(impl="cuda"), "impl"), (dict(q_dtype=jnp.int8), "q_dtype"),
                      (dict(q_dtype="float17"), "q_dtype")):
        with pytest.raises(ValueError, match=f"rope_and_write_kv: `{name}`"):
            call(**bad)


def test_uses_the_kernel_on_gpus_where_it_tiles(monkeypatch):
    from jengine.kernels_pallas.ragged_paged_attention import gpu_rope_write_kv

    monkeypatch.setattr(rpa, "_default_impl", lambda: "gpu")
    monkeypatch.setattr(gpu_rope_write_kv, "rope_and_write_kv_gpu", lambda *a, **kw: "kernel")
    qkv, cos, sin, slots = (jnp.asarray(a) for a in _case(4))
    cache = jnp.zeros(reference.kv_cache_shape(NUM_PAGES, PAGE_SIZE, HKV, D))
    assert rpa.rope_and_write_kv(cache, qkv, cos, sin, slots, num_q_heads=HQ) == "kernel"
    d = 24  # a head size the Triton kernel cannot tile: XLA's ops, even when asked
    q, out = rpa.rope_and_write_kv(jnp.zeros(reference.kv_cache_shape(2, 8, HKV, d)),
                                   jnp.zeros((4, (HQ + 2 * HKV) * d)), jnp.zeros((4, d // 2)), jnp.zeros((4, d // 2)),
                                   jnp.zeros((4,), jnp.int32), num_q_heads=HQ, impl="gpu")
    assert q.shape == (4, HQ, d) and out.shape == (2, HKV, 2, 8, d)
