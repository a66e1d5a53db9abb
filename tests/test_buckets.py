"""Bucket helpers: default T and S lists, picking a bucket, padding waste, compile shapes."""

import pytest

from jengine.buckets import (
    default_seq_buckets,
    default_token_buckets,
    make_buckets,
    max_padding_waste,
    normalize_buckets,
    padding_waste,
    pick_bucket,
    seq_bucket,
    shape_pairs,
)
from jengine.kernels_pallas.ragged_paged_attention.blocks import is_decode_bucket


def test_token_buckets_double_from_8_add_half_steps_from_256_and_end_at_the_budget():
    assert default_token_buckets(512) == (8, 16, 32, 64, 128, 256, 384, 512)
    assert default_token_buckets(600) == (8, 16, 32, 64, 128, 256, 384, 512, 600)
    assert default_token_buckets(2048) == (8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    assert default_token_buckets(128) == (8, 16, 32, 64, 128)
    assert default_token_buckets(2048, linear_step=512) == (8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048)
    assert default_token_buckets(8) == (8,)


def test_seq_buckets_double_from_8_and_end_at_max_num_seqs_or_8():
    assert default_seq_buckets(256) == (8, 16, 32, 64, 128, 256)
    assert default_seq_buckets(48) == (8, 16, 32, 48)
    assert default_seq_buckets(1) == (8,)  # an 8-token step stays decode-shaped
    assert default_seq_buckets(5) == (8,)


def test_linear_step_switches_from_doubling_to_fixed_increments():
    assert make_buckets(2048, 16, linear_step=512) == (16, 32, 64, 128, 256, 512, 1024, 1536, 2048)


def test_pick_bucket_returns_smallest_bucket_that_holds_n():
    buckets = (16, 32, 64)
    assert [pick_bucket(n, buckets) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]
    with pytest.raises(ValueError, match="exceeds the largest bucket 64"):
        pick_bucket(65, buckets)


def test_padding_waste_is_the_padded_fraction():
    assert padding_waste(24, (16, 32)) == 0.25
    assert padding_waste(32, (16, 32)) == 0.0
    assert max_padding_waste((16, 32, 64)) == pytest.approx(15 / 16)  # n=1 padded to 16
    assert max_padding_waste((1, 2, 4, 8)) == pytest.approx(3 / 8)  # n=5 padded to 8


def test_normalize_buckets_sorts_dedups_and_appends_the_cap():
    assert normalize_buckets([64, 16, 16, 32], cap=128) == (16, 32, 64, 128)
    assert normalize_buckets([8, 4], cap=8) == (4, 8)
    with pytest.raises(ValueError, match="exceeds the cap"):
        normalize_buckets([256], cap=128)
    with pytest.raises(ValueError, match="positive integers"):
        normalize_buckets([0, 8])
    with pytest.raises(ValueError, match="empty"):
        normalize_buckets([])


def test_shape_pairs_never_pad_sequences_past_the_token_bucket():
    assert shape_pairs((16, 32, 64), (8, 16, 32)) == [
        (16, 8), (16, 16), (32, 8), (32, 16), (32, 32), (64, 16), (64, 32),
    ]


def test_large_token_buckets_pad_sequence_rows_to_a_quarter_of_their_tokens():
    # T = 64 -> at least 16 rows; T = 256 -> at least 64; T = 2048 -> the largest sequence bucket only.
    assert shape_pairs((64, 256, 2048), (8, 16, 32, 64, 256)) == [
        (64, 16), (64, 32), (64, 64), (256, 64), (256, 256), (2048, 256),
    ]
    assert seq_bucket(1, 256, (8, 16, 32, 64, 256)) == 64
    assert seq_bucket(70, 256, (8, 16, 32, 64, 256)) == 256
    assert seq_bucket(1, 16, (1, 8, 64)) == 8
    assert seq_bucket(1, 8, (1, 8, 64)) == 8
    assert seq_bucket(1, 4, (1, 8, 64)) == 1
    # every step's (T, S) is one of the compiled pairs
    tokens, seqs = (16, 32, 64, 128, 256), (1, 8, 64)
    pairs = set(shape_pairs(tokens, seqs))
    for n_tokens in range(1, 257):
        t = pick_bucket(n_tokens, tokens)
        for n_seqs in range(1, min(n_tokens, 64) + 1):
            assert (t, seq_bucket(n_seqs, t, seqs)) in pairs


def test_bad_bucket_parameters_are_rejected():
    with pytest.raises(ValueError, match="cap"):
        make_buckets(0)
    with pytest.raises(ValueError, match="linear_step"):
        make_buckets(64, linear_step=0)


def test_a_one_sequence_engine_steps_in_decode_shaped_buckets():
    """With max_num_seqs=1 the 8-token decode step must still be decode-shaped (T <= 2 S), so attention runs
    its decode kernel (H200: 4.9 µs a layer against 8.8 in the query-block kernel, RESULTS.md session 43)."""
    for tokens in default_token_buckets(64)[:2]:
        assert is_decode_bucket(tokens, seq_bucket(1, tokens, default_seq_buckets(1)))
