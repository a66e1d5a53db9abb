"""The Pallas (Triton lowering) GPU kernels lowered for an H200 on the CPU.

Interpret mode runs a kernel's jaxpr with XLA's CPU ops, so it cannot catch what only the Triton lowering
rejects (session 43 lost a GPU call to a comparison the lowering refused: `('i1', 'i32')`). JAX lowers a
Triton kernel for the GPU its abstract mesh names, so these tests lower each kernel for an "NVIDIA H200"
without one (Triton IR inside the `__gpu$xla.gpu.triton` custom call). Compiling that IR to PTX needs the GPU
client and stays with the GPU tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from test_attention_kernels import make_case

from jengine.kernels_pallas import ragged_paged_attention as rpa
from jengine.kernels_pallas.ragged_paged_attention import gpu, gpu_rope_write_kv, reference

TRITON_CALL = "__gpu$xla.gpu.triton"
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                 platform="cuda"))


def lowered_for_h200(fn, *args) -> str:
    with use_abstract_mesh(H200):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kv_dtype, scaled, q_dtype", [(jnp.bfloat16, False, None), (jnp.float8_e4m3fn, True, None),
                                                       (jnp.float8_e4m3fn, False, jnp.float16)])
def test_rope_and_write_kv_lowers_to_triton(kv_dtype, scaled, q_dtype):
    tokens, hq, hkv, d, page_size = 8, 8, 2, 64, 16
    cache = jnp.zeros(reference.kv_cache_shape(6, page_size, hkv, d), kv_dtype)
    qkv = jnp.zeros((tokens, (hq + 2 * hkv) * d), jnp.bfloat16)
    table = jnp.zeros((tokens, d // 2), jnp.float32)
    slots = jnp.arange(tokens, dtype=jnp.int32)
    scales = jnp.ones((2,), jnp.float32) if scaled else None
    text = lowered_for_h200(
        lambda c, x, cos, sin, s: gpu_rope_write_kv.rope_and_write_kv_gpu(c, x, cos, sin, s, hq, scales, q_dtype),
        cache, qkv, table, table, slots)
    assert text.count(TRITON_CALL) == 1
    if q_dtype is not None:  # Q leaves the kernel in f16 (the 8-bit cache's Hopper attention reads it so)
        assert f"tensor<{tokens}x{hq}x{d}xf16>" in text


# (q_lens, kv_lens, options, config): the table's decode and mixed launches (key splits, the mixed bucket's
# two launches into one output), a sliding window with a soft cap, explicit tiles, an 8-bit cache.
CASES = [
    ([1, 1, 1], [700, 5, 33], {}, None, None),
    ([1, 20, 3], [90, 20, 64], dict(sliding_window=24, soft_cap=5.0), None, None),
    ([5, 1, 40], [70, 33, 40], {}, gpu.GpuConfig(block_q=4, block_kv=32, num_kv_splits=3, num_warps=4,
                                                num_stages=1), None),
    ([1, 1, 24], [700, 5, 24], {}, None, jnp.float8_e4m3fn),
]


@pytest.mark.parametrize("q_lens, kv_lens, options, config, kv_dtype", CASES)
def test_triton_attention_lowers_to_triton(q_lens, kv_lens, options, config, kv_dtype):
    args = make_case(0, q_lens, kv_lens, group=4, head_dim=64, page_size=16, dtype=jnp.bfloat16, kv_dtype=kv_dtype)
    text = lowered_for_h200(
        lambda *a: gpu.ragged_paged_attention_gpu(*a, sm_scale=0.125, config=config, **options), *args)
    assert TRITON_CALL in text


def test_the_dispatcher_lowers_a_decode_bucket_for_h200_without_a_gpu():
    """`ragged_paged_attention(impl="gpu")` off Hopper (no devices here): the Triton kernel, lowered."""
    args = make_case(1, [1, 1], [40, 7], group=4, head_dim=64, page_size=16, dtype=jnp.bfloat16)
    text = lowered_for_h200(lambda *a: rpa.ragged_paged_attention(*a, sm_scale=0.125, impl="gpu"), *args)
    assert TRITON_CALL in text
