"""BlockManager: allocation answers, prefix sharing, LRU eviction, and a stateful property test."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from tokenfleet.shared.block_hash import extend_block_hashes, hash_block
from tokenfleet.worker.engine.block_manager import AllocStatus, BlockManager, check_invariants


def hashes_of(token_ids: list[int], block_size: int) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, token_ids, block_size)
    return out


def test_can_allocate_now_later_never() -> None:
    bm = BlockManager(4, 4)
    assert bm.can_allocate(16) is AllocStatus.NOW
    assert bm.can_allocate(17) is AllocStatus.NEVER
    bm.allocate("a", 9)  # 3 blocks
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(4) is AllocStatus.NOW
    assert bm.can_allocate(5) is AllocStatus.LATER
    bm.free("a")
    assert bm.can_allocate(16) is AllocStatus.NOW
    check_invariants(bm)


def test_append_takes_a_block_only_at_a_boundary() -> None:
    bm = BlockManager(2, 4)
    bm.allocate("a", 3)
    bm.append("a")  # slot 3: same block
    assert bm.block_table("a") == [0]
    bm.append("a")  # slot 4: new block
    assert bm.block_table("a") == [0, 1]
    for _ in range(3):
        bm.append("a")
    assert not bm.can_append("a")
    with pytest.raises(ValueError, match="no free KV block"):
        bm.append("a")
    check_invariants(bm)


def test_allocation_prefers_contiguous_runs() -> None:
    bm = BlockManager(8, 2)
    bm.allocate("a", 2)  # [0]
    bm.allocate("b", 2)  # [1]
    bm.free("a")  # 0 free
    bm.allocate("c", 6)  # lowest free first, then extend after the last block: 0, then 2, 3
    assert bm.block_table("c") == [0, 2, 3]
    bm.append("b")
    bm.append("b")  # b's next block: 2 is taken, so the lowest free id
    assert bm.block_table("b") == [1, 4]
    check_invariants(bm)


def test_prefix_blocks_are_shared_by_reference_count() -> None:
    bm = BlockManager(8, 4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    hashes = hashes_of(prompt, 4)
    assert bm.allocate("a", 10, hashes) == 0
    bm.cache_blocks("a", hashes, 10)
    other = [*prompt[:8], 99, 98, 97]  # same two full blocks, different tail
    assert bm.can_allocate(11, hashes_of(other, 4)) is AllocStatus.NOW
    assert bm.allocate("b", 11, hashes_of(other, 4)) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]
    assert [bm.ref_counts[b] for b in bm.block_table("a")] == [2, 2, 1]
    check_invariants(bm)


def test_full_hit_still_leaves_the_last_token_to_compute() -> None:
    bm = BlockManager(8, 4)
    prompt = list(range(8))
    hashes = hashes_of(prompt, 4)
    bm.allocate("a", 8, hashes)
    bm.cache_blocks("a", hashes, 8)
    bm.free("a")
    # the second block holds the last token: only the first may hit
    assert bm.allocate("b", 8, hashes) == 4


def test_freed_cached_blocks_are_reused_then_evicted_lru() -> None:
    bm = BlockManager(4, 2)
    seqs = {name: [i * 10 + j for j in range(2)] + [7] for i, name in enumerate("abc")}
    for name, toks in seqs.items():
        h = hashes_of(toks, 2)
        bm.allocate(name, 3, h)
        bm.cache_blocks(name, h, 3)
        bm.free(name)  # first block cached (free), second block clean
    assert len(bm.cached) == 3
    # a hit revives a free cached block without computing it
    assert bm.allocate("a2", 3, hashes_of(seqs["a"], 2)) == 2
    bm.free("a2")  # "a"'s block is now the most recently used
    # needing every block evicts the cached ones, least recently used first: b, c, a
    bm.allocate("big", 5)
    assert hashes_of(seqs["a"], 2)[0] in bm.cached
    assert hashes_of(seqs["b"], 2)[0] not in bm.cached
    assert hashes_of(seqs["c"], 2)[0] not in bm.cached
    bm.append("big")
    bm.append("big")
    bm.append("big")  # the fourth block: the last cached one goes
    assert not bm.cached
    check_invariants(bm)


def test_hits_on_free_cached_blocks_count_against_the_free_pool() -> None:
    bm = BlockManager(3, 2)
    toks = [1, 2, 3, 4, 5]
    h = hashes_of(toks, 2)
    bm.allocate("a", 5, h)
    bm.cache_blocks("a", h, 5)
    bm.free("a")  # 2 cached free + 1 clean free
    assert bm.num_free_blocks == 3
    # reusing both cached blocks leaves one free block for the tail: exactly fits
    assert bm.can_allocate(5, h) is AllocStatus.NOW
    bm.allocate("b", 5, h)
    assert bm.num_free_blocks == 0


def test_duplicate_content_stays_private() -> None:
    bm = BlockManager(4, 2)
    toks = [1, 2, 3]
    h = hashes_of(toks, 2)
    bm.allocate("a", 3, h)
    bm.allocate("b", 3, h)  # admitted in the same step: no hit yet
    bm.cache_blocks("a", h, 3)
    bm.cache_blocks("b", h, 3)
    assert bm.cached[h[0]] == bm.block_table("a")[0]
    assert bm.block_hash[bm.block_table("b")[0]] is None
    check_invariants(bm)


def test_hash_chain_depends_on_the_parent() -> None:
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0, 0]), [1, 2])
    assert hashes_of([1, 2, 3, 4], 2)[1] != hashes_of([9, 9, 3, 4], 2)[1]


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    h = hashes_of([1, 2, 3], 2)
    bm.allocate("a", 3, h)
    bm.cache_blocks("a", h, 3)
    bm.free("a")
    assert bm.allocate("b", 3, h) == 0
    assert not bm.cached


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    bm = BlockManager(2, 4)
    bm.allocate("a", 1)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("a", 1)
    with pytest.raises(ValueError, match="not enough free"):
        bm.allocate("b", 8)


# ----------------------------------------------------------------------- stateful property test

BLOCK_SIZE = 2
NUM_BLOCKS = 8
TOKENS = st.lists(
    st.integers(0, 2), min_size=1, max_size=12
)  # small alphabet: many shared prefixes


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / append / free / abort; after each step, every invariant holds
    and every computed or shared position holds the sequence's own token (a model of the KV)."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.kv: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}  # snapshot, to check tables are append-only
        self.content: dict[bytes, list[int]] = {}  # block hash -> the tokens it stands for
        self.counter = 0

    @rule(target=seqs, toks=TOKENS)
    def allocate(self, toks: list[int]) -> str:
        sid = f"s{self.counter}"
        self.counter += 1
        h = hashes_of(toks, BLOCK_SIZE)
        status = self.bm.can_allocate(len(toks), h)
        if status is AllocStatus.NEVER:
            assert -(-len(toks) // BLOCK_SIZE) > NUM_BLOCKS
            return sid
        if status is AllocStatus.LATER:
            with pytest.raises(ValueError):
                self.bm.allocate(sid, len(toks), h)
            return sid
        cached = self.bm.allocate(sid, len(toks), h)
        assert cached % BLOCK_SIZE == 0 and cached < len(toks)
        self.tokens[sid] = list(toks)
        self.computed[sid] = cached
        self._snapshot(sid)
        return sid

    @rule(sid=seqs, n=st.integers(1, 6))
    def compute(self, sid: str, n: int) -> None:
        """The model runner writes K/V for the next chunk, then the blocks are offered."""
        if sid not in self.tokens:
            return
        toks, start = self.tokens[sid], self.computed[sid]
        end = min(len(toks), start + n)
        table = self.bm.block_table(sid)
        for pos in range(start, end):
            self.kv[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = toks[pos]
        self.computed[sid] = end
        hashes = hashes_of(toks, BLOCK_SIZE)
        for i, h in enumerate(hashes):
            self.content[h] = toks[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        self.bm.cache_blocks(sid, hashes, end)

    @rule(sid=seqs, token=st.integers(0, 2))
    def append(self, sid: str, token: int) -> None:
        """A fully computed sequence samples a token and gets a slot for it."""
        if sid not in self.tokens or self.computed[sid] != len(self.tokens[sid]):
            return
        if self.bm.can_append(sid):
            self.bm.append(sid)
            self.tokens[sid].append(token)
            self._snapshot(sid)
        else:
            assert self.bm.num_free_blocks == 0

    @rule(sid=consumes(seqs))
    def free(self, sid: str) -> None:
        self._drop(sid)

    @rule(sid=consumes(seqs))
    def abort_midway(self, sid: str) -> None:
        """Freed before its prefill completes (abort or preemption): partial blocks stay private."""
        self._drop(sid)

    @precondition(lambda self: not self.tokens)
    @rule()
    def reset_cache(self) -> None:
        self.bm.reset_prefix_cache()
        assert not self.bm.cached

    def _drop(self, sid: str) -> None:
        self.bm.free(sid)
        self.tokens.pop(sid, None)
        self.computed.pop(sid, None)
        self.tables.pop(sid, None)

    def _snapshot(self, sid: str) -> None:
        old = self.tables.get(sid, [])
        new = list(self.bm.block_table(sid))
        assert new[: len(old)] == old, "block tables are append-only"
        self.tables[sid] = new

    @invariant()
    def invariants_hold(self) -> None:
        check_invariants(self.bm)
        for sid, table in self.tables.items():
            assert self.bm.block_table(sid)[: len(table)] == table

    @invariant()
    def kv_content_matches(self) -> None:
        for sid, toks in self.tokens.items():
            table = self.bm.block_table(sid)
            for pos in range(self.computed[sid]):
                assert self.kv[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == toks[pos], (sid, pos)
        for h, block in self.bm.cached.items():
            assert self.bm.block_hash[block] == h
            assert self.kv[block] == self.content[h], "a cached block holds its hash's tokens"


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
