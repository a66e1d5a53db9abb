"""`add_rms_norm`: the residual add and the RMSNorm after it as one Pallas kernel (interpret mode on CPU,
compiled on a GPU), against its jnp reference, which is checked first against NumPy by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.kernels_pallas import add_rms_norm as arn

INTERPRET = jax.default_backend() != "gpu"


def test_reference_adds_then_normalizes_by_the_root_mean_square():
    x = jnp.asarray([[1.0, 2.0, 3.0, 4.0]])
    delta = jnp.asarray([[1.0, 0.0, -1.0, 0.0]])  # y = [2, 2, 2, 4]: mean of squares 7
    weight = jnp.asarray([1.0, 2.0, 0.5, 1.0])
    y, normed = arn.reference(x, delta, weight, 0.0)
    np.testing.assert_array_equal(np.asarray(y), [[2.0, 2.0, 2.0, 4.0]])
    np.testing.assert_allclose(np.asarray(normed), [[2 / 7**0.5, 4 / 7**0.5, 1 / 7**0.5, 4 / 7**0.5]], rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (3, 200)], ids=["pow2", "96", "200"])
def test_kernel_matches_reference(dtype, shape):
    kx, kd, kw = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, shape, dtype) * 4
    delta = jax.random.normal(kd, shape, dtype)
    weight = jax.random.normal(kw, shape[1:], dtype)
    y, normed = jax.jit(lambda *a: arn.add_rms_norm(*a, 1e-5, interpret=INTERPRET))(x, delta, weight)
    y_ref, normed_ref = arn.reference(x, delta, weight, 1e-5)
    assert y.dtype == normed.dtype == dtype and y.shape == normed.shape == shape
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))  # the same rounding
    # The norm: one bf16 step at most (the reduction's order and rsqrt's last bits may differ).
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(normed_ref, np.float32), rtol=tol, atol=tol)


def test_padding_columns_do_not_enter_the_mean():
    # 96 columns run as 128 in the kernel: a row of ones has mean square 1 only if the 32 masked ones count 0.
    x = jnp.ones((2, 96), jnp.float32)
    y, normed = arn.add_rms_norm(x, jnp.zeros_like(x), jnp.ones((96,), jnp.float32), 0.0, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(normed), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(y), 1.0)


def test_mismatched_shapes_are_refused():
    x = jnp.ones((2, 8))
    with pytest.raises(ValueError, match="`x` and `delta` must be"):
        arn.add_rms_norm(x, jnp.ones((2, 4)), jnp.ones((8,)), 1e-5, interpret=True)
    with pytest.raises(ValueError, match="`weight`"):
        arn.add_rms_norm(x, x, jnp.ones((4,)), 1e-5, interpret=True)


def test_used_only_for_small_steps_on_one_gpu():
    small, big = jnp.ones((arn.MAX_TOKENS, 16)), jnp.ones((arn.MAX_TOKENS + 1, 16))
    on_gpu = jax.default_backend() == "gpu"
    assert arn.use_kernel(small, 1) == on_gpu
    assert not arn.use_kernel(big, 1)
    assert not arn.use_kernel(small, 2)
