"""The engine's one pool-facing object: what a shared KV pool reads from an engine and sets on it.

``tokenfleet.worker.pool.link.PoolLink`` drives a :class:`PoolPort` around each engine step (the
per-step contract of docs/kv-pools.md): it sets the block limit (the pool's grant) and the token
limit (a compute share), reads what the pool call reports (blocks in use and wanted, blocks per
priority, the head waiting request's shortfall, the tokens wanted) and executes a preemption order
between steps. ``Engine.pool_port()`` makes one.

A port holds no state of its own: the block limit lives in the block manager (``block_limit``),
the token limit in the scheduler (``token_limit``), and every question reads the scheduler's
queues and the block manager when asked. So ``Engine.step()`` does no work for the pool beyond
honouring the two limits, and any number of ports of one engine agree.
"""

from __future__ import annotations

from typing import Protocol

from tokenfleet.shared.block_hash import extend_block_hashes
from tokenfleet.shared.priority import PRIORITIES, Priority
from tokenfleet.worker.engine.block_manager import num_blocks_for
from tokenfleet.worker.engine.outputs import StepStats
from tokenfleet.worker.engine.preemption import admission_victim
from tokenfleet.worker.engine.request import Request
from tokenfleet.worker.engine.scheduler import Scheduler


class StepStatsSource(Protocol):
    """Where the last step's stats are read (the engine)."""

    @property
    def last_step_stats(self) -> StepStats: ...


