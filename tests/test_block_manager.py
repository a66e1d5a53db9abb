"""BlockManager: allocation, prefix caching with LRU eviction, copy-on-write forks, host swap."""

import pytest

from jengine.block_manager import NULL_BLOCK_ID, BlockManager
from jengine.request import Request

BS = 4  # tokens per page in every test here


def req(rid, tokens):
    return Request(rid, tokens)


def computed(bm, r, num_tokens=None):
    """Pretend a step computed the request's tokens up to num_tokens (default: all)."""
    r.num_computed_tokens = r.num_tokens if num_tokens is None else num_tokens
    bm.cache_full_blocks(r, r.num_computed_tokens)


def assert_all_free(bm):
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
    assert bm.usage == 0.0


def test_allocate_hands_out_pages_in_order_and_never_the_null_page():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", range(6))
    assert bm.can_allocate(a, 6)
    assert bm.allocate(a, 6) == [1, 2]
    assert NULL_BLOCK_ID not in bm.block_table(a)
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(2 / 7)
    bm.free(a)
    assert_all_free(bm)


def test_without_null_page_block_zero_is_usable():
    bm = BlockManager(num_blocks=2, block_size=BS, reserve_null_block=False)
    assert bm.allocate(req("a", range(8)), 8) == [0, 1]
    assert bm.num_free_blocks == 0


def test_can_allocate_refuses_when_pool_is_short():
    bm = BlockManager(num_blocks=3, block_size=BS)  # 2 usable pages
    assert bm.can_allocate(req("a", range(8)), 8)
    assert not bm.can_allocate(req("b", range(9)), 9)


def test_append_slots_adds_a_page_only_when_crossing_a_page_boundary():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", range(4))
    bm.allocate(a, 4)
    computed(bm, a)
    a.append_output_token(7)  # position 4 starts the second page
    assert bm.append_slots(a, 1) == []
    assert bm.block_table(a) == [1, 2]
    computed(bm, a)
    a.append_output_token(8)  # position 5 fits in page 2
    bm.append_slots(a, 1)
    assert bm.block_table(a) == [1, 2]
    bm.free(a)
    assert_all_free(bm)


def test_prefix_hit_returns_cached_full_blocks_of_shared_prompt():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(10)))
    bm.allocate(a, 10)
    computed(bm, a)
    assert bm.num_cached_blocks == 2  # the partial third page is not cacheable
    b = req("b", list(range(8)) + [50, 51, 52])
    blocks, num_hit = bm.get_computed_blocks(b)
    assert (blocks, num_hit) == ([1, 2], 8)
    bm.allocate(b, 3, blocks)
    assert bm.block_table(b) == [1, 2, 4]
    assert bm.prefix_cache_queries == 10 + 11
    assert bm.prefix_cache_hits == 8
    bm.free(a)
    bm.free(b)
    assert_all_free(bm)


def test_prefix_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", range(8))
    bm.allocate(a, 8)
    computed(bm, a)
    assert bm.get_computed_blocks(req("b", range(8))) == ([1], 4)
    assert bm.get_computed_blocks(req("c", range(9))) == ([1, 2], 8)


def test_same_block_after_a_different_prefix_is_not_a_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", [0, 1, 2, 3, 4, 5, 6, 7, 9])
    bm.allocate(a, 9)
    computed(bm, a)
    other = req("b", [9, 9, 9, 9, 4, 5, 6, 7, 9])  # second block equal, first differs
    assert bm.get_computed_blocks(other) == ([], 0)


def test_only_blocks_full_of_written_tokens_are_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", range(12))
    bm.allocate(a, 12)
    computed(bm, a, 5)  # only the first page is fully written
    assert bm.get_computed_blocks(req("b", range(12))) == ([1], 4)


