"""The pure-jnp reference of ragged paged attention, checked on tiny cases worked out by hand."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jengine.kernels_pallas.ragged_paged_attention import reference as ref


def _cache_from_tokens(k_tokens, v_tokens, pages, page_size):
    """Build a [2, Hkv, num_pages, page_size, D] cache holding tokens 0.. of one sequence in `pages`."""
    k_tokens = np.asarray(k_tokens, np.float32)  # [L, Hkv, D]
    v_tokens = np.asarray(v_tokens, np.float32)
    length, hkv, d = k_tokens.shape
    cache = np.full(ref.kv_cache_shape(max(pages) + 2, page_size, hkv, d), np.nan, np.float32)
    for t in range(length):
        page, off = pages[t // page_size], t % page_size
        cache[0, :, page, off] = k_tokens[t]
        cache[1, :, page, off] = v_tokens[t]
    return jnp.asarray(cache)


def _run(q, cache, kv_lens, pages, cu_q_lens, num_seqs, **kw):
    return np.asarray(
        ref.ragged_paged_attention(
            jnp.asarray(q, jnp.float32),
            cache,
            jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(pages, jnp.int32),
            jnp.asarray(cu_q_lens, jnp.int32),
            jnp.asarray([num_seqs], jnp.int32),
            sm_scale=kw.pop("sm_scale", 1.0),
            **kw,
        )
    )


def test_single_decode_token_weights_keys_by_softmax_of_dot_products():
    # logits [0, ln 3] -> weights [1/4, 3/4] -> 0.25 * 4 + 0.75 * 8 = 7
    cache = _cache_from_tokens([[[0.0]], [[math.log(3.0)]]], [[[4.0]], [[8.0]]], pages=[1], page_size=2)
    out = _run([[[1.0]]], cache, kv_lens=[2], pages=[[1]], cu_q_lens=[0, 1], num_seqs=1)
    np.testing.assert_allclose(out, [[[7.0]]], rtol=1e-6)


def test_sm_scale_multiplies_logits():
    # q.k = [0, 2 ln 3] scaled by 1/2 -> [0, ln 3] -> 7 as above
    cache = _cache_from_tokens([[[0.0]], [[2 * math.log(3.0)]]], [[[4.0]], [[8.0]]], pages=[0], page_size=2)
    out = _run([[[1.0]]], cache, kv_lens=[2], pages=[[0]], cu_q_lens=[0, 1], num_seqs=1, sm_scale=0.5)
    np.testing.assert_allclose(out, [[[7.0]]], rtol=1e-6)


def test_prefill_is_causal_within_the_sequence():
    # two new tokens, both keys equal: token 0 sees only key 0, token 1 averages both.
    cache = _cache_from_tokens([[[1.0]], [[1.0]]], [[[2.0]], [[6.0]]], pages=[0], page_size=4)
    out = _run([[[1.0]], [[1.0]]], cache, kv_lens=[2], pages=[[0]], cu_q_lens=[0, 2], num_seqs=1)
    np.testing.assert_allclose(out[:, 0, 0], [2.0, 4.0], rtol=1e-6)


def test_chunked_prefill_queries_sit_at_the_end_of_the_kv():
    # kv_len 3, one query: it is at position 2 and sees all three keys (equal logits -> mean of v).
    cache = _cache_from_tokens([[[0.0]]] * 3, [[[1.0]], [[2.0]], [[6.0]]], pages=[2, 0], page_size=2)
    out = _run([[[5.0]]], cache, kv_lens=[3], pages=[[2, 0]], cu_q_lens=[0, 1], num_seqs=1)
    np.testing.assert_allclose(out, [[[3.0]]], rtol=1e-6)


def test_pages_are_read_through_the_page_table():
    # tokens 0-1 in page 3, token 2 in page 1; equal logits -> mean of v = (1 + 2 + 9) / 3 = 4
    cache = _cache_from_tokens([[[0.0]]] * 3, [[[1.0]], [[2.0]], [[9.0]]], pages=[3, 1], page_size=2)
    out = _run([[[1.0]]], cache, kv_lens=[3], pages=[[3, 1]], cu_q_lens=[0, 1], num_seqs=1)
    np.testing.assert_allclose(out, [[[4.0]]], rtol=1e-6)


def test_two_sequences_do_not_see_each_other():
    k = [[[0.0]], [[0.0]]]
    cache = np.array(_cache_from_tokens(k, [[[1.0]], [[3.0]]], pages=[0], page_size=2))
    cache[1, 0, 1, :2, 0] = [10.0, 20.0]  # second sequence lives in page 1
    cache[0, 0, 1, :2, 0] = [0.0, 0.0]
    out = _run([[[1.0]], [[1.0]]], jnp.asarray(cache), kv_lens=[2, 2], pages=[[0], [1]], cu_q_lens=[0, 1, 2],
               num_seqs=2)
    np.testing.assert_allclose(out[:, 0, 0], [2.0, 15.0], rtol=1e-6)


def test_padding_tokens_and_padding_sequences_give_zeros():
    cache = _cache_from_tokens([[[0.0]]], [[[5.0]]], pages=[0], page_size=2)
    out = _run([[[1.0]], [[1.0]], [[1.0]]], cache, kv_lens=[1, 7], pages=[[0], [0]], cu_q_lens=[0, 1, 1],
               num_seqs=1)
    np.testing.assert_allclose(out[:, 0, 0], [5.0, 0.0, 0.0])


def test_sliding_window_limits_how_far_back_a_query_sees():
    # window 2: the query at position 2 sees keys 1 and 2 only -> (2 + 6) / 2
    cache = _cache_from_tokens([[[0.0]]] * 3, [[[100.0]], [[2.0]], [[6.0]]], pages=[0], page_size=4)
    out = _run([[[1.0]]], cache, kv_lens=[3], pages=[[0]], cu_q_lens=[0, 1], num_seqs=1, sliding_window=2)
    np.testing.assert_allclose(out, [[[4.0]]], rtol=1e-6)


def test_soft_cap_squashes_logits_with_tanh():
    # logits [0, 100] capped at 1 -> [0, tanh(100) ~ 1] -> weights [1, e] / (1 + e)
    cache = _cache_from_tokens([[[0.0]], [[100.0]]], [[[0.0]], [[1.0]]], pages=[0], page_size=2)
    out = _run([[[1.0]]], cache, kv_lens=[2], pages=[[0]], cu_q_lens=[0, 1], num_seqs=1, soft_cap=1.0)
    np.testing.assert_allclose(out, [[[math.e / (1 + math.e)]]], rtol=1e-6)


def test_grouped_query_heads_share_one_kv_head():
    # 2 query heads over 1 kv head: head 0 prefers key 0, head 1 key 1 (logits +-ln 3).
    cache = _cache_from_tokens([[[0.0]], [[math.log(3.0)]]], [[[4.0]], [[8.0]]], pages=[0], page_size=2)
    out = _run([[[1.0], [-1.0]]], cache, kv_lens=[2], pages=[[0]], cu_q_lens=[0, 1], num_seqs=1)
    np.testing.assert_allclose(out[0, :, 0], [7.0, 5.0], rtol=1e-6)


def test_write_kv_scatters_into_page_slots_and_skips_padding():
    cache = jnp.zeros(ref.kv_cache_shape(num_pages=3, page_size=2, num_kv_heads=1, head_dim=1))
    k = jnp.asarray([[[1.0]], [[2.0]], [[3.0]]])
    v = -k
    out = np.asarray(ref.write_kv(cache, k, v, jnp.asarray([5, 0, -1], jnp.int32)))
    assert out[0, 0, 2, 1, 0] == 1.0 and out[1, 0, 2, 1, 0] == -1.0  # slot 5 = page 2, offset 1
    assert out[0, 0, 0, 0, 0] == 2.0 and out[1, 0, 0, 0, 0] == -2.0  # slot 0
    assert np.count_nonzero(out) == 4  # the padding token (slot -1) wrote nothing


@pytest.mark.parametrize("num_pages,page_size,hkv,d", [(7, 16, 2, 64), (1, 32, 8, 128)])
def test_kv_cache_shape_is_kv_heads_pages_slots_dim(num_pages, page_size, hkv, d):
    assert ref.kv_cache_shape(num_pages, page_size, hkv, d) == (2, hkv, num_pages, page_size, d)