class PoolPort:
    """One engine as a shared KV pool sees it: two limits, five questions, one action.

    Invariants (the scheduler and block manager keep them; the port only sets and reads):
        * the blocks in use stay within ``kv_block_limit`` after every ``step()``: admission and
          growth stay within it, and a limit lowered below use preempts (recompute) the least
          urgent running requests at the next step;
        * ``sum(blocks_by_priority()) == num_used_blocks``;
        * a step computes at most ``token_limit`` tokens (at least 1, so work always progresses).
    """

    __slots__ = ("_block_manager", "_scheduler", "_stats")

    def __init__(self, scheduler: Scheduler, stats: StepStatsSource) -> None:
        self._scheduler = scheduler
        self._block_manager = scheduler.block_manager
        self._stats = stats

    # -------------------------------------------------------------------------------- limits

    def set_kv_block_limit(self, num_blocks: int | None) -> None:
        """Admit and grow requests only while the blocks in use stay within ``num_blocks``
        (None: the whole cache). Lowered below the blocks in use, the next ``step()`` preempts
        (recompute) the lowest-priority, latest-arrived running requests until within. Free
        prefix-cached blocks are not in use; reviving one counts like taking a free block."""
        self._block_manager.set_block_limit(num_blocks)

    @property
    def kv_block_limit(self) -> int | None:
        return self._block_manager.block_limit

    def set_token_limit(self, num_tokens: int | None) -> None:
        """Compute at most ``num_tokens`` tokens per step (at least 1; None: only
        ``max_num_batched_tokens``): a pool's compute share. Decode goes most urgent first."""
        if num_tokens is not None and num_tokens < 1:
            raise ValueError(f"token limit must be >= 1 or None, got {num_tokens}")
        self._scheduler.token_limit = num_tokens

    @property
    def token_limit(self) -> int | None:
        return self._scheduler.token_limit

    # ----------------------------------------------------------------------------- questions

    @property
    def has_work(self) -> bool:
        """Running or waiting requests (an engine without them is idle for the pool)."""
        return self._scheduler.has_unfinished()

    @property
    def last_step_stats(self) -> StepStats:
        """The engine's last step (the compute share charges its tokens)."""
        return self._stats.last_step_stats

    @property
    def num_kv_blocks(self) -> int:
        """The engine's own KV cache, in blocks (a limit above it cannot be used)."""
        return self._block_manager.num_blocks

    @property
    def num_used_blocks(self) -> int:
        """KV blocks referenced by running requests (free cached blocks excluded)."""
        return self._block_manager.num_used_blocks

    @property
    def num_blocks_wanted(self) -> int:
        """More blocks the next step would take: growth of running requests to cover their known
        tokens, plus the head waiting request's blocks when a sequence slot is free."""
        bm = self._block_manager
        block_size = bm.block_size
        num = sum(
            max(0, num_blocks_for(r.num_tokens, block_size) - len(bm.block_table(r.request_id)))
            for r in self._scheduler.running
        )
        head = self._admissible_head()
        if head is not None:
            num += bm.num_blocks_to_take(head.num_tokens, head.block_hashes)
        return num

    @property
    def num_tokens_wanted(self) -> int:
        """Tokens the next step would compute with no compute-share cap: every running request's
        uncomputed tokens plus the waiting requests' (as many as free sequence slots), at most
        ``max_num_batched_tokens``. An estimate: admission may still be refused for blocks."""
        sched = self._scheduler
        num = sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
        slots = max(0, sched.config.max_num_seqs - len(sched.running))
        num += sum(r.num_tokens for r in sched.waiting[:slots])
        return min(num, sched.config.max_num_batched_tokens)

    def blocks_by_priority(self) -> list[int]:
        """Blocks in use by running requests per priority, most urgent first. A block shared by
        requests of several priorities counts once, for the most urgent (preempting the others
        would not free it); the counts sum to the blocks in use."""
        counts = [0] * len(PRIORITIES)
        seen: set[int] = set()
        bm = self._block_manager
        for req in sorted(self._scheduler.running, key=lambda r: int(r.priority)):
            for block in bm.block_table(req.request_id):
                if block not in seen:
                    seen.add(block)
                    counts[int(req.priority)] += 1
        return counts

    def kv_block_shortfall(self) -> tuple[Priority, int] | None:
        """(priority, blocks lacking) of the head waiting request when only the block limit
        keeps it out: what a pool member asks its pool for. None when it fits, when the engine's
        own cache is what is short (more budget would not help), when the engine will preempt its
        own less urgent work for it at the next step, or with no limit."""
        bm = self._block_manager
        head = self._admissible_head()
        if head is None or bm.block_limit is None:
            return None
        num_take = bm.num_blocks_to_take(head.num_tokens, head.block_hashes)
        if num_take > bm.num_free_blocks:
            return None
        lacking = num_take - max(0, bm.block_limit - bm.num_used_blocks)
        if lacking <= 0 or admission_victim(head, self._scheduler.running, bm) is not None:
            return None  # it fits, or the next step preempts less urgent work here for it
        return (head.priority, lacking)

    # -------------------------------------------------------------------------------- action

    def preempt_for_pool(self, num_blocks: int, priority: Priority) -> int:
        """Free up to ``num_blocks`` for the pool now; returns how many are givable back.

        Spare blocks (allowed by the limit, unused) count first; then running requests strictly
        less urgent than ``priority`` are preempted (recompute), lowest priority and latest
        arrival first, until enough blocks are free. The caller lowers the limit by the result.
        Preemptions are counted in the next step's stats.
        """
        priority = Priority(priority)
        if num_blocks <= 0:
            return 0
        sched, bm = self._scheduler, self._block_manager
        limit = bm.block_limit if bm.block_limit is not None else bm.num_blocks
        freed = max(0, limit - bm.num_used_blocks)
        victims = sorted(
            (r for r in sched.running if int(r.priority) > int(priority)),
            key=lambda r: (int(r.priority), r.timings.arrival_time, r.arrival_seq),
        )
        while freed < num_blocks and victims:
            before = bm.num_used_blocks
            sched.preempt(victims.pop())
            freed += before - bm.num_used_blocks
        return min(freed, num_blocks)

    def _admissible_head(self) -> Request | None:
        """The next waiting request to admit, if a sequence slot is free (hashes brought up
        to date)."""
        sched = self._scheduler
        if not sched.waiting or len(sched.running) >= sched.config.max_num_seqs:
            return None
        head = sched.waiting[0]
        extend_block_hashes(head.block_hashes, head.all_token_ids, sched.block_size)
        return head
