"""The fused small-batch matmul kernel (RMS norm / SwiGLU / residual epilogues) held to its reference, in
interpret mode on CPU, and the Llama layer wired through it held to the unfused model."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine import generate, loader
from jengine.kernels_pallas import fused_matmul as fm
from jengine.kernels_pallas.fused_matmul import gpu, reference
from jengine.models import llama

SMALL = gpu.GpuConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)  # several programs and K steps
FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models")


def make(seed, m, k, n, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * 3.0
    x[-1] = 0.0  # a padding row of zeros: its norm is 0 * rsqrt(eps), not NaN
    g = 1.0 + 0.1 * rng.standard_normal(k)
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    r = rng.standard_normal((m, n))
    return tuple(jnp.asarray(a, dtype) for a in (x, g, w, r))


def close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.isfinite(got).all()
    tol = 2e-5 if dtype == jnp.float32 else 3e-2  # bf16: one rounding of inputs and output apart
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [16, 32])
def test_norm_matmul_kernel_matches_reference(dtype, m):
    x, g, w, _ = make(0, m, 96, 48, dtype)
    got = fm.norm_matmul(x, g, w, eps=1e-5, impl="gpu", interpret=True, config=SMALL)
    close(got, reference.norm_matmul(x, g, w, eps=1e-5), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_matmul_swiglu_kernel_reads_gate_and_up_halves(dtype):
    x, g, w, _ = make(1, 16, 64, 96, dtype)  # gate = columns 0..47, up = 48..95: 3 programs of 16
    got = fm.norm_matmul(x, g, w, eps=1e-6, swiglu_out=True, impl="gpu", interpret=True, config=SMALL)
    assert got.shape == (16, 48)
    close(got, reference.norm_matmul(x, g, w, eps=1e-6, swiglu_out=True), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_add_kernel_matches_reference(dtype):
    x, _, w, r = make(2, 16, 128, 32, dtype)
    got = fm.matmul_add(x, w, r, impl="gpu", interpret=True, config=SMALL)
    close(got, reference.matmul_add(x, w, r), dtype)


def test_default_tile_shrinks_to_divide_small_models():
    cfg = gpu.tuned_config("norm", k=192, n_out=48)
    assert 192 % cfg.block_k == 0 and 48 % cfg.block_n == 0 and cfg.block_n >= 16
    assert gpu.tuned_config("add", k=4096, n_out=4096) == gpu.TUNED["add"]


@pytest.mark.skipif(jax.default_backend() in ("gpu", "cuda"), reason="GPUs pick the kernel")
def test_cpu_picks_the_reference_bit_for_bit():
    x, g, w, r = make(3, 16, 64, 32, jnp.float32)
    np.testing.assert_array_equal(fm.norm_matmul(x, g, w, eps=1e-5), reference.norm_matmul(x, g, w, eps=1e-5))
    np.testing.assert_array_equal(fm.matmul_add(x, w, r), reference.matmul_add(x, w, r))


@pytest.mark.parametrize("call, message", [
    (lambda x, g, w, r: fm.norm_matmul(x[0], g, w, eps=1e-5), "`x` must be [M, K]"),
    (lambda x, g, w, r: fm.norm_matmul(x, g, w.T, eps=1e-5), "`w` must be [K=64, N]"),
    (lambda x, g, w, r: fm.norm_matmul(x, g[:8], w, eps=1e-5), "`norm_w` must be [K=64]"),
    (lambda x, g, w, r: fm.norm_matmul(x, g, w, eps=0.0), "`eps` must be a positive float"),
    (lambda x, g, w, r: fm.norm_matmul(x, g, w[:, :31], eps=1e-5, swiglu_out=True), "even number of columns"),
    (lambda x, g, w, r: fm.norm_matmul(x, g, w.astype(jnp.bfloat16), eps=1e-5), "`w` dtype bfloat16"),
    (lambda x, g, w, r: fm.matmul_add(x, w, r[:, :8]), "`residual` must be [M, N]"),
    (lambda x, g, w, r: fm.matmul_add(x, w, r, impl="cuda"), "`impl` must be one of"),
    (lambda x, g, w, r: fm.matmul_add(x[:12], w, r[:12], impl="gpu"), "does not fit the GPU tile"),
])
def test_bad_inputs_raise_value_error_naming_the_argument(call, message):
    x, g, w, r = make(4, 16, 64, 32, jnp.float32)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(x, g, w, r)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_llama_layer_through_the_kernel_matches_the_unfused_model(name, monkeypatch):
    """The model's wiring (norm weights, gate|up halves, residuals, QKV bias) with the kernel's
    semantics: force the interpret-mode kernel into every layer matmul and compare prompt logits."""
    cfg, params = loader.load_model(os.path.join(FIXTURES_DIR, name), dtype="float32")
    prompt = list(range(3, 20))
    want = np.asarray(generate.prompt_logits(cfg, params, prompt))

    calls = []

    def forced(op):
        @functools.wraps(op)
        def run(*args, impl=None, **kw):
            calls.append(op.__name__)
            return op(*args, impl="gpu", interpret=True, **kw)
        return run

    monkeypatch.setattr(llama, "norm_matmul", forced(fm.norm_matmul))
    monkeypatch.setattr(llama, "matmul_add", forced(fm.matmul_add))
    jax.clear_caches()  # the jitted layer would otherwise reuse its unfused trace
    try:
        got = np.asarray(generate.prompt_logits(cfg, params, prompt))
    finally:
        jax.clear_caches()
    assert {"norm_matmul", "matmul_add"} <= set(calls)  # the layer was traced again, through the kernel
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