def test_released_cached_pages_stay_reusable_and_count_as_free():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", range(9))
    bm.allocate(a, 9)
    computed(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 7 and bm.num_cached_blocks == 2
    b = req("b", range(9))
    blocks, num_hit = bm.get_computed_blocks(b)
    assert (blocks, num_hit) == ([1, 2], 8)
    assert bm.can_allocate(b, 1, blocks)
    bm.allocate(b, 1, blocks)
    assert bm.num_free_blocks == 4  # 2 reclaimed from the cache + 1 fresh
    bm.free(b)
    assert_all_free(bm)


def test_eviction_takes_never_cached_pages_first_then_least_recently_used_tail_first():
    bm = BlockManager(num_blocks=5, block_size=BS)  # pages 1..4
    a = req("a", range(9))  # pages [1, 2, 3]; 1 and 2 get cached
    bm.allocate(a, 9)
    computed(bm, a)
    bm.free(a)  # page 3 -> plain free list; pages 2 then 1 -> LRU list
    c = req("c", range(100, 111))  # needs 3 pages: 4, 3, then evicts 2 (A's tail)
    bm.allocate(c, 11)
    assert bm.block_table(c) == [4, 3, 2]
    assert bm.num_evictions == 1
    assert bm.get_computed_blocks(req("a2", range(9))) == ([1], 4)
    bm.free(c)
    assert_all_free(bm)


def test_lru_evicts_the_prefix_released_longest_ago():
    bm = BlockManager(num_blocks=3, block_size=BS)  # pages 1, 2
    a, b = req("a", range(5)), req("b", range(10, 14))
    bm.allocate(a, 5)
    computed(bm, a)
    bm.free(a)  # page 1 cached, page 2 free
    bm.allocate(b, 4)  # takes page 2
    computed(bm, b)
    bm.free(b)  # page 2 cached, released after page 1
    bm.allocate(req("c", range(20, 24)), 4)
    assert bm.get_computed_blocks(req("a2", range(5))) == ([], 0)  # A's page was evicted
    assert bm.get_computed_blocks(req("b2", range(10, 15))) == ([2], 4)


def test_idle_cached_hits_count_against_free_pages():
    bm = BlockManager(num_blocks=3, block_size=BS)  # pages 1, 2
    a = req("a", range(5))
    bm.allocate(a, 5)
    computed(bm, a)
    bm.free(a)
    b = req("b", range(9))
    blocks, _ = bm.get_computed_blocks(b)
    assert blocks == [1]
    assert bm.can_allocate(b, 4, blocks)  # 1 cached + 1 fresh = 2 pages
    assert not bm.can_allocate(b, 5, blocks)  # would need 3


def test_duplicate_block_computed_twice_is_not_cached_twice():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = req("a", range(5)), req("b", range(5))
    bm.allocate(a, 5)
    bm.allocate(b, 5)  # both scheduled before either finished: no hit possible
    computed(bm, a)
    computed(bm, b)
    assert bm.num_cached_blocks == 1
    bm.free(a)
    bm.free(b)
    assert_all_free(bm)


def test_fork_shares_pages_and_copies_the_partial_last_page_on_write():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = req("p", range(6))
    bm.allocate(parent, 6)
    computed(bm, parent)
    parent.append_output_token(40)
    child = req("c", range(6))
    child.append_output_token(40)
    child.num_computed_tokens = 6
    assert bm.fork(parent, child) == [1, 2]
    assert bm.num_free_blocks == 5
    assert bm.can_append_slots(child, 1)
    assert bm.append_slots(child, 1) == [(2, 3)]  # page 2 holds positions 4, 5: copy them
    assert bm.block_table(child) == [1, 3]
    assert bm.append_slots(parent, 1) == []  # page 2 is the parent's alone now
    assert bm.block_table(parent) == [1, 2]
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    assert_all_free(bm)


def test_fork_at_a_page_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = req("p", range(8))
    bm.allocate(parent, 8)
    computed(bm, parent)
    child = req("c", range(8))
    child.num_computed_tokens = 8
    bm.fork(parent, child)
    for r in (parent, child):
        r.append_output_token(1)
    assert bm.append_slots(child, 1) == []
    assert bm.append_slots(parent, 1) == []
    assert bm.block_table(child) == [1, 2, 3]
    assert bm.block_table(parent) == [1, 2, 4]
    bm.free(child)
    bm.free(parent)
    assert_all_free(bm)


def test_swap_out_and_in_round_trip_returns_page_mappings():
    bm = BlockManager(num_blocks=5, block_size=BS, num_cpu_blocks=3, enable_prefix_caching=False)
    a = req("a", range(10))
    bm.allocate(a, 10)
    computed(bm, a)
    assert bm.can_swap_out(a)
    assert bm.swap_out(a) == [(1, 0), (2, 1), (3, 2)]
    assert not bm.has_blocks(a) and bm.is_swapped(a)
    assert bm.num_free_blocks == 4 and bm.num_free_cpu_blocks == 0
    squatter = req("s", range(3))
    bm.allocate(squatter, 3)  # pages were released tail first: free list is 4, 3, 2, 1
    a.append_output_token(5)
    assert bm.can_swap_in(a, 1)
    assert bm.swap_in(a) == [(0, 3), (1, 2), (2, 1)]
    assert bm.block_table(a) == [3, 2, 1]
    assert bm.num_free_cpu_blocks == 3
    assert bm.can_append_slots(a, 2)  # positions 10, 11 fit the last page
    assert not bm.can_append_slots(a, 3)  # position 12 needs a fourth page: none left
    bm.free(a)
    bm.free(squatter)
    assert_all_free(bm)


def test_swap_needs_room_on_both_sides():
    bm = BlockManager(num_blocks=4, block_size=BS, num_cpu_blocks=1)
    a = req("a", range(8))
    bm.allocate(a, 8)
    assert not bm.can_swap_out(a)  # 2 pages, 1 host page
    bm2 = BlockManager(num_blocks=4, block_size=BS, num_cpu_blocks=2)
    b = req("b", range(8))
    bm2.allocate(b, 8)
    computed(bm2, b)
    bm2.swap_out(b)
    bm2.allocate(req("x", range(100, 108)), 8)  # two of three pages taken
    assert not bm2.can_swap_in(b)


def test_free_of_a_swapped_request_returns_host_pages():
    bm = BlockManager(num_blocks=4, block_size=BS, num_cpu_blocks=4)
    a = req("a", range(6))
    bm.allocate(a, 6)
    bm.swap_out(a)
    bm.free(a)
    bm.free(a)  # idempotent
    assert_all_free(bm)


def test_reset_prefix_cache_forgets_idle_pages():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", range(9))
    bm.allocate(a, 9)
    computed(bm, a)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert_all_free(bm)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = req("a", range(9))
    bm.allocate(a, 9)
    computed(bm, a)
    assert bm.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert bm.num_cached_blocks == 0 and bm.prefix_cache_queries == 0


def test_bad_pool_sizes_are_rejected():
    with pytest.raises(ValueError, match="no usable KV block"):
        BlockManager(num_blocks=1, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
