"""Per-bucket XLA options of the forward program (GEMM backend by step size, GPU only)."""

from __future__ import annotations

import jax
import pytest

from jengine import runner


@pytest.mark.parametrize("backend, tokens, flags, expected", [
    ("cpu", 256, "", None),
    ("gpu", 16, "", None),
    ("gpu", runner.CUBLAS_GEMM_MIN_TOKENS, "", {"xla_gpu_enable_triton_gemm": False}),
    ("gpu", 2048, "--xla_gpu_autotune_level=2", {"xla_gpu_enable_triton_gemm": False}),
    ("gpu", 2048, "--xla_gpu_enable_triton_gemm=true", None),  # the user's choice wins
])
def test_forward_compiler_options(monkeypatch, backend, tokens, flags, expected):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert runner.forward_compiler_options(tokens) == expected


def test_options_compile_on_this_backend():
    # the option is a valid XLA debug option wherever the engine compiles (CPU here)
    f = jax.jit(lambda x: x @ x).lower(jax.numpy.ones((4, 4))).compile({"xla_gpu_enable_triton_gemm": False})
    assert float(f(jax.numpy.ones((4, 4)))[0, 0]) == 4.0
