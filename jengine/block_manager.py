"""Paged KV-cache bookkeeping: which device page holds which request's tokens.

The device cache is `num_blocks` pages of `block_size` token slots each; a request's block table
lists its pages in token order, so token `p` lives in slot `p % block_size` of page
`table[p // block_size]`. This module only moves page ids around; the device runner moves the data
(it executes the swap and copy lists the scheduler hands it, in the order swap-out, swap-in, copy,
before running the step).

Page 0 is reserved as the null page (`NULL_BLOCK_ID`) when `reserve_null_block` is on: it is never
handed to a request, so the runner can pad unused `page_indices` entries with 0 and padded tokens
can write there without touching anyone's data.

Automatic prefix caching: once every token of a block has its K/V written (by the step being
scheduled or an earlier one), the block is registered under a key that chains the previous block's
hash with the block's own token ids, so one key names a whole prefix. A later request whose prompt
starts with the same tokens reuses those pages instead of recomputing them. A registered page whose
reference count falls to 0 keeps its contents and its key and waits in an LRU list; it is only
evicted (and its key forgotten) when a fresh page is needed and no never-cached page is left. Pages
are released tail-first so a prefix outlives its continuation.

Copy-on-write: `fork` makes a child share every page of its parent, including a partly filled last
page. Before anyone writes into a shared page, `append_slots` gives the writer a fresh page and
returns a (src, dst) copy for the runner.

Swap: `swap_out` moves a request's pages to a host pool of `num_cpu_blocks` pages and frees the
device pages; `swap_in` reverses it. Each returns the (from, to) page pairs the runner must copy.

Requests are duck-typed: anything with `request_id`, `all_token_ids`, `num_tokens` and
`num_computed_tokens` (see `jengine.request.Request`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

NULL_BLOCK_ID = 0
_ROOT_HASH = 0  # parent hash of a request's first block

# A block's cache key: (hash of the previous block's key, the block's token ids). The dict compares
# keys by value, so two different token blocks can never be confused; the chained hash makes the key
# stand for the whole prefix.
BlockKey = tuple[int, tuple[int, ...]]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Free list, reference counts, block tables, prefix cache and host swap pool for one KV cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        reserve_null_block: bool = True,
    ) -> None:
        first = 1 if reserve_null_block else 0
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks - first < 1:
            raise ValueError(f"num_blocks={num_blocks} leaves no usable KV block (block 0 is the null page)")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.num_usable_blocks = num_blocks - first

        # Per device page.
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks  # set while the page is in the cache
        # Pages that hold nothing reusable, and cached pages nobody references (LRU first).
        self._free: deque[int] = deque(range(first, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockKey, int] = {}

        # Per request.
        self._tables: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}  # leading blocks already offered to the cache
        self._keys: dict[str, list[BlockKey]] = {}  # keys of the request's full blocks, grown lazily

        # Host swap pool.
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self._cpu_tables: dict[str, list[int]] = {}

        # Counters, in tokens (queries/hits) and blocks (evictions).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ pool state

    @property
    def num_free_blocks(self) -> int:
        """Pages a request could get now: never-cached free pages plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def usage(self) -> float:
        """Fraction of usable device pages referenced by some request (cached-but-idle counts as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def block_table(self, request: Any) -> list[int]:
        """The request's device pages in token order (the live list: copy it before keeping it)."""
        return self._tables[request.request_id]

    def has_blocks(self, request: Any) -> bool:
        return request.request_id in self._tables

    def is_swapped(self, request: Any) -> bool:
        return request.request_id in self._cpu_tables

    # ------------------------------------------------------------------ prefix cache lookup

    def _block_keys(self, request: Any, num_full_blocks: int) -> list[BlockKey]:
        """Keys of the request's first `num_full_blocks` blocks, computing only the missing ones."""
        keys = self._keys.setdefault(request.request_id, [])
        if len(keys) < num_full_blocks:
            tokens = request.all_token_ids
            bs = self.block_size
            parent = hash(keys[-1]) if keys else _ROOT_HASH
            for i in range(len(keys), num_full_blocks):
                key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
                keys.append(key)
                parent = hash(key)
        return keys

    def get_computed_blocks(self, request: Any) -> tuple[list[int], int]:
        """Cached pages holding the longest prefix of the request's tokens, and how many tokens that is.

        At most `num_tokens - 1` tokens are reported, rounded down to whole blocks, so the step still
        runs the last known token and has logits to sample from. Pure lookup: nothing is claimed until
        `allocate` is given these pages.
        """
        if not self.enable_prefix_caching or getattr(request, "skip_prefix_cache", False):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for key in self._block_keys(request, max_blocks)[:max_blocks]:
            block_id = self._cached.get(key)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    # ------------------------------------------------------------------ allocation

    def _take_free_block(self) -> int:
        """A page with refcount 1, preferring never-cached pages over evicting the LRU cached one."""
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            del self._cached[self._key[block_id]]
            self._key[block_id] = None
            self.num_evictions += 1
        else:
            raise RuntimeError("KV cache out of blocks; callers must check can_allocate/can_append_slots")
        self._ref[block_id] = 1
        return block_id

    def _claim(self, block_id: int) -> None:
        """Add a reference to a cached page, taking it off the evictable list if it was idle."""
        if self._ref[block_id] == 0:
            del self._evictable[block_id]
        self._ref[block_id] += 1

    def _release(self, block_id: int) -> None:
        self._ref[block_id] -= 1
        assert self._ref[block_id] >= 0, f"block {block_id} released more often than claimed"
        if self._ref[block_id] == 0:
            if self._key[block_id] is not None:
                self._evictable[block_id] = None  # most recently used end
            else:
                self._free.append(block_id)

    def can_allocate(self, request: Any, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Whether `allocate` can hold the cached prefix plus `num_new_tokens` more tokens."""
        num_needed = _cdiv(len(computed_blocks) * self.block_size + num_new_tokens, self.block_size)
        idle_hits = sum(1 for b in computed_blocks if self._ref[b] == 0)  # they leave the free pool
        return num_needed - len(computed_blocks) + idle_hits <= self.num_free_blocks

    def allocate(self, request: Any, num_new_tokens: int, computed_blocks: list[int] = ()) -> list[int]:
        """First block table of a request: the prefix-cache hits, then fresh pages for the new tokens.

        The caller sets `request.num_computed_tokens = len(computed_blocks) * block_size`.
        """
        rid = request.request_id
        assert rid not in self._tables, f"request {rid} already holds blocks"
        num_needed = _cdiv(len(computed_blocks) * self.block_size + num_new_tokens, self.block_size)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            self._claim(block_id)
        table = list(computed_blocks)
        table.extend(self._take_free_block() for _ in range(num_needed - len(table)))
        self._tables[rid] = table
        self._num_committed[rid] = len(computed_blocks)
        return table

    def can_append_slots(self, request: Any, num_new_tokens: int) -> bool:
        """Whether the request can write `num_new_tokens` more tokens after its computed ones."""
        table = self._tables[request.request_id]
        start = request.num_computed_tokens
        end_block = -(-(start + num_new_tokens) // self.block_size)
        needed = max(0, end_block - len(table))
        ref = self._ref
        for i in range(start // self.block_size, min(end_block, len(table))):
            needed += ref[table[i]] > 1  # a shared page to copy before writing
        return needed == 0 or needed <= len(self._free) + len(self._evictable)

    def append_slots(self, request: Any, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens` tokens at positions `num_computed_tokens...`.

        Shared pages in the write range are replaced by private ones (copy-on-write). Returns the
        (src, dst) page copies the runner must do before the step; pages with nothing written yet
        are replaced without a copy.
        """
        table = self._tables[request.request_id]
        start = request.num_computed_tokens
        bs = self.block_size
        end_block = _cdiv(start + num_new_tokens, bs)
        copies: list[tuple[int, int]] = []
        for i in range(start // bs, min(end_block, len(table))):
            src = table[i]
            if self._ref[src] > 1:
                dst = self._take_free_block()
                if i * bs < start:  # the page already holds some of this request's tokens
                    copies.append((src, dst))
                self._release(src)
                table[i] = dst
        table.extend(self._take_free_block() for _ in range(end_block - len(table)))
        return copies

    def cache_full_blocks(self, request: Any, num_tokens: int) -> None:
        """Register the request's full blocks among its first `num_tokens` tokens in the prefix cache.

        The scheduler calls this when it schedules a step, with the tokens whose K/V exist once the
        step has run, so a request admitted later in the same step can already share them. That is
        safe because the step writes every new K/V of the batch before any attention reads in each
        layer (`rope_and_write_kv` then attention). A block whose key is already cached in another page stays
        private (and returns to the plain free list when released).
        """
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self._num_committed[rid]
        if num_full <= start:
            return
        table = self._tables[rid]
        keys = self._block_keys(request, num_full)
        for i in range(start, num_full):
            block_id, key = table[i], keys[i]
            if self._key[block_id] is None and key not in self._cached:
                self._cached[key] = block_id
                self._key[block_id] = key
        self._num_committed[rid] = num_full

    def free(self, request: Any) -> None:
        """Give back every page (device and host) the request holds. Safe to call twice."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        if table is not None:
            for block_id in reversed(table):  # tail first: the prefix stays cached longest
                self._release(block_id)
        self._cpu_free.extend(self._cpu_tables.pop(rid, ()))
        self._num_committed.pop(rid, None)
        self._keys.pop(rid, None)

    def fork(self, parent: Any, child: Any) -> list[int]:
        """Let `child` share all of `parent`'s pages; writes into shared pages copy first (COW)."""
        prid, crid = parent.request_id, child.request_id
        assert crid not in self._tables, f"request {crid} already holds blocks"
        table = list(self._tables[prid])
        for block_id in table:
            self._ref[block_id] += 1
        self._tables[crid] = table
        self._num_committed[crid] = self._num_committed[prid]
        if prid in self._keys:
            self._keys[crid] = list(self._keys[prid])
        return table

    def reset_prefix_cache(self) -> int:
        """Forget every idle cached page (e.g. between benchmark runs). Returns how many were dropped."""
        dropped = len(self._evictable)
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            del self._cached[self._key[block_id]]
            self._key[block_id] = None
            self._free.append(block_id)
        return dropped

    # ------------------------------------------------------------------ swap

    def can_swap_out(self, request: Any) -> bool:
        return len(self._tables[request.request_id]) <= len(self._cpu_free)

    def swap_out(self, request: Any) -> list[tuple[int, int]]:
        """Move the request's pages to the host pool. Returns (device_block, cpu_block) copies."""
        rid = request.request_id
        assert self.can_swap_out(request), f"host pool too small to swap out {rid}"
        table = self._tables.pop(rid)
        mapping = [(block_id, self._cpu_free.popleft()) for block_id in table]
        self._cpu_tables[rid] = [cpu for _, cpu in mapping]
        for block_id in reversed(table):
            self._release(block_id)  # cached pages stay cached on the device: their data is intact
        self._num_committed[rid] = 0  # the pages it gets back are new; offer them to the cache again
        return mapping

    def can_swap_in(self, request: Any, num_new_tokens: int = 0) -> bool:
        """Whether the request's host pages, plus room for `num_new_tokens` more, fit on the device."""
        num_cpu = len(self._cpu_tables[request.request_id])
        num_needed = _cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(num_cpu, num_needed) <= self.num_free_blocks

    def swap_in(self, request: Any) -> list[tuple[int, int]]:
        """Bring a swapped request's pages back. Returns (cpu_block, device_block) copies."""
        rid = request.request_id
        cpu_table = self._cpu_tables.pop(rid)
        assert len(cpu_table) <= self.num_free_blocks, f"not enough device blocks to swap in {rid}"
        mapping = [(cpu, self._take_free_block()) for cpu in cpu_table]
        self._cpu_free.extend(cpu_table)
        self._tables[rid] = [dev for _, dev in mapping]
        return mapping

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent: refcounts match tables, every page is in one place."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] += 1
        assert refs == self._ref, "reference counts disagree with block tables"
        free, idle = set(self._free), set(self._evictable)
        used = {b for b, r in enumerate(self._ref) if r > 0}
        assert not (free & idle) and not (free & used) and not (idle & used), "a page is in two places"
        first = self.num_blocks - self.num_usable_blocks
        assert len(free) + len(idle) + len(used) == self.num_usable_blocks, "a page went missing"
        assert NULL_BLOCK_ID not in free | idle | used or first == 0, "the null page was handed out"
        assert all(self._key[b] is not None for b in idle), "an evictable page has no cache key"
        assert {b: k for k, b in self._cached.items()} == {
            b: k for b, k in enumerate(self._key) if k is not None
        }, "cache index and page keys disagree"
        cpu_used = [c for t in self._cpu_tables.values() for c in t]
        assert len(cpu_used) + len(self._cpu_free) == self.num_cpu_blocks, "a host page went missing"
        assert len(set(cpu_used) | set(self._cpu_free)) == self.num_cpu_blocks, "a host page is doubled"
