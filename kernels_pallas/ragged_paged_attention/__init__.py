"""Ragged paged attention: one op for decode, prefill and mixed batches."""

from .reference import kv_cache_shape, ragged_paged_attention, write_kv

__all__ = ["kv_cache_shape", "ragged_paged_attention", "write_kv"]
