"""Which running request a waiting one may preempt to start: the scheduler's admission rules.

Two rules, both preempting by recompute (the victim's blocks are freed, it waits again):

* **urgency** (issue 15): a request that cannot get KV blocks may preempt running requests of a
  strictly less urgent priority, lowest priority and latest arrival first. Never work of its own or
  a more urgent priority, and never a boosted request (one that already waited too long: the
  starvation guard), so a request preempted for urgent work cannot starve: once it has waited
  ``max_wait_steps``/``max_wait_s`` again it is boosted and no longer a victim. A full batch of
  sequences alone (blocks to spare) preempts nothing.
* **background slots**: with ``background_yields``, a request more urgent than ``batch`` that
  finds no free sequence slot (blocks to spare) preempts the least urgent running ``batch``
  request that is not boosted: batch work may fill every slot, and interactive work takes slots
  back from it when it arrives (the victim's full blocks stay in the prefix cache, so its
  recompute is mostly cache hits). The worker reads at most ``urgent_slots`` such requests
  beyond its free slots per read (``Feeder.read_budget``).
* **starvation**: a boosted request (waited too long) may preempt any running request less urgent
  than itself by ``sort_key`` (every unboosted one, and boosted ones that arrived later), for
  blocks or for a sequence slot. Boosted requests are ordered by arrival among themselves, so two
  starving requests never preempt each other back and forth.

Either rule preempts only when preempting all its candidates could make room (no futile
preemptions), and a victim always sorts after the request it makes room for, so it is never
re-admitted ahead of it (no ping-pong). The shared KV pool's order (``PoolPort.preempt_for_pool``)
uses the same victim order; the pool is asked for blocks only after these rules found none here.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.shared.priority import BACKGROUND
from tokenfleet.worker.engine.block_manager import AllocStatus, BlockManager, num_blocks_for
from tokenfleet.worker.engine.request import Request


def admission_victim(
    req: Request,
    running: Sequence[Request],
    block_manager: BlockManager,
    *,
    take_background_slots: bool = False,
) -> Request | None:
    """The running request the waiting ``req`` may preempt now to start, or None.

    ``running`` is sorted by ``sort_key`` (the scheduler's queue); ``req``'s block hashes are up
    to date. Called when ``req`` cannot start now (blocks or a sequence slot short).
    """
    bm = block_manager
    if req.boosted:
        key = req.sort_key
        victims = [r for r in running if r.sort_key > key]
    elif bm.can_allocate(req.num_tokens, req.block_hashes) is not AllocStatus.NOW:
        priority = int(req.priority)
        victims = [r for r in running if not r.boosted and int(r.priority) > priority]
    elif take_background_slots and req.priority is not BACKGROUND:
        victims = [r for r in running if not r.boosted and r.priority is BACKGROUND]
    else:
        return None  # only a sequence slot is short: urgency alone does not preempt for it
    if not victims:
        return None
    reclaimable: set[int] = set()
    for r in victims:
        reclaimable.update(bm.block_table(r.request_id))
    num_needed = num_blocks_for(req.num_tokens, bm.block_size)
    num_needed -= bm.num_cache_hit_blocks(req.num_tokens, req.block_hashes)
    if num_needed > bm.num_allocatable_blocks + len(reclaimable):
        return None
    return victims[-1]
