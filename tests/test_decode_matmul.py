"""The small-step GEMM (`kernels_pallas.decode_matmul`): plain, split-K partial sums, and gate/up with the
SwiGLU product in its epilogue.

On a Hopper GPU the kernel is held to its jnp reference; elsewhere it is lowered for CUDA (Mosaic GPU
cannot run wgmma in interpret mode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.kernels_pallas import decode_matmul as dm
from jengine.kernels_pallas.ragged_paged_attention.gpu_mosaic import on_hopper

HOPPER = jax.default_backend() == "gpu" and on_hopper()


def _operands(m, k, n, dtype=jnp.bfloat16, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    return x, w


def test_reference():
    x, w = _operands(4, 64, 256, jnp.float32)
    np.testing.assert_allclose(dm.reference(x, w), x @ w, rtol=1e-5, atol=1e-5)
    gate, up = x @ w[:, :128], x @ w[:, 128:]
    np.testing.assert_allclose(dm.reference(x, w, swiglu=True), gate / (1 + np.exp(-gate)) * up,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field,value", [("tile_n", 0), ("tile_n", 96), ("tile_k", 32), ("stages", True),
                                         ("split_k", 0), ("tile_n", 512), ("tile_k", 128.0)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        dm.DecodeMatmulConfig(**{field: value})


@pytest.mark.parametrize("x_shape,w_shape,dtype,config,swiglu,ok", [
    ((16, 4096), (4096, 6144), jnp.bfloat16, dm.DecodeMatmulConfig(), False, True),
    ((64, 14336), (14336, 4096), jnp.bfloat16, dm.DecodeMatmulConfig(split_k=4), False, True),
    ((16, 4096), (4096, 28672), jnp.bfloat16, dm.DecodeMatmulConfig(tile_n=128, tile_k=64), True, True),
    ((65, 4096), (4096, 6144), jnp.bfloat16, dm.DecodeMatmulConfig(), False, False),  # over 64 rows
    ((16, 4096), (4096, 6144 - 32), jnp.bfloat16, dm.DecodeMatmulConfig(), False, False),  # N not whole tiles
    ((16, 4096), (4096, 6144), jnp.bfloat16, dm.DecodeMatmulConfig(split_k=3), False, False),  # K slices
    ((16, 4096), (4096, 28672), jnp.bfloat16, dm.DecodeMatmulConfig(split_k=2), True, False),  # swiglu split
    ((16, 4096), (4096, 6144), jnp.float32, dm.DecodeMatmulConfig(), False, False),
    ((16, 4096), (2048, 6144), jnp.bfloat16, dm.DecodeMatmulConfig(), False, False),
    ((16, 4096), (4096, 28672), jnp.bfloat16, dm.DecodeMatmulConfig(tile_n=128), True, False),  # shared memory
])
def test_supports(x_shape, w_shape, dtype, config, swiglu, ok):
    assert dm.supports(x_shape, w_shape, dtype, config, swiglu) is ok


def test_bad_operands_raise_value_errors():
    x, w = _operands(16, 128, 128)
    with pytest.raises(ValueError, match="do not fit"):
        dm.decode_matmul(jnp.zeros((65, 128), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="one dtype"):
        dm.decode_matmul(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match="2-D"):
        dm.decode_matmul(x[None], w)


@pytest.mark.parametrize("m,k,n,config,swiglu", [
    (16, 4096, 6144, dm.DecodeMatmulConfig(), False),  # the 8B layer's QKV at a 16-token step
    (16, 14336, 4096, dm.DecodeMatmulConfig(split_k=4, stages=6), False),  # its down projection, split-K
    (16, 4096, 28672, dm.DecodeMatmulConfig(tile_n=128, tile_k=64), True),  # gate/up with the product
    (64, 512, 384, dm.DecodeMatmulConfig(tile_k=64, stages=2), False),  # 64 rows: no padding
    (1, 256, 128, dm.DecodeMatmulConfig(tile_k=256, stages=2), True),  # one row, one pipeline step
    (8, 512, 256, dm.DecodeMatmulConfig(tile_n=128, split_k=2), False),
])
def test_kernel_matches_reference(m, k, n, config, swiglu):
    x, w = _operands(m, k, n, seed=m + k)
    fn = jax.jit(lambda x, w: dm.decode_matmul(x, w, config, swiglu))
    if not HOPPER:
        assert "mosaic_gpu" in fn.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        return
    got = np.asarray(fn(x, w).astype(jnp.float32))
    if config.split_k > 1:
        assert got.shape == (config.split_k, m, n)
        got = got.sum(0)
    want = np.asarray(dm.reference(x, w, swiglu).astype(jnp.float32))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)


@pytest.mark.parametrize("k,n,swiglu,split", [(4096, 6144, False, 1), (4096, 4096, False, 2), (14336, 4096, False, 2),
                                                (4096, 28672, True, 1), (512, 256, False, 4)])
def test_config_for_fills_the_sms_in_one_wave(k, n, swiglu, split):
    config = dm.config_for(k, n, swiglu)
    assert config.split_k == split
    assert dm.supports((16, k), (k, n), jnp.bfloat16, config, swiglu)


def test_the_model_uses_it_only_on_hopper_for_small_steps():
    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    assert dm.use_kernel(spec((16, 4096)), spec((4096, 6144))) is HOPPER
    assert dm.use_gated_mlp(spec((64, 4096)), spec((4096, 28672)), spec((14336, 4096))) is HOPPER
    assert not dm.use_kernel(spec((65, 4096)), spec((4096, 6144)))
    assert not dm.use_kernel(spec((16, 4096), jnp.float16), spec((4096, 6144)))  # operands of two dtypes
    assert not dm.use_gated_mlp(spec((16, 4096)), spec((4096, 28672)), spec((4096, 4096)))  # down's K != I


@pytest.mark.parametrize("m", [1, 16, 64])
def test_matmul_and_gated_mlp_match_the_reference(m):
    x, w_gate_up = _operands(m, 512, 512, seed=m)
    _, w_down = _operands(m, 256, 512, seed=m + 1)
    mlp = jax.jit(dm.gated_mlp)
    mm = jax.jit(dm.matmul)
    if not HOPPER:
        assert "mosaic_gpu" in mlp.trace(x, w_gate_up, w_down).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in mm.trace(x, w_down.T).lower(lowering_platforms=("cuda",)).as_text()
        return
    h = dm.reference(x, w_gate_up, swiglu=True)
    want = np.asarray(dm.reference(h, w_down).astype(jnp.float32))
    got = np.asarray(mlp(x, w_gate_up, w_down).astype(jnp.float32))
    np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max(), rtol=3e-2)
    want = np.asarray(dm.reference(x, w_down.T).astype(jnp.float32))
    got = np.asarray(mm(x, w_down.T).astype(jnp.float32))
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)
