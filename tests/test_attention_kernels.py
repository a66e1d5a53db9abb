"""The Pallas ragged paged attention kernels (GPU and TPU) held to the reference, in interpret mode on CPU.

Every case builds its cache from a randomly permuted page table, fills every page and slot that no
sequence owns with NaN, fills padding query rows with NaN and points unused page-table entries at
random pages, so any stray read poisons the output. Shapes are tiny: each case is one interpret run.
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jengine.kernels_pallas import ragged_paged_attention as rpa
from jengine.kernels_pallas.ragged_paged_attention import gpu, gpu_mosaic, reference, tpu


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


# The Mosaic GPU kernel uses wgmma, which GPU interpret mode does not simulate: on CPU it is lowered
# for CUDA (every layout and shape check of the Mosaic GPU lowering runs); on a Hopper GPU it is held to
# the reference, and the table must pick it for every bucket shape it supports.
MOSAIC_CASES = [
    ("decode", [1, 1, 1, 1], [1, 16, 17, 150], {}),
    ("decode_short_prompt_in_bucket", [1, 1, 3], [64, 65, 3], {}),
    ("decode_window_softcap", [1, 1, 1], [300, 40, 129], dict(sliding_window=70, soft_cap=5.0)),
    ("mixed", [1, 20, 1], [90, 20, 200], {}),
    ("prefill_chunks", [40, 17, 33], [40, 150, 97], {}),  # whole prompt; chunks after cached keys
    ("prefill_window", [70, 1, 35], [70, 200, 130], dict(sliding_window=23)),
]
MOSAIC_CONFIGS = [None, gpu_mosaic.MosaicConfig(64, 2, 3), gpu_mosaic.MosaicConfig(128, 3, 1),
                  gpu_mosaic.MosaicConfig(64, 2, 1, block_q=1), gpu_mosaic.MosaicConfig(64, 2, 1),
                  gpu_mosaic.MosaicConfig(128, 2, 1, compute_warpgroups=2),
                  gpu_mosaic.MosaicConfig(64, 3, 1, block_q=8, compute_warpgroups=2),
                  gpu_mosaic.MosaicConfig(64, 2, 1, transposed=True),
                  gpu_mosaic.MosaicConfig(64, 3, 3, block_q=1, transposed=True),
                  gpu_mosaic.MosaicConfig(128, 2, 2, block_q=1, transposed=True)]


def _on_hopper():
    import jax

    return jax.default_backend() == "gpu" and gpu_mosaic.on_hopper()


@pytest.mark.parametrize("config", MOSAIC_CONFIGS, ids=["table", "64x2_split3", "128x3", "block_q1",
                                                        "prefill_tile", "two_wg", "two_wg_64x3_bq8",
                                                        "transposed", "transposed_64x3_split3",
                                                        "transposed_128x2_split2"])
@pytest.mark.parametrize("name,q_lens,kv_lens,options", MOSAIC_CASES, ids=[c[0] for c in MOSAIC_CASES])
def test_mosaic_kernel(name, q_lens, kv_lens, options, config):
    import jax

    args = make_case(zlib.crc32(name.encode()), q_lens, kv_lens, group=4, head_dim=128, page_size=16,
                     dtype=jnp.bfloat16, pad_tokens=20 if name == "mixed" else 3)
    kw = dict(sm_scale=128**-0.5, **options)
    if not _on_hopper():
        if name.startswith("prefill") and config is not None:
            return  # lowering each config once (on the decode cases) is enough on CPU
        kernel = jax.jit(lambda *a: gpu_mosaic.ragged_attention_mosaic(*a, config=config, **kw))
        assert "mosaic_gpu" in kernel.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return
    fn = jax.jit(lambda *a: rpa.ragged_paged_attention(*a, impl="gpu", config=config, **kw))
    if config is None:  # what the table picks
        assert "mosaic_gpu" in fn.trace(*args).lower().as_text()
    assert_matches_reference(fn(*args), args, sum(q_lens), **kw)


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


@pytest.mark.parametrize("config", [None, gpu_mosaic.MosaicConfig(64, 2, 3), gpu_mosaic.MosaicConfig(128, 3, 1),
                                    gpu_mosaic.MosaicConfig(64, 2, 1),
                                    gpu_mosaic.MosaicConfig(64, 2, 1, transposed=True),
                                    gpu_mosaic.MosaicConfig(128, 2, 3, block_q=1, transposed=True)],
                         ids=["table", "64x2_split3", "128x3", "prefill_tile", "transposed", "transposed_128x2_split3"])
@pytest.mark.parametrize("name,q_lens,kv_lens,options", MOSAIC_CASES, ids=[c[0] for c in MOSAIC_CASES])
def test_mosaic_kernel_with_an_8bit_cache(name, q_lens, kv_lens, options, config):
    import jax

    args = make_case(zlib.crc32(name.encode()), q_lens, kv_lens, group=4, head_dim=128, page_size=16,
                     dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)
    kw = dict(sm_scale=128**-0.5, **options)
    if not _on_hopper():
        if not name.startswith("decode"):
            return  # lowering each config on the decode cases is enough on CPU
        kernel = jax.jit(lambda *a: gpu_mosaic.ragged_attention_mosaic(*a, config=config, **kw))
        assert "mosaic_gpu" in kernel.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return
    fn = jax.jit(lambda *a: rpa.ragged_paged_attention(*a, impl="gpu", config=config, **kw))
    if config is None:
        assert "mosaic_gpu" in fn.trace(*args).lower().as_text()
    assert_matches_reference(fn(*args), args, sum(q_lens), **kw)


def test_mosaic_kernel_with_an_8bit_cache_keeps_one_compute_warpgroup():
    assert gpu_mosaic.tuned_config(2048, 16, 8, 4096).compute_warpgroups == 2
    assert gpu_mosaic.tuned_config(2048, 16, 8, 4096, fp8_cache=True).compute_warpgroups == 1
    args = make_case(5, [40], [40], group=4, head_dim=128, page_size=16, dtype=jnp.bfloat16,
                     kv_dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="`config`"):
        gpu_mosaic.ragged_attention_mosaic(*args, sm_scale=0.1, config=gpu_mosaic.MosaicConfig(
            64, 2, 1, compute_warpgroups=2))
    # head_dim 64: 64-byte rows of an 8-bit tile; the Triton kernel takes those
    assert not gpu_mosaic.supports(jnp.bfloat16, 64, 4, 16, kv_dtype=jnp.float8_e4m3fn)
    assert gpu_mosaic.supports(jnp.bfloat16, 128, 4, 16, kv_dtype=jnp.float8_e4m3fn)
    assert not gpu_mosaic.supports(jnp.bfloat16, 128, 4, 16, kv_dtype=jnp.float16)


def test_mosaic_kernel_lowers_for_groups_of_eight():
    import jax

    args = make_case(3, [1, 9], [40, 9], group=8, head_dim=64, page_size=16, dtype=jnp.bfloat16)
    kernel = jax.jit(lambda *a: gpu_mosaic.ragged_attention_mosaic(*a, sm_scale=0.125, sliding_window=5))
    assert "mosaic_gpu" in kernel.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("group,head_dim,kv_dtype,block_q", [
    (8, 64, None, 1), (12, 128, None, 1), (16, 256, None, 1), (8, 128, jnp.float8_e5m2, 1),
    (12, 128, jnp.float8_e4m3fn, None), (4, 256, None, None)])
def test_transposed_kernel_lowers_for_other_groups_and_head_sizes(group, head_dim, kv_dtype, block_q):
    """Groups that fill the 8 columns (8), need padding (12) or more columns (16); block_q None: the mixed
    launch. (The GPU tests run group 4, head_dim 128.)"""
    import jax

    args = make_case(5, [1, 1, 6], [40, 130, 6], group=group, head_dim=head_dim, page_size=16, dtype=jnp.bfloat16,
                     kv_dtype=kv_dtype)
    config = gpu_mosaic.MosaicConfig(64, 2, 1, block_q=block_q, transposed=True)
    kernel = jax.jit(lambda *a: gpu_mosaic.ragged_attention_mosaic(*a, sm_scale=0.1, soft_cap=20.0, config=config))
    assert "mosaic_gpu" in kernel.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_table_picks_the_mosaic_kernel_on_hopper_where_it_supports_the_shapes(monkeypatch):
    monkeypatch.setattr(gpu_mosaic, "on_hopper", lambda: True)
    decode = make_case(1, [1, 1, 1], [20, 5, 40], group=4, head_dim=128, page_size=16, dtype=jnp.bfloat16)
    mixed = make_case(1, [1, 20, 1], [20, 20, 40], group=4, head_dim=128, page_size=16, dtype=jnp.bfloat16,
                      pad_tokens=20)
    f32 = make_case(1, [1, 1], [20, 5], group=4, head_dim=128, page_size=16, dtype=jnp.float32)
    gqa2 = make_case(1, [1, 1], [20, 5], group=2, head_dim=128, page_size=16, dtype=jnp.bfloat16)

    def picks(args, config=None, interpret=False):
        return rpa._mosaic(args[0], args[1], config, interpret)

    assert picks(decode) and picks(mixed) and not picks(decode, interpret=True)
    assert not picks(decode, config=CONFIGS["gpu"]) and picks(f32, config=gpu_mosaic.MosaicConfig())
    assert not picks(f32) and not picks(gqa2)  # f32, or a group that is not a multiple of 4: Triton
    monkeypatch.setattr(gpu_mosaic, "on_hopper", lambda: False)
    assert not picks(decode)


@pytest.mark.parametrize("fields", [dict(block_kv=0), dict(num_stages=-1), dict(num_kv_splits=1.5),
                                    dict(num_stages=True), dict(block_q=0)])
def test_mosaic_config_fields_must_be_positive_ints(fields):
    with pytest.raises(ValueError, match=f"`{next(iter(fields))}` must be a positive int"):
        gpu_mosaic.MosaicConfig(**fields)


def test_mosaic_config_warpgroups():
    with pytest.raises(ValueError, match="`compute_warpgroups` must be 1 or 2"):
        gpu_mosaic.MosaicConfig(compute_warpgroups=3)
    with pytest.raises(ValueError, match="`num_kv_splits` must be 1 with two compute warpgroups"):
        gpu_mosaic.MosaicConfig(num_kv_splits=2, compute_warpgroups=2)
    with pytest.raises(ValueError, match="`num_stages` must be at least 2 with two compute warpgroups"):
        gpu_mosaic.MosaicConfig(num_stages=1, compute_warpgroups=2)
    args = make_case(1, [1, 5], [20, 5], group=4, head_dim=256, page_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="`config` .* <= 128 with two compute warpgroups"):
        config = gpu_mosaic.MosaicConfig(compute_warpgroups=2)
        rpa.ragged_paged_attention(*args, sm_scale=0.1, impl="gpu", config=config)
    # The table: decode buckets one warpgroup with one-token blocks, transposed; prompt-heavy buckets two
    # compute warpgroups where head_dim allows; the others one (an 8-bit cache's decode tokens transposed).
    decode = gpu_mosaic.tuned_config(64, 64, 8, 1024)
    assert (decode.compute_warpgroups, decode.block_q, decode.transposed) == (1, 1, True)
    mixed = gpu_mosaic.tuned_config(2048, 256, 8, 1024)
    assert (mixed.compute_warpgroups, mixed.block_q, mixed.transposed) == (1, None, False)
    mixed = gpu_mosaic.tuned_config(2048, 256, 8, 1024, fp8_cache=True)
    assert (mixed.compute_warpgroups, mixed.block_q, mixed.transposed) == (1, None, True)
    assert not gpu_mosaic.tuned_config(2048, 64, 8, 1024).transposed
    assert gpu_mosaic.tuned_config(2048, 64, 8, 1024).compute_warpgroups == 2
    assert gpu_mosaic.tuned_config(2048, 256, 8, 1024).compute_warpgroups == 1  # room for many decode rows
    assert gpu_mosaic.tuned_config(2048, 64, 8, 1024, head_dim=256).compute_warpgroups == 1


@pytest.mark.parametrize("value", ["", 3, b"dir"])
def test_mosaic_config_profile_dir_must_be_a_path(value):
    with pytest.raises(ValueError, match="`profile_dir`"):
        gpu_mosaic.MosaicConfig(profile_dir=value)


def test_mosaic_profiler_traces_the_decode_kernel_regions(tmp_path):
    """`profile_dir` sizes the on-device profiler's buffer for the longest program; on a Hopper GPU the
    decode kernel then writes a trace with every named region (read by benchmarks/kernels.py) and
    still matches the reference."""
    params = gpu_mosaic._profiler_params(gpu_mosaic.MosaicConfig(profile_dir="d"), max_kv_len=640)
    assert params["profile_space"] >= gpu_mosaic.PROFILED_REGIONS_PER_BLOCK * 10 + 2 and params["profile_bounds_check"]
    assert gpu_mosaic._profiler_params(gpu_mosaic.MosaicConfig(), max_kv_len=640) == {}
    if not _on_hopper():
        return  # the trace is written by a host callback, which lowers only for the platform it runs on
    import glob
    import json

    import jax

    args = make_case(3, [1, 1, 1], [40, 300, 17], group=4, head_dim=128, page_size=16, dtype=jnp.bfloat16,
                     kv_dtype=jnp.float8_e4m3fn)
    config = gpu_mosaic.MosaicConfig(64, 2, 1, block_q=1, transposed=True, profile_dir=str(tmp_path))
    out = jax.jit(lambda *a: rpa.ragged_paged_attention(*a, sm_scale=0.1, impl="gpu", config=config))(*args)
    jax.effects_barrier()
    assert_matches_reference(out, args, 3, sm_scale=0.1)
    (trace,) = glob.glob(str(tmp_path / "*-trace.json"))
    names = {e["name"] for e in json.load(open(trace))["traceEvents"]}
    assert {"prologue", "wait", "convert", "qk", "max", "exp", "p_store", "pv", "refill", "epilogue"} <= names


@pytest.mark.parametrize("fields", [dict(compute_warpgroups=2), dict(transposed=1)])
def test_mosaic_config_transposed_needs_one_warpgroup(fields):
    with pytest.raises(ValueError, match="`transposed`"):
        gpu_mosaic.MosaicConfig(**{"transposed": True, **fields})


def test_mosaic_transposed_key_splits_need_one_token_blocks():
    args = make_case(1, [1, 5], [20, 5], group=4, head_dim=128, page_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="`config` .* splits keys"):
        gpu_mosaic.ragged_attention_mosaic(*args, sm_scale=0.1, config=gpu_mosaic.MosaicConfig(
            64, 2, 2, transposed=True))


def test_mosaic_config_on_unsupported_shapes_names_config():
    args = make_case(1, [1, 1], [20, 5], group=2, head_dim=64, page_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="`config` .* group 2"):
        rpa.ragged_paged_attention(*args, sm_scale=0.125, impl="gpu", config=gpu_mosaic.MosaicConfig())


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
    seq, start, end = (np.asarray(x) for x in gpu.work_items(cu, jnp.asarray([3], jnp.int32), 9, block_q=4))
    covered = np.zeros(9, int)
    for s_, a, b in zip(seq, start, end):
        covered[a:b] += 1
        assert s_ == -1 or (cu[s_] <= a and b <= cu[s_ + 1])
    np.testing.assert_array_equal(covered, 1)
    assert set(seq[(start < end)].tolist()) == {0, 2, -1}  # the idle slot 1 gets no block


def test_gpu_mixed_launches_split_short_and_long_sequences():
    cu, n = jnp.asarray([0, 1, 9, 10, 10], jnp.int32), jnp.asarray([3], jnp.int32)
    short = gpu.work_items(cu, n, 12, 4, select="short", short_len=4, num_items=4)
    long = gpu.work_items(cu, n, 12, 4, select="long", short_len=4)
    short_rows = {(int(a), int(b), int(s_)) for s_, a, b in zip(*(np.asarray(x) for x in short)) if a < b}
    assert short_rows == {(0, 1, 0), (9, 10, 2)}
    long_rows = {(int(a), int(b), int(s_)) for s_, a, b in zip(*(np.asarray(x) for x in long)) if a < b}
    assert long_rows == {(1, 5, 1), (5, 9, 1), (10, 12, -1)}


@pytest.mark.parametrize("seed", range(6))
def test_mosaic_mixed_items_cover_every_token_once_with_decodes_last(seed):
    rng = np.random.default_rng(seed)
    slots = int(rng.integers(1, 9))
    q_lens = [int(x) for x in rng.choice([0, 1, 1, 2, 5, 17, 40], size=slots)]
    n = int(rng.integers(0, slots + 1))  # rows past num_seqs are unused
    cu = np.concatenate([[0], np.cumsum([q if i < n else 0 for i, q in enumerate(q_lens)])]).astype(np.int32)
    num_tokens = int(cu[-1]) + int(rng.integers(0, 5))  # padding tokens after the real ones
    (seq, start, end), num_long = gpu_mosaic.mixed_items(jnp.asarray(cu), jnp.asarray([n], jnp.int32),
                                                         max(num_tokens, 1), 16)
    seq, start, end = (np.asarray(x) for x in (seq, start, end))
    covered = np.zeros(max(num_tokens, 1), int)
    for i, (s_, a, b) in enumerate(zip(seq, start, end)):
        covered[a:b] += 1
        if a < b and s_ >= 0:
            assert cu[s_] <= a and b <= cu[s_ + 1] and b - a <= 16
            one_token = cu[s_ + 1] - cu[s_] == 1
            assert one_token == (i >= num_long)  # decodes come after every query block
    np.testing.assert_array_equal(covered[:num_tokens], 1)


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
])
def test_invalid_inputs_raise_value_error_naming_the_argument(arg, change):
    args, kw = _bad(**change)
    with pytest.raises(ValueError, match=f"`{arg}`"):
        rpa.ragged_paged_attention(**args, **kw)


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
