"""The Pallas ragged paged attention kernels (GPU and TPU) held to the reference, in interpret mode on CPU.

Every case builds its cache from a randomly permuted page table, fills every page and slot that no
sequence owns with NaN, fills padding query rows with NaN and points unused page-table entries at
random pages, so any stray read poisons the output. Shapes are tiny: each case is one interpret run.
The Hopper Mosaic GPU kernel has its own file (test_attention_mosaic.py), which builds its cases with `make_case`
from here, and so has the RoPE + K/V write (test_rope_and_write_kv.py).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jengine.kernels_pallas import ragged_paged_attention as rpa
from jengine.kernels_pallas.ragged_paged_attention import blocks, gpu, reference, tpu


def make_case(seed, q_lens, kv_lens, *, group, head_dim, page_size, dtype, num_kv_heads=2, pad_tokens=3,
              pad_seqs=2, kv_dtype=None):
    rng = np.random.default_rng(seed)
    s = len(q_lens)
    need = [-(-k // page_size) for k in kv_lens]
    pages_per_seq = max(need) + 1
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages)
    table = rng.integers(0, num_pages, (s + pad_seqs, pages_per_seq)).astype(np.int32)
    cache = np.full(reference.kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    used = 0
    for i, (n, length) in enumerate(zip(need, kv_lens)):
        table[i, :n] = perm[used:used + n]
        used += n
        for t in range(length):
            cache[:, :, table[i, t // page_size], t % page_size] = rng.standard_normal((2, num_kv_heads, head_dim))
    total = sum(q_lens)
    q = rng.standard_normal((total + pad_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    q[total:] = np.nan
    cu = np.full(s + pad_seqs + 1, total, np.int32)
    cu[: s + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.zeros(s + pad_seqs, np.int32)
    lens[:s] = kv_lens
    return (jnp.asarray(q, dtype), jnp.asarray(cache, kv_dtype or dtype), jnp.asarray(lens), jnp.asarray(table),
            jnp.asarray(cu), jnp.asarray([s], jnp.int32))


def assert_matches_reference(out, args, num_real_tokens, **kw):
    f32 = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    want = np.asarray(reference.ragged_paged_attention(*f32, **kw))
    got = np.asarray(out.astype(jnp.float32))
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[num_real_tokens:], 0.0)  # padding rows
    tol = 1e-5 if args[0].dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got[:num_real_tokens], want[:num_real_tokens], atol=tol, rtol=tol)


# (name, q_lens, kv_lens, group, head_dim, page_size, dtype, options). Lengths cover 0 (an idle slot),
# 1, page boundaries (16/17, 32/33, 64) and "long" (several kv blocks).
CASES = [
    ("decode_gqa4", [1, 1, 1, 1], [1, 16, 17, 150], 4, 64, 16, jnp.float32, {}),
    ("prefill_mha", [33, 64], [33, 64], 1, 128, 32, jnp.bfloat16, {}),
    ("mixed_gqa8_idle_slot", [5, 0, 1, 40], [70, 0, 33, 40], 8, 64, 16, jnp.float32, {}),
    ("mixed_window_softcap", [1, 20, 3], [90, 20, 64], 4, 128, 16, jnp.bfloat16,
     dict(sliding_window=24, soft_cap=5.0)),
    ("long_decode_and_chunk", [1, 30], [300, 200], 4, 64, 32, jnp.bfloat16, {}),
    # Default GPU tiles: the mixed bucket's decode launch splits its keys (2 splits) before the prefill
    # launch writes into the merged output.
    ("mixed_decode_splits", [1, 1, 24], [700, 5, 24], 4, 64, 16, jnp.float32, {}),
]
# Small explicit tiles force many kv blocks, several kv splits (GPU) and q blocks shared by sequences.
CONFIGS = {"gpu": gpu.GpuConfig(block_q=4, block_kv=32, num_kv_splits=3, num_warps=4, num_stages=1),
           "tpu": tpu.TpuConfig(block_q=8, pages_per_block=2)}


@pytest.fixture(autouse=True)
def full_f32_matmuls():
    """On a GPU (this file's kernels run there too, interpreted, or compiled where a test says), an f32
    matmul defaults to TF32: kernel and reference then differ by up to ~1e-3 against the 1e-5 held
    here (session 46). Full f32 everywhere; a no-op on the CPU."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def clean_tpu_interpreter():
    yield
    pltpu.reset_tpu_interpret_mode_state()  # an exception mid-kernel leaves the simulated TPU dirty


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize("name,q_lens,kv_lens,group,head_dim,page_size,dtype,options", CASES,
                         ids=[c[0] for c in CASES])
def test_kernel_matches_reference(impl, name, q_lens, kv_lens, group, head_dim, page_size, dtype, options,
                                  clean_tpu_interpreter):
    args = make_case(zlib.crc32(name.encode()), q_lens, kv_lens, group=group, head_dim=head_dim, page_size=page_size,
                     dtype=dtype)
    # Default tiles take the GPU's two-launch path (decodes and prefills apart) for mixed buckets.
    config = CONFIGS[impl] if name in ("mixed_gqa8_idle_slot", "long_decode_and_chunk") else None
    if name == "mixed_decode_splits" and impl == "gpu":
        assert gpu.tuned_config("decode", 5, 2, 4, page_size, 45 * page_size, 4).num_kv_splits == 4
    out = rpa.ragged_paged_attention(*args, sm_scale=head_dim**-0.5, impl=impl, interpret=True, config=config,
                                     **options)
    assert_matches_reference(out, args, sum(q_lens), sm_scale=head_dim**-0.5, **options)


FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize("name", ["mixed_window_softcap", "long_decode_and_chunk", "decode_gqa4"])
def test_kernels_read_8bit_caches(name, impl, kv_dtype, clean_tpu_interpreter):
    """An 8-bit cache (NaN-poisoned like the others) read by each kernel: the same result as the
    reference reading the same cache."""
    case = next(c for c in CASES if c[0] == name)
    _, q_lens, kv_lens, group, head_dim, page_size, dtype, options = case
    args = make_case(zlib.crc32(name.encode()), q_lens, kv_lens, group=group, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, kv_dtype=kv_dtype)
    assert args[1].dtype == kv_dtype
    config = CONFIGS[impl] if name == "long_decode_and_chunk" else None
    if impl == "gpu" and not isinstance(config, gpu.GpuConfig):
        config = gpu.GpuConfig(4, 32, 1, 4, 1)  # the Triton kernel (the Mosaic one has its own test)
    import jax

    interpret = impl == "tpu" or jax.default_backend() != "gpu"  # compiled on a GPU
    out = rpa.ragged_paged_attention(*args, sm_scale=head_dim**-0.5, impl=impl, interpret=interpret, config=config,
                                     **options)
    assert_matches_reference(out, args, sum(q_lens), sm_scale=head_dim**-0.5, **options)


def test_tpu_kernel_has_no_races_under_forced_interpret_mode(clean_tpu_interpreter):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interp

    args = make_case(7, [1, 9], [40, 9], group=2, head_dim=64, page_size=16, dtype=jnp.float32)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait")):
        out = rpa.ragged_paged_attention(*args, sm_scale=0.125, impl="tpu", config=CONFIGS["tpu"])
        out.block_until_ready()
    assert interp.races is not None and not interp.races.races_found
    assert_matches_reference(out, args, 10, sm_scale=0.125)


def test_gpu_work_items_cover_every_token_once():
    cu = jnp.asarray([0, 5, 5, 6, 6], jnp.int32)
    seq, start, end = (np.asarray(x) for x in blocks.work_items(cu, jnp.asarray([3], jnp.int32), 9, block_q=4))
    covered = np.zeros(9, int)
    for s_, a, b in zip(seq, start, end):
        covered[a:b] += 1
        assert s_ == -1 or (cu[s_] <= a and b <= cu[s_ + 1])
    np.testing.assert_array_equal(covered, 1)
    assert set(seq[(start < end)].tolist()) == {0, 2, -1}  # the idle slot 1 gets no block


def test_gpu_mixed_launches_split_short_and_long_sequences():
    cu, n = jnp.asarray([0, 1, 9, 10, 10], jnp.int32), jnp.asarray([3], jnp.int32)
    short = blocks.work_items(cu, n, 12, 4, select="short", short_len=4, num_items=4)
    long = blocks.work_items(cu, n, 12, 4, select="long", short_len=4)
    short_rows = {(int(a), int(b), int(s_)) for s_, a, b in zip(*(np.asarray(x) for x in short)) if a < b}
    assert short_rows == {(0, 1, 0), (9, 10, 2)}
    long_rows = {(int(a), int(b), int(s_)) for s_, a, b in zip(*(np.asarray(x) for x in long)) if a < b}
    assert long_rows == {(1, 5, 1), (5, 9, 1), (10, 12, -1)}


def test_tpu_work_items_list_every_sequence_of_each_block_in_order():
    cu = jnp.asarray([0, 3, 3, 12, 12], jnp.int32)
    blk, seq = (np.asarray(x) for x in tpu.work_items(cu, jnp.asarray([3], jnp.int32), num_blocks=3,
                                                      block_q=8))
    pairs = [(b, s) for b, s in zip(blk, seq)]
    assert pairs[:5] == [(0, 0), (0, 1), (0, 2), (1, 2), (2, -1)]  # block 2 holds only padding
    assert all(p == (2, -1) for p in pairs[5:])
    assert (np.diff(blk) >= 0).all()


def test_default_impl_on_cpu_is_the_reference():
    import jax

    if jax.default_backend() != "cpu":  # elsewhere the default is a kernel, equal only to a tolerance
        pytest.skip("the default implementation is the reference only on the CPU")
    args = make_case(3, [2], [5], group=2, head_dim=64, page_size=16, dtype=jnp.float32)
    out = rpa.ragged_paged_attention(*args, sm_scale=0.125)
    np.testing.assert_array_equal(out, reference.ragged_paged_attention(*args, sm_scale=0.125))


@pytest.mark.parametrize("impl", ["reference", "gpu"])
def test_result_comes_in_out_dtype(impl):
    """`out_dtype`: the result in that dtype, the same values as q's dtype's result converted."""
    args = make_case(6, [1, 4], [9, 4], group=2, head_dim=64, page_size=16, dtype=jnp.float32)
    kw = dict(sm_scale=0.125, impl=impl, interpret=impl == "gpu")
    out = rpa.ragged_paged_attention(*args, **kw)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        got = rpa.ragged_paged_attention(*args, **kw, out_dtype=dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got[:5].astype(jnp.float32)),
                                      np.asarray(out[:5].astype(dtype).astype(jnp.float32)))


