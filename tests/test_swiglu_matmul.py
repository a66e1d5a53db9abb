"""The fused gate/up GEMM with the SwiGLU product in its epilogue (`kernels_pallas.swiglu_matmul`).

On a Hopper GPU the kernel is held to its jnp reference; elsewhere it is lowered for CUDA (Mosaic GPU
cannot run wgmma in interpret mode), and the model is shown to keep XLA's path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.kernels_pallas import swiglu_matmul as sm
from jengine.kernels_pallas.ragged_paged_attention.gpu_mosaic import on_hopper

HOPPER = jax.default_backend() == "gpu" and on_hopper()


def _operands(m, k, inter, dtype=jnp.bfloat16, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, 2 * inter), jnp.float32) * k**-0.5).astype(dtype)
    return x, w


def test_reference_is_silu_gate_times_up():
    x, w = _operands(8, 64, 96, jnp.float32)
    gate, up = x @ w[:, :96], x @ w[:, 96:]
    np.testing.assert_allclose(sm.reference(x, w), gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field,value", [("tile_m", 0), ("tile_n", 96), ("tile_k", 32), ("stages", True),
                                         ("snake", -1), ("tile_m", 128.0), ("delay_release", 2),
                                         ("delay_release", True), ("approx_math", 1)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field if field != "tile_n" else "multiples of 64"):
        sm.SwigluConfig(**{field: value})


def test_config_rejects_a_release_lag_as_deep_as_the_ring():
    with pytest.raises(ValueError, match="delay_release"):
        sm.SwigluConfig(stages=1, delay_release=1)


def test_config_rejects_accumulators_over_the_registers():
    with pytest.raises(ValueError, match="registers"):
        sm.SwigluConfig(tile_m=128, tile_n=128)


@pytest.mark.parametrize("x_shape,w_shape,dtype,ok", [
    ((256, 4096), (4096, 28672), jnp.bfloat16, True),
    ((2048, 64), (64, 256), jnp.float16, True),
    ((192, 4096), (4096, 28672), jnp.bfloat16, False),  # rows not whole 128-row tiles
    ((256, 4096), (4096, 28672 - 64), jnp.bfloat16, False),  # I not whole 128-column tiles
    ((256, 4000), (4000, 28672), jnp.bfloat16, False),  # K not whole 64-slices
    ((256, 4096), (4096, 28672), jnp.float32, False),
    ((256, 4096), (2048, 28672), jnp.bfloat16, False),
])
def test_supports(x_shape, w_shape, dtype, ok):
    assert sm.supports(x_shape, w_shape, dtype) is ok


def test_bad_operands_raise_value_errors():
    x, w = _operands(128, 64, 128)
    with pytest.raises(ValueError, match="x"):
        sm.swiglu_matmul(x[:100], w)
    with pytest.raises(ValueError, match="one dtype"):
        sm.swiglu_matmul(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match="2-D"):
        sm.swiglu_matmul(x[None], w)


def test_the_model_uses_it_only_on_hopper_for_large_steps():
    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    w = spec((4096, 28672))
    assert sm.use_kernel(spec((4096, 4096)), w) is HOPPER
    assert not sm.use_kernel(spec((sm.MIN_TOKENS // 2, 4096)), w)
    assert not sm.use_kernel(spec((4096, 4096), jnp.float16), w)  # operands of two dtypes


@pytest.mark.parametrize("m,k,inter,config", [
    (2048, 4096, 14336, sm.SwigluConfig()),  # the 8B layer at a 2048-token step
    (256, 4096, 14336, sm.SwigluConfig()),  # and at a 256-row decode step
    (256, 512, 384, sm.SwigluConfig(stages=3, snake=4)),
    (512, 256, 256, sm.SwigluConfig(tile_m=128, tile_n=64)),
    (128, 64, 128, sm.SwigluConfig()),  # one pipeline step, one output tile
    (256, 512, 384, sm.SwigluConfig(delay_release=1, approx_math=True)),  # one step's wgmmas in flight
    (128, 128, 128, sm.SwigluConfig(delay_release=1, stages=2)),  # two steps: the release lag at both ends
])
def test_kernel_matches_reference(m, k, inter, config):
    x, w = _operands(m, k, inter, seed=m + k)
    fn = jax.jit(lambda x, w: sm.swiglu_matmul(x, w, config))
    if not HOPPER:
        assert "mosaic_gpu" in fn.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        return
    got = np.asarray(fn(x, w).astype(jnp.float32))
    want = np.asarray(sm.reference(x, w).astype(jnp.float32))
    assert got.shape == (m, inter)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)


@pytest.mark.skipif(not HOPPER, reason="runs the kernel (Hopper GPU)")
@pytest.mark.parametrize("approx_math", [False, True])
def test_kernel_saturates_for_gates_past_exp_range(approx_math):
    """Gates far below -88 overflow exp(-gate) to inf in f32: silu must give 0 there, not NaN."""
    x, w = _operands(128, 256, 128, seed=5)
    x = x * 60  # gates of standard deviation ~60: many beyond the exp range on both sides
    got = np.asarray(sm.swiglu_matmul(x, w, sm.SwigluConfig(approx_math=approx_math)).astype(jnp.float32))
    want = np.asarray(sm.reference(x, w).astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)
