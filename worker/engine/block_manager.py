"""KV block pool: fixed-size blocks, reference counts, a prefix cache. Mechanism only.

The block manager answers questions (``can_allocate``, ``can_append``) and performs actions
(``allocate``, ``append``, ``cache_blocks``, ``free``); it never decides who runs or who is
preempted — that is the scheduler's job.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class CacheWatcher(Protocol):
    """Told of every change of the prefix cache's content (a worker publishes a summary of what
    its cache holds for routing). Called on the engine's thread, inside the block manager's
    actions: it must be quick and must not call back into the block manager."""

    def cached(self, index: int, block_hash: bytes) -> None:
        """A full block at position ``index`` of its sequence is now in the cache."""

    def forgotten(self, block_hash: bytes) -> None:
        """The block with ``block_hash`` left the cache (evicted or reset)."""


class AllocStatus(enum.Enum):
    NOW = "now"  # enough free (or evictable) blocks right now
    LATER = "later"  # fits in the pool, but not with what is free now
    NEVER = "never"  # needs more blocks than the whole pool has


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` token slots, shared by sequences.

    Each block is in exactly one of three states:
        * in use: ``ref_count > 0`` — referenced by that many block-table entries;
        * free and cached: ``ref_count == 0``, holds the K/V of a known full block (its chained
          hash is registered); it can be reused by a prefix-cache hit or evicted, least recently
          freed first;
        * free and clean: ``ref_count == 0``, no hash.

    Invariants (checked by :func:`check_invariants` and a hypothesis state machine):
        * no block is both free and referenced; free-clean and free-cached are disjoint;
        * ``ref_count[b]`` equals the number of block-table entries equal to ``b``;
        * a block has a hash iff the cache maps that hash to it (one block per hash);
        * block tables are append-only: a sequence's table only grows until ``free``;
        * only full blocks whose K/V were computed get a hash (``cache_blocks``).

    Block limit (a shared KV pool's grant, issue 6): ``block_limit`` caps the blocks in use.
    Allocations and appends never take the in-use count above it; lowering it below the in-use
    count frees nothing (the scheduler preempts). Free cached blocks do not count as in use: they
    are evictable, and reviving one by a prefix-cache hit counts against the limit like any
    other block taken from the free pool. ``None`` means no limit (the whole pool). The blocks in
    use are over the limit when ``num_used_blocks > block_limit``.

    Allocation prefers contiguous runs: a sequence's next block is the one after its last block
    when that is free and clean, otherwise the lowest free clean id, otherwise the least recently
    used cached block (which is then evicted from the cache).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # chained hash -> block id (in use or free-cached)
        self._free_clean: set[int] = set(range(num_blocks))
        self._free_heap: list[int] = list(range(num_blocks))  # lazy: may hold ids no longer free
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._tables: dict[str, list[int]] = {}
        self._num_slots: dict[str, int] = {}  # token slots each table covers
        self._num_hashed: dict[str, int] = {}  # leading blocks of each table already offered
        self.block_limit: int | None = None  # in-use blocks at most (None: no limit)
        self.watcher: CacheWatcher | None = None  # told of what enters and leaves the cache

    # ----------------------------------------------------------------------------- questions

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free clean plus evictable cached ones."""
        return len(self._free_clean) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by some block table (free cached blocks excluded)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks allocations may take now: the free ones, within ``block_limit``."""
        free = self.num_free_blocks
        if self.block_limit is None:
            return free
        return max(0, min(free, self.block_limit - self.num_used_blocks))

    def set_block_limit(self, num_blocks: int | None) -> None:
        """Cap the blocks in use at ``num_blocks`` (None: no cap). Frees nothing."""
        if num_blocks is not None and (
            isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0
        ):
            raise ValueError(f"block limit must be an integer >= 0 or None, got {num_blocks!r}")
        self.block_limit = num_blocks

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's block table (the live list: callers must not modify it)."""
        return self._tables[seq_id]

    def __contains__(self, seq_id: str) -> bool:
        """``seq_id in block_manager``: the sequence has a block table."""
        return seq_id in self._tables

    def num_slots(self, seq_id: str) -> int:
        """Token slots the sequence's block table covers (positions ``0 .. num_slots - 1``)."""
        return self._num_slots[seq_id]

    def num_cache_hit_blocks(self, num_tokens: int, block_hashes: Sequence[bytes]) -> int:
        """Leading full blocks of a new ``num_tokens``-token sequence that the cache already holds.

        At least the last token is always left to compute (its logits are needed), so only blocks
        lying entirely within the first ``num_tokens - 1`` tokens can hit.
        """
        if not self.enable_prefix_caching:
            return 0
        limit = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        n = 0
        while n < limit and block_hashes[n] in self.cached:
            n += 1
        return n

    def num_blocks_to_take(self, num_tokens: int, block_hashes: Sequence[bytes] = ()) -> int:
        """Blocks a new sequence of ``num_tokens`` tokens would take out of the free pool now:
        its blocks minus cache hits on blocks in use (a hit on a free cached block takes it)."""
        num_hits = self.num_cache_hit_blocks(num_tokens, block_hashes)
        num_revived = sum(
            1 for h in block_hashes[:num_hits] if self.ref_counts[self.cached[h]] == 0
        )
        return num_blocks_for(num_tokens, self.block_size) - num_hits + num_revived

    def can_allocate(self, num_tokens: int, block_hashes: Sequence[bytes] = ()) -> AllocStatus:
        """Could a new sequence of ``num_tokens`` known tokens get blocks for all of them?

        ``LATER`` also when only the block limit stands in the way."""
        if num_blocks_for(num_tokens, self.block_size) > self.num_blocks:
            return AllocStatus.NEVER
        if self.num_blocks_to_take(num_tokens, block_hashes) <= self.num_allocatable_blocks:
            return AllocStatus.NOW
        return AllocStatus.LATER

    def can_append(self, seq_id: str) -> bool:
        """Could the sequence get one more token slot?"""
        return self._num_slots[seq_id] % self.block_size != 0 or self.num_allocatable_blocks > 0

    # ------------------------------------------------------------------------------- actions

    def allocate(self, seq_id: str, num_tokens: int, block_hashes: Sequence[bytes] = ()) -> int:
        """Give a new sequence blocks for ``num_tokens`` slots, sharing cached prefix blocks.

        Returns the number of leading tokens whose K/V the shared blocks already hold. Raises
        ``ValueError`` when the sequence exists or the pool cannot serve it now.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if self.can_allocate(num_tokens, block_hashes) is not AllocStatus.NOW:
            raise ValueError(f"not enough free KV blocks for {num_tokens} tokens")
        num_hits = self.num_cache_hit_blocks(num_tokens, block_hashes)
        table: list[int] = []
        for h in block_hashes[:num_hits]:
            block = self.cached[h]
            if self.ref_counts[block] == 0:
                del self._free_cached[block]
            self.ref_counts[block] += 1
            table.append(block)
        for _ in range(num_blocks_for(num_tokens, self.block_size) - num_hits):
            table.append(self._take_block(table[-1] + 1 if table else None))
        self._tables[seq_id] = table
        self._num_slots[seq_id] = num_tokens
        self._num_hashed[seq_id] = num_hits
        return num_hits * self.block_size

    def append(self, seq_id: str) -> None:
        """Add one token slot to the sequence (a new block when its last one is full)."""
        if not self.can_append(seq_id):
            raise ValueError(f"no free KV block to extend sequence {seq_id!r}")
        table = self._tables[seq_id]
        if self._num_slots[seq_id] == len(table) * self.block_size:
            table.append(self._take_block(table[-1] + 1 if table else None))
        self._num_slots[seq_id] += 1

    def cache_blocks(
        self, seq_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int
    ) -> None:
        """Offer the sequence's full, computed blocks to the prefix cache.

        ``block_hashes`` are the sequence's chained block hashes; a block whose hash another
        block already holds stays private (same content computed twice in one step).
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq_id]
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        for i in range(self._num_hashed[seq_id], num_full):
            block, h = table[i], block_hashes[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
                if self.watcher is not None:
                    self.watcher.cached(i, h)
        self._num_hashed[seq_id] = max(self._num_hashed[seq_id], num_full)

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks (no-op for an unknown sequence).

        Blocks whose count drops to zero become free: cached ones join the LRU tail in reverse
        table order (a sequence's tail is evicted before its more shareable head), others the
        clean pool.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._num_slots[seq_id]
        del self._num_hashed[seq_id]
        for block in reversed(table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self._free_cached[block] = None
                else:
                    self._free_clean.add(block)
                    heapq.heappush(self._free_heap, block)

    def reset_prefix_cache(self) -> int:
        """Drop every free cached block's hash (they become clean). Returns how many."""
        n = len(self._free_cached)
        while self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
            self._forget_hash(block)
            self._free_clean.add(block)
            heapq.heappush(self._free_heap, block)
        return n

    # ------------------------------------------------------------------------------ internal

    def _take_block(self, preferred: int | None) -> int:
        if preferred is not None and preferred in self._free_clean:
            block = preferred
            self._free_clean.remove(block)
        elif self._free_clean:
            block = heapq.heappop(self._free_heap)
            while block not in self._free_clean:  # skip stale entries
                block = heapq.heappop(self._free_heap)
            self._free_clean.remove(block)
        else:
            block, _ = self._free_cached.popitem(last=False)  # evict the least recently used
            self._forget_hash(block)
        if len(self._free_heap) > 2 * self.num_blocks:  # drop stale entries now and then
            self._free_heap = sorted(self._free_clean)
        self.ref_counts[block] = 1
        return block

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None
            if self.watcher is not None:
                self.watcher.forgotten(h)


def check_invariants(bm: BlockManager) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of ``bm`` (the ones its class
    docstring states; for tests and debugging, so not part of the block manager's API)."""
    counts = [0] * bm.num_blocks
    for seq_id, table in bm._tables.items():
        for block in table:
            counts[block] += 1
        if num_blocks_for(bm._num_slots[seq_id], bm.block_size) != len(table):
            raise AssertionError(f"{seq_id}: table length does not match its slots")
    if counts != bm.ref_counts:
        raise AssertionError("ref counts differ from block-table references")
    if bm._free_clean & set(bm._free_cached):
        raise AssertionError("a block is both free-clean and free-cached")
    for block in range(bm.num_blocks):
        is_free = block in bm._free_clean or block in bm._free_cached
        if is_free == (bm.ref_counts[block] > 0):
            raise AssertionError(f"block {block} is free={is_free} with refs")
        if block in bm._free_clean and bm.block_hash[block] is not None:
            raise AssertionError(f"free-clean block {block} has a hash")
        if block in bm._free_cached and bm.block_hash[block] is None:
            raise AssertionError(f"free-cached block {block} has no hash")
        h = bm.block_hash[block]
        if h is not None and bm.cached.get(h) != block:
            raise AssertionError(f"block {block}'s hash does not map back to it")
    if len(bm.cached) != sum(h is not None for h in bm.block_hash):
        raise AssertionError("cache maps hashes to blocks that do not hold them")
    if not bm._free_clean <= set(bm._free_heap):
        raise AssertionError("a free-clean block is missing from the free heap")