def _bad(**change):
    args = dict(zip(["q", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"],
                    make_case(0, [1], [3], group=2, head_dim=64, page_size=16, dtype=jnp.float32)))
    kw = dict(sm_scale=0.125)
    for k, v in change.items():
        (args if k in args else kw)[k] = v(args[k]) if callable(v) else v
    return args, kw


def test_numpy_scalars_are_accepted_as_static_options():
    args = make_case(4, [3], [7], group=2, head_dim=64, page_size=16, dtype=jnp.float32)
    out = rpa.ragged_paged_attention(*args, sm_scale=np.float64(0.125), sliding_window=np.int64(4),
                                     soft_cap=np.float32(10.0))
    assert out.shape == args[0].shape


@pytest.mark.parametrize("arg,change", [
    ("q", dict(q=lambda q: q[0])),
    ("q", dict(q=lambda q: q.astype(jnp.int32))),
    ("q", dict(q=lambda q: q[:, :3])),
    ("kv_cache", dict(kv_cache=lambda c: c.astype(jnp.bfloat16))),
    ("kv_cache", dict(kv_cache=lambda c: c.astype(jnp.int8))),
    ("kv_cache", dict(kv_cache=lambda c: c[..., :32])),
    ("kv_cache", dict(kv_cache=lambda c: c[0])),
    ("kv_lens", dict(kv_lens=lambda x: x[:1])),
    ("kv_lens", dict(kv_lens=lambda x: x.astype(jnp.float32))),
    ("page_indices", dict(page_indices=lambda x: x[0])),
    ("cu_q_lens", dict(cu_q_lens=lambda x: x[:-1])),
    ("num_seqs", dict(num_seqs=jnp.asarray([1, 1], jnp.int32))),
    ("sm_scale", dict(sm_scale=0.0)),
    ("sm_scale", dict(sm_scale=jnp.float32(0.1))),  # a traced/array scale cannot shape the kernel
    ("sliding_window", dict(sliding_window=0)),
    ("soft_cap", dict(soft_cap=-1.0)),
    ("impl", dict(impl="cuda")),
    ("out_dtype", dict(out_dtype="int32")),
    ("out_dtype", dict(out_dtype="no such type")),
])
def test_invalid_inputs_raise_value_error_naming_the_argument(arg, change):
    args, kw = _bad(**change)
    with pytest.raises(ValueError, match=f"`{arg}`"):
        rpa.ragged_paged_attention(**args, **kw)


def test_without_the_triton_lowering_gpu_calls_fall_to_xla_and_the_mosaic_kernel_still_imports():
    """JAX has deprecated Pallas's Triton lowering. In a process where it cannot be imported, the Mosaic GPU modules
    import (they share only `blocks.py` with the Triton kernel), and impl="gpu" runs XLA's ops for what the Triton
    kernels did: the reference's results."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["jax.experimental.pallas.triton"] = None  # what `import` finds once JAX drops the module
import numpy as np, jax.numpy as jnp
from jengine.kernels_pallas import ragged_paged_attention as rpa
from jengine.kernels_pallas.ragged_paged_attention import gpu_mosaic, reference
assert not rpa.triton_lowering()
rng = np.random.default_rng(0)
args = (jnp.asarray(rng.standard_normal((6, 4, 64)), jnp.float32),  # 2 sequences: 1 + 5 query tokens, 9 and 5 keys
        jnp.asarray(rng.standard_normal(reference.kv_cache_shape(4, 16, 2, 64)), jnp.float32),
        jnp.asarray([9, 5], jnp.int32), jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([0, 1, 6], jnp.int32),
        jnp.asarray([2], jnp.int32))
out = rpa.ragged_paged_attention(*args, sm_scale=0.125, impl="gpu")
np.testing.assert_array_equal(out, reference.ragged_paged_attention(*args, sm_scale=0.125))
cache = jnp.asarray(rng.standard_normal(reference.kv_cache_shape(2, 8, 2, 64)), jnp.float32)
qkv, cos, sin = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3, 8 * 64), (3, 32), (3, 32)))
slots = jnp.asarray([3, -1, 9], jnp.int32)
got = rpa.rope_and_write_kv(cache, qkv, cos, sin, slots, num_q_heads=4, impl="gpu")
want = reference.rope_and_write_kv(cache, qkv, cos, sin, slots, 4)
for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
assert "jax.experimental.pallas.triton" in sys.modules and sys.modules["jax.experimental.pallas.triton"] is None
print("ok")
"""
    run = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
