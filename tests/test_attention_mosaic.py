"""The Hopper Mosaic GPU ragged paged attention kernel (`gpu_mosaic.py`): its layouts and configs held to
the reference on a Hopper GPU, lowered for CUDA elsewhere (GPU interpret mode cannot run wgmma); its
config table, config validation, work items and in-kernel profiler. Cases are built as in
test_attention_kernels.py (NaN-poisoned caches and padding).
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_kernels import CONFIGS, assert_matches_reference, make_case

from jengine.kernels_pallas import ragged_paged_attention as rpa
from jengine.kernels_pallas.ragged_paged_attention import gpu_mosaic, reference

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


@pytest.mark.parametrize("config", [None, gpu_mosaic.MosaicConfig(64, 2, 1, transposed=True),
                                    gpu_mosaic.MosaicConfig(128, 2, 3, block_q=1, transposed=True)],
                         ids=["table", "transposed", "transposed_128x2_split3"])
@pytest.mark.parametrize("name,q_lens,kv_lens,options", MOSAIC_CASES, ids=[c[0] for c in MOSAIC_CASES])
def test_mosaic_kernel_takes_f16_queries_for_an_8bit_cache(name, q_lens, kv_lens, options, config):
    """Q in float16 (what `attention_q_dtype` asks the RoPE kernel for) and a bf16 result (`out_dtype`): the launch
    takes that Q as it is and writes bf16, with the same bits as from bf16 Q, which it converts itself."""
    import jax

    args = make_case(zlib.crc32(name.encode()), q_lens, kv_lens, group=4, head_dim=128, page_size=16,
                     dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)
    q16 = reference.saturate(args[0], jnp.float16)
    kw = dict(sm_scale=128**-0.5, **options)
    if not _on_hopper():
        if not name.startswith("decode"):
            return
        kernel = jax.jit(lambda *a: gpu_mosaic.ragged_attention_mosaic(*a, config=config, out_dtype=jnp.bfloat16,
                                                                       **kw))
        text = kernel.trace(q16, *args[1:]).lower(lowering_platforms=("cuda",)).as_text()
        assert "convert" not in text.split("custom_call @mosaic_gpu")[0]  # Q goes in as it is
        return
    fn = jax.jit(lambda *a, out_dtype=None: rpa.ragged_paged_attention(*a, impl="gpu", config=config,
                                                                      out_dtype=out_dtype, **kw),
                 static_argnames="out_dtype")
    out16, out = fn(q16, *args[1:], out_dtype=jnp.bfloat16), fn(*args)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out16.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)))


def test_attention_q_dtype_is_float16_where_the_hopper_kernel_multiplies_an_8bit_cache_in_f16(monkeypatch):
    fp8 = jnp.zeros(rpa.kv_cache_shape(4, 16, 2, 128), jnp.float8_e4m3fn)
    assert rpa.attention_q_dtype(jnp.bfloat16, fp8, 8, impl="reference") == jnp.bfloat16
    monkeypatch.setattr(gpu_mosaic, "on_hopper", lambda: True)
    assert rpa.attention_q_dtype(jnp.bfloat16, fp8, 8, impl="gpu") == jnp.float16
    assert rpa.attention_q_dtype(jnp.bfloat16, fp8.astype(jnp.bfloat16), 8, impl="gpu") == jnp.bfloat16
    assert rpa.attention_q_dtype(jnp.bfloat16, fp8, 4, impl="gpu") == jnp.bfloat16  # group 2: the Triton kernel
    assert rpa.attention_q_dtype(jnp.float32, fp8, 8, impl="gpu") == jnp.float32
    monkeypatch.setattr(gpu_mosaic, "on_hopper", lambda: False)
    assert rpa.attention_q_dtype(jnp.bfloat16, fp8, 8, impl="gpu") == jnp.bfloat16


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


def test_mixed_launch_with_an_8bit_cache_reads_q_once_converted_to_f16():
    """The query blocks take the transposed items' f16 Q (no second, bf16 copy of Q for the launch), so XLA
    converts Q in the fusion that makes it; the result stays in Q's dtype."""
    import jax

    args = make_case(5, [1, 1, 6], [40, 130, 6], group=4, head_dim=128, page_size=16, dtype=jnp.bfloat16,
                     kv_dtype=jnp.float8_e4m3fn)
    config = gpu_mosaic.MosaicConfig(64, 2, 1, transposed=True)
    kernel = jax.jit(lambda *a: gpu_mosaic.ragged_attention_mosaic(*a, sm_scale=0.1, config=config))
    text = kernel.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    operands, result = call.rsplit("->", 1)
    assert operands.count("x128xf16>") == 2 and "bf16" not in operands.rsplit(":", 1)[-1]
    assert result.strip().endswith("x128xbf16>")


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
