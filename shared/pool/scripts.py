"""Shared KV pools: the atomic accounting scripts (issue 6), loaded once from ``lua/``.

They are part of the protocol, so they live in ``shared``: the worker's pool wing
(``tokenfleet.worker.pool``) runs them as a member and an administrator, and a producer reads a
pool through ``pool_inspect`` (the fleet's status and console) without importing the worker.

Each script is a ``.lua`` file in :mod:`tokenfleet.shared.pool.lua` that opens with its
KEYS/ARGV header (which keys it touches, with which commands) and includes ``prelude.lua``, the
local functions they share. Every key a script touches arrives through ``KEYS[]``
(:func:`pool_keys`); none is built inside Lua.

Data layout (names from :class:`tokenfleet.shared.keys.Keys`)::

    P:pool:NAME          hash: settings (total, block_size, cap_permille, chunk, lease_ms,
                         preempt_ms, token_budget, round_ms, clock, created_at) and counters
                         (order_seq, reclaimed_blocks, lapsed_members; manual_now_ms for a
                         test clock)
    P:pool:NAME:members  hash: member -> JSON state {w, held, act, use, uw, td, loan, lp, inbox,
                         exp}
    P:pool:NAME:preempt  hash: donor member -> JSON order {id, r, p, n, at, exp, sent}
    P:pools              set of pool names

Member state: ``w`` weight in thousandths; ``held`` blocks granted and not yet released;
``act`` 1 while the member has running or waiting work; ``use`` blocks used by running work per
priority level (most urgent first); ``uw`` blocks it asked for and was not granted at its last
call; ``td`` tokens wanted per round (compute share); ``loan`` blocks received
through cross-worker preemption that the member may keep above its entitlement while it runs work
at least as urgent as priority ``lp``; ``inbox`` blocks credited by donors since the member's last
call; ``exp`` lease expiry (epoch ms, Redis ``TIME``).

Rules, applied by every script in one atomic step:

* **Lease.** Each call by a member renews its lease (``now + lease_ms``). Every script first
  reclaims members whose lease has lapsed: the member is removed and its blocks return to the
  pool; preemption orders naming it are dropped.
* **Entitlement.** Among live *active* members, the pool's total is split by weight
  (``floor(total * w / sum(w))``; the remainder goes one block each to the largest fractional
  parts, ties by name), water-filled under the cap ``floor(total * cap_permille / 1000)``: a member
  whose share would pass the cap gets the cap and the rest is split among the others. Idle
  members are entitled to nothing, so their share flows to the active ones.
* **Grant.** ``min(want, entitlement - held, total - sum(held))``, never negative, so a grant never
  takes the sum of holdings above the total.
* **Release target.** An idle member is told to release everything. An active member holding
  more than ``entitlement + loan`` is told to give back, out of that excess, what the active
  members below their entitlement still want beyond the free blocks (their unmet asks from their
  last calls): blocks nobody is waiting for stay where they are, so a newcomer with little work
  costs a busy member only what it needs. It preempts and releases at its next step.
* **Preemption.** A member that cannot get the blocks for a waiting request of priority ``p``
  files an order against a donor: the live member, other than itself and with no order pending,
  whose least urgent running work is strictly less urgent than ``p`` (largest priority value
  first), that can free enough blocks (spare blocks plus blocks of work less urgent than ``p``);
  ties go to the member furthest above its entitlement, then by name. The donor's next reply
  carries the order once; whatever it releases while the order is pending is credited to the
  requester directly (reserved: no third member can take it) and becomes the requester's loan.
* **Compute share** (pools with a ``token_budget``): the budget of tokens per ``round_ms`` is split
  by weight among members with token demand, water-filled so nobody gets more than it asked
  for. A member computes at most its share per round (the worker's
  ``tokenfleet.worker.pool.compute_share``).

Invariant, under any interleaving: the sum of ``held`` over the members hash never exceeds
``total`` (grants are bounded by what is free; transfers move blocks; reclaim only lowers it).

Numbers: weights are integers in thousandths (at most 100_000), totals at most
``MAX_TOTAL_BLOCKS`` and members at most ``MAX_MEMBERS`` (the worker's ``pool/config.py``, which
validates a pool's settings before they reach a script), so every product in the scripts stays
below 2**53 and Lua's doubles compute floors and remainders exactly.
"""

from __future__ import annotations

from tokenfleet.shared.keys import Keys, check_name
from tokenfleet.shared.scripts.registry import load_lua

_LUA = "tokenfleet.shared.pool.lua"

POOL_CREATE = load_lua(_LUA, "pool_create.lua")
POOL_JOIN = load_lua(_LUA, "pool_join.lua")
POOL_STEP = load_lua(_LUA, "pool_step.lua")
POOL_LEAVE = load_lua(_LUA, "pool_leave.lua")
POOL_INSPECT = load_lua(_LUA, "pool_inspect.lua")
POOL_ADVANCE_CLOCK = load_lua(_LUA, "pool_advance_clock.lua")


def pool_keys(keys: Keys, name: str) -> list[str]:
    """``KEYS[1..4]`` of the pool scripts (each script's header says which of them it touches)."""
    check_name("pool", name)
    return [keys.pool(name), keys.pool_members(name), keys.pool_preemptions(name), keys.pools]
