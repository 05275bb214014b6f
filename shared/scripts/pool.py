"""Shared KV pools: the atomic accounting scripts (issue 6).

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
  for. A member computes at most its share per round (``tokenfleet.worker.compute_share``).

Invariant, under any interleaving: the sum of ``held`` over the members hash never exceeds
``total`` (grants are bounded by what is free; transfers move blocks; reclaim only lowers it).

Numbers: weights are integers in thousandths (at most 100_000), totals at most ``MAX_TOTAL_BLOCKS``
and members at most ``MAX_MEMBERS``, so every product in the scripts stays below 2**53 and Lua's
doubles compute floors and remainders exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys, check_name
from tokenfleet.shared.scripts.registry import LuaScript

MAX_TOTAL_BLOCKS = 100_000_000
MAX_MEMBERS = 256
MAX_WEIGHT = 100.0
DEFAULT_ROUND_MS = 100  # a compute share's period when the pool was created without one
CLOCKS = ("redis", "manual")

# Functions every pool script uses. Pasted after each script's KEYS/ARGV header.
_PRELUDE = (
    """
local POOL, MEMBERS, ORDERS = KEYS[1], KEYS[2], KEYS[3]
-- The pool's name for messages: the last segment of its key (names hold no ':').
local LABEL = string.match(POOL, '([^:]+)$') or POOL
local NUMERIC = {'total', 'block_size', 'cap_permille', 'chunk', 'lease_ms', 'preempt_ms',
                 'token_budget', 'round_ms', 'manual_now_ms', 'created_at', 'order_seq',
                 'reclaimed_blocks', 'lapsed_members'}

local function load_cfg()
  local flat = redis.call('HGETALL', POOL)
  if #flat == 0 then return nil end
  local cfg = {}
  for i = 1, #flat, 2 do cfg[flat[i]] = flat[i + 1] end
  for _, k in ipairs(NUMERIC) do cfg[k] = tonumber(cfg[k]) or 0 end
  if cfg.round_ms <= 0 then cfg.round_ms = """
    + str(DEFAULT_ROUND_MS)
    + """ end
  cfg.cap = math.max(1, math.floor(cfg.total * cfg.cap_permille / 1000))
  return cfg
end

local function now_ms(cfg)
  if cfg.clock == 'manual' then return cfg.manual_now_ms end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function load_hash(key)
  local flat = redis.call('HGETALL', key)
  local out, names = {}, {}
  for i = 1, #flat, 2 do
    out[flat[i]] = cjson.decode(flat[i + 1])
    names[#names + 1] = flat[i]
  end
  table.sort(names)
  return out, names
end

-- Drop lapsed members (their blocks return) and orders that name a gone member or lapsed.
-- Returns the sorted names of live members. Writes only when `write` is true.
local function reclaim(m, names, orders, now, write)
  local live = {}
  for _, n in ipairs(names) do
    local s = m[n]
    if s.exp <= now then
      m[n] = nil
      if write then
        redis.call('HDEL', MEMBERS, n)
        redis.call('HINCRBY', POOL, 'lapsed_members', 1)
        if s.held > 0 then redis.call('HINCRBY', POOL, 'reclaimed_blocks', s.held) end
      end
    else
      live[#live + 1] = n
    end
  end
  for donor, o in pairs(orders) do
    if m[donor] == nil or m[o.r] == nil or o.exp <= now then
      orders[donor] = nil
      if write then redis.call('HDEL', ORDERS, donor) end
    end
  end
  return live
end

-- Weighted split of `total` among `names` (sorted), water-filled under cap_of[name]:
-- floor shares, remainder one each by largest fractional part then name.
local function split(total, names, weight_of, cap_of)
  local share, open, remaining = {}, {}, total
  for _, n in ipairs(names) do open[#open + 1] = n end
  while #open > 0 do
    local wsum = 0
    for _, n in ipairs(open) do wsum = wsum + weight_of[n] end
    local rest, capped = {}, 0
    for _, n in ipairs(open) do
      if remaining * weight_of[n] >= cap_of[n] * wsum then
        share[n] = cap_of[n]
        capped = capped + cap_of[n]
      else
        rest[#rest + 1] = n
      end
    end
    if #rest == #open then
      local given, frac = 0, {}
      for _, n in ipairs(open) do
        local p = remaining * weight_of[n]
        local q = math.floor(p / wsum)
        share[n] = q
        given = given + q
        frac[#frac + 1] = {n, p - q * wsum}
      end
      table.sort(frac, function(a, b)
        if a[2] ~= b[2] then return a[2] > b[2] end
        return a[1] < b[1]
      end)
      for i = 1, remaining - given do share[frac[i][1]] = share[frac[i][1]] + 1 end
      break
    end
    remaining = remaining - capped
    open = rest
  end
  return share
end

local function block_entitlements(cfg, m, live)
  local active, w, cap = {}, {}, {}
  for _, n in ipairs(live) do
    if m[n].act == 1 then
      active[#active + 1] = n
      w[n] = m[n].w
      cap[n] = cfg.cap
    end
  end
  local share = split(cfg.total, active, w, cap)
  for _, n in ipairs(live) do share[n] = share[n] or 0 end
  return share, #active
end

local function token_shares(cfg, m, live)
  if cfg.token_budget <= 0 then return nil end
  local asking, w, cap = {}, {}, {}
  for _, n in ipairs(live) do
    if m[n].td > 0 then
      asking[#asking + 1] = n
      w[n] = m[n].w
      cap[n] = math.min(m[n].td, cfg.token_budget)
    end
  end
  local share = split(cfg.token_budget, asking, w, cap)
  for _, n in ipairs(live) do share[n] = share[n] or 0 end
  return share
end

local function sum_held(m, live)
  local t = 0
  for _, n in ipairs(live) do t = t + m[n].held end
  return t
end

local function used(s)
  local t = 0
  for _, u in ipairs(s.use) do t = t + u end
  return t
end

-- Least urgent priority with running work, or -1 when nothing runs.
local function least_urgent(s)
  local lu = -1
  for i, u in ipairs(s.use) do if u > 0 then lu = i - 1 end end
  return lu
end

-- Blocks a donor can give up for a request of priority p: spare plus work less urgent than p.
local function freeable(s, p)
  local f = math.max(0, s.held - used(s))
  for i, u in ipairs(s.use) do if i - 1 > p then f = f + u end end
  return math.min(f, s.held)
end

local function new_member(w, now, lease_ms)
  return {w = w, held = 0, act = 0, use = {}, td = 0, loan = 0, lp = 0, inbox = 0, uw = 0,
          exp = now + lease_ms}
end

local function save(name, s) redis.call('HSET', MEMBERS, name, cjson.encode(s)) end

-- Create the pool from ARGV[first..first+9] unless it exists; returns (cfg, created) or an
-- error reply as the first value's 'err' field.
local function ensure_pool(first)
  local total, block_size = tonumber(ARGV[first]), tonumber(ARGV[first + 1])
  local cfg = load_cfg()
  if cfg then
    if total > 0 and (cfg.total ~= total or cfg.block_size ~= block_size) then
      return {err = 'pool ' .. LABEL .. ' exists with ' .. cfg.total .. ' blocks of ' ..
              cfg.block_size .. ' tokens; asked for ' .. total .. ' blocks of ' .. block_size}
    end
    return cfg, 0
  end
  if total <= 0 then
    return {err = 'pool ' .. LABEL .. ' does not exist: create it with tokenfleet pool create ' ..
            'or give the first member its size'}
  end
  redis.call('HSET', POOL, 'total', total, 'block_size', block_size,
             'cap_permille', ARGV[first + 2], 'chunk', ARGV[first + 3],
             'lease_ms', ARGV[first + 4], 'preempt_ms', ARGV[first + 5],
             'token_budget', ARGV[first + 6], 'clock', ARGV[first + 7],
             'round_ms', ARGV[first + 9],
             'manual_now_ms', 0, 'order_seq', 0, 'reclaimed_blocks', 0, 'lapsed_members', 0)
  cfg = load_cfg()
  local now = now_ms(cfg)
  redis.call('HSET', POOL, 'created_at', now)
  redis.call('SADD', KEYS[4], ARGV[first + 8])
  cfg.created_at = now
  return cfg, 1
end
"""
)


def _script(name: str, header: str, body: str, ok_codes: frozenset[str] | None = None) -> LuaScript:
    source = header.strip("\n") + "\n" + _PRELUDE + body
    if ok_codes is None:
        return LuaScript(name=name, source=source)
    return LuaScript(name=name, source=source, ok_codes=ok_codes)


_POOL_KEYS_HEADER = """
-- KEYS[1] = pool settings hash        KEYS[2] = pool members hash
-- KEYS[3] = pool preemption orders hash
"""

POOL_CREATE = _script(
    "pool_create",
    _POOL_KEYS_HEADER
    + """-- KEYS[4] = set of pool names
-- ARGV[1] = total blocks   ARGV[2] = block size (tokens)   ARGV[3] = cap (permille of total)
-- ARGV[4] = chunk (blocks) ARGV[5] = lease ms   ARGV[6] = preemption order timeout ms
-- ARGV[7] = token budget per round (0: no compute share)   ARGV[8] = clock: redis | manual
-- ARGV[9] = pool name (for the set of pools)   ARGV[10] = round ms (the token budget's period)
-- Returns {"ok", created (1|0), total, block_size}; {"pool", message} if it exists with another
-- total or block size.
""",
    """
local cfg, created = ensure_pool(1)
if cfg.err then return {'pool', cfg.err} end
return {'ok', created, cfg.total, cfg.block_size}
""",
)

POOL_JOIN = _script(
    "pool_join",
    _POOL_KEYS_HEADER
    + """-- KEYS[4] = set of pool names
-- ARGV[1] = member name    ARGV[2] = weight (thousandths)
-- ARGV[3..12] = pool settings as for pool_create ARGV[1..10]; ARGV[3] = 0 joins an existing pool
-- A (re)join starts the member afresh: blocks a previous incarnation held return to the pool and
-- orders naming it are dropped.
-- Returns {"ok", created (1|0), total, block_size, cap, chunk, lease_ms, token_budget,
--          returned blocks, round_ms}; {"pool", message} when the pool is missing or differs.
""",
    """
local cfg, created = ensure_pool(3)
if cfg.err then return {'pool', cfg.err} end
local now = now_ms(cfg)
local m, names = load_hash(MEMBERS)
local orders = load_hash(ORDERS)
local live = reclaim(m, names, orders, now, true)
local me, returned = ARGV[1], 0
if m[me] then
  returned = m[me].held
elseif #live >= """
    + str(MAX_MEMBERS)
    + """ then
  return {'pool', 'pool ' .. LABEL .. ' already has ' .. #live .. ' members'}
end
for donor, o in pairs(orders) do
  if donor == me or o.r == me then redis.call('HDEL', ORDERS, donor) end
end
save(me, new_member(tonumber(ARGV[2]), now, cfg.lease_ms))
return {'ok', created, cfg.total, cfg.block_size, cfg.cap, cfg.chunk, cfg.lease_ms,
        cfg.token_budget, returned, cfg.round_ms}
""",
)

POOL_STEP = _script(
    "pool_step",
    _POOL_KEYS_HEADER
    + """-- ARGV[1] = member name      ARGV[2] = weight (thousandths)
-- ARGV[3] = active (1: has running or waiting work, 0: idle)
-- ARGV[4] = want: blocks to acquire now          ARGV[5] = release: blocks given back now
-- ARGV[6] = ask priority ('' for none): a waiting request of this priority cannot get blocks
-- ARGV[7] = ask blocks: how many more blocks that request needs (0: no ask)
-- ARGV[8] = token demand: tokens wanted per round (0: none)
-- ARGV[9..] = blocks used by running work per priority level, most urgent first
-- The call is also the member's heartbeat; an unknown (lapsed) member is re-registered with
-- nothing held.
-- Returns {"ok", held, granted, transferred, released, entitlement, release_to, loan, total,
--          free, active members, token budget or nil, order id (0: none), order blocks,
--          order priority, order requester, filed donor (''), pending donor (''), rejoined,
--          now ms}
""",
    """
local cfg = load_cfg()
if not cfg then return {'pool', 'pool ' .. LABEL .. ' does not exist'} end
local now = now_ms(cfg)
local m, names = load_hash(MEMBERS)
local orders = load_hash(ORDERS)
local live = reclaim(m, names, orders, now, true)
local name = ARGV[1]
local me, rejoined = m[name], 0
if not me then
  if #live >= """
    + str(MAX_MEMBERS)
    + """ then
    return {'pool', 'pool ' .. LABEL .. ' already has ' .. #live .. ' members'}
  end
  me = new_member(tonumber(ARGV[2]), now, cfg.lease_ms)
  m[name] = me
  live[#live + 1] = name
  table.sort(live)
  rejoined = 1
end
me.w = tonumber(ARGV[2])
me.act = tonumber(ARGV[3])
me.td = tonumber(ARGV[8])
me.exp = now + cfg.lease_ms
local use = {}
for i = 9, #ARGV do use[#use + 1] = tonumber(ARGV[i]) end
me.use = use
local ask_p, ask_n = tonumber(ARGV[6]), tonumber(ARGV[7])
if not ask_p then ask_n = 0 end

-- 1. release; while an order against me is pending, what I free goes to its requester
local released = math.min(tonumber(ARGV[5]), me.held)
me.held = me.held - released
me.loan = math.max(0, me.loan - released)
local order = orders[name]
if order and released > 0 then
  local credit = math.min(released, order.n)
  local req = m[order.r]
  if req.loan == 0 then req.lp = order.p else req.lp = math.max(req.lp, order.p) end
  req.held = req.held + credit
  req.loan = req.loan + credit
  req.inbox = req.inbox + credit
  save(order.r, req)
  redis.call('HDEL', ORDERS, name)
  orders[name] = nil
end

-- 2. a loan protects only blocks of work at least as urgent as its priority
if me.act == 0 then me.loan = 0 end
if me.loan > 0 then
  local urgent = 0
  for i, u in ipairs(me.use) do if i - 1 <= me.lp then urgent = urgent + u end end
  if ask_n > 0 and ask_p <= me.lp then urgent = urgent + ask_n end
  me.loan = math.min(me.loan, urgent)
end

-- 3. entitlement and grant
local ent, n_active = block_entitlements(cfg, m, live)
local e = ent[name]
local free = cfg.total - sum_held(m, live)
local granted = math.max(0, math.min(tonumber(ARGV[4]), e - me.held, free))
me.held = me.held + granted
free = free - granted
me.uw = 0
if me.act == 1 then me.uw = tonumber(ARGV[4]) - granted end
local transferred = me.inbox
me.inbox = 0

-- 4. cross-worker preemption: file one order when the ask is still short
local filed, pending = '', ''
for donor, o in pairs(orders) do
  if o.r == name then pending = donor end
end
local short = ask_n - granted - transferred
if pending == '' and short > 0 then
  local best, best_lu, best_over = nil, -1, 0
  for _, d in ipairs(live) do
    local s = m[d]
    if d ~= name and not orders[d] then
      local lu = least_urgent(s)
      if lu > ask_p and freeable(s, ask_p) >= short then
        local over = s.held - ent[d]
        if lu > best_lu or (lu == best_lu and over > best_over) then
          best, best_lu, best_over = d, lu, over
        end
      end
    end
  end
  if best then
    local id = redis.call('HINCRBY', POOL, 'order_seq', 1)
    local o = {id = id, r = name, p = ask_p, n = short, at = now,
               exp = now + cfg.preempt_ms, sent = 0}
    redis.call('HSET', ORDERS, best, cjson.encode(o))
    orders[best] = o
    filed, pending = best, best
  end
elseif pending ~= '' and ask_n == 0 and orders[pending].sent == 0 then
  -- no longer needed and the donor has not seen it yet
  redis.call('HDEL', ORDERS, pending)
  orders[pending] = nil
  pending = ''
end

-- 5. an order against me is delivered once
local oid, on, op, oreq = 0, 0, 0, ''
order = orders[name]
if order and order.sent == 0 then
  order.sent = 1
  redis.call('HSET', ORDERS, name, cjson.encode(order))
  oid, on, op, oreq = order.id, order.n, order.p, order.r
end

-- 6. release target: an idle member gives everything back; a member above its entitlement
-- (plus loan) gives back what active members below theirs still want beyond the free blocks
local release_to = 0
if me.act == 1 then
  release_to = me.held
  local excess = me.held - (e + me.loan)
  if excess > 0 then
    local pressure = -free
    for _, n in ipairs(live) do
      local s = m[n]
      if n ~= name and s.act == 1 then
        pressure = pressure + math.min(s.uw or 0, math.max(0, ent[n] - s.held))
      end
    end
    release_to = me.held - math.min(excess, math.max(0, pressure))
  end
end
local tokens = token_shares(cfg, m, live)
local budget = false
if tokens then budget = tokens[name] end
save(name, me)
return {'ok', me.held, granted, transferred, released, e, release_to, me.loan, cfg.total,
        free, n_active, budget, oid, on, op, oreq, filed, pending, rejoined, now}
""",
)

POOL_LEAVE = _script(
    "pool_leave",
    _POOL_KEYS_HEADER
    + """-- ARGV[1] = member name
-- Removes the member: its blocks return to the pool, orders naming it are dropped.
-- Returns {"ok", blocks returned}.
""",
    """
local cfg = load_cfg()
if not cfg then return {'ok', 0} end
local now = now_ms(cfg)
local m, names = load_hash(MEMBERS)
local orders = load_hash(ORDERS)
reclaim(m, names, orders, now, true)
local me = ARGV[1]
local returned = 0
if m[me] then
  returned = m[me].held
  redis.call('HDEL', MEMBERS, me)
end
for donor, o in pairs(orders) do
  if donor == me or o.r == me then redis.call('HDEL', ORDERS, donor) end
end
return {'ok', returned}
""",
)

POOL_INSPECT = _script(
    "pool_inspect",
    _POOL_KEYS_HEADER
    + """-- Read-only: the pool as the next call would see it (lapsed members left out), with each
-- member's entitlement and token share computed.
-- Returns {"ok", JSON}; {"pool", message} when the pool does not exist.
""",
    """
local cfg = load_cfg()
if not cfg then return {'pool', 'pool ' .. LABEL .. ' does not exist'} end
local now = now_ms(cfg)
local m, names = load_hash(MEMBERS)
local orders = load_hash(ORDERS)
local live = reclaim(m, names, orders, now, false)
local ent, n_active = block_entitlements(cfg, m, live)
local tokens = token_shares(cfg, m, live)
local members = {}
for _, n in ipairs(live) do
  local s = m[n]
  local use = {}
  for i, u in ipairs(s.use) do use[i] = u end
  members[#members + 1] = {name = n, weight_milli = s.w, held = s.held, active = s.act,
    entitlement = ent[n], loan = s.loan, loan_priority = s.lp, used = used(s),
    blocks_by_priority = use, token_demand = s.td,
    token_budget = tokens and tokens[n] or cjson.null, lease_left_ms = s.exp - now,
    unmet_want = s.uw or 0}
end
local pending = {}
for donor, o in pairs(orders) do
  pending[#pending + 1] = {id = o.id, donor = donor, requester = o.r, priority = o.p,
    blocks = o.n, age_ms = now - o.at, delivered = o.sent}
end
local view = {total = cfg.total, block_size = cfg.block_size, cap_permille = cfg.cap_permille,
  cap = cfg.cap, chunk = cfg.chunk, lease_ms = cfg.lease_ms, preempt_ms = cfg.preempt_ms,
  token_budget = cfg.token_budget, round_ms = cfg.round_ms, clock = cfg.clock,
  created_at = cfg.created_at,
  now_ms = now, held = sum_held(m, live), active_members = n_active,
  reclaimed_blocks = cfg.reclaimed_blocks, lapsed_members = cfg.lapsed_members,
  members = members, preemptions = pending}
return {'ok', cjson.encode(view)}
""",
)

POOL_ADVANCE_CLOCK = _script(
    "pool_advance_clock",
    """
-- KEYS[1] = pool settings hash
-- ARGV[1] = milliseconds to add to the pool's manual clock
-- Only pools created with clock=manual (deterministic tests and simulations) have this clock.
-- Returns {"ok", new now ms}; {"pool", message} for a missing pool or one on the Redis clock.
""",
    """
local clock = redis.call('HGET', KEYS[1], 'clock')
if clock ~= 'manual' then
  return {'pool', 'pool ' .. LABEL .. ' does not run on a manual clock'}
end
return {'ok', redis.call('HINCRBY', KEYS[1], 'manual_now_ms', ARGV[1])}
""",
)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A pool's settings, validated; what ``tokenfleet pool create`` (or a first member) writes.

    Attributes:
        total_blocks: the pool's size in KV blocks of ``block_size`` tokens.
        block_size: tokens per KV block; every member must use the same.
        cap_permille: no member is entitled to more than this share of the total (thousandths).
        chunk_blocks: the step in which members ask ahead and the fairness tolerance.
        lease_ms: a member's holding lapses this long after its last call.
        preempt_ms: a preemption order lapses if the donor has not released within this time.
        token_budget: tokens per round split between members by weight (0: no compute share):
            what the shared device computes in ``round_ms``.
        round_ms: the compute share's period: a member computes at most its share of
            ``token_budget`` per ``round_ms`` of wall time.
        clock: ``redis`` (server ``TIME``) or ``manual`` (advanced only by
            :data:`POOL_ADVANCE_CLOCK`; for deterministic tests and simulations).
    """

    total_blocks: int
    block_size: int = 16
    cap_permille: int = 900
    chunk_blocks: int = 16
    lease_ms: int = 5_000
    preempt_ms: int = 2_000
    token_budget: int = 0
    clock: str = "redis"
    round_ms: int = DEFAULT_ROUND_MS

    def __post_init__(self) -> None:
        _check_int("total_blocks", self.total_blocks, 1, MAX_TOTAL_BLOCKS)
        _check_int("block_size", self.block_size, 1, 1 << 16)
        _check_int("cap_permille", self.cap_permille, 1, 1000)
        _check_int("chunk_blocks", self.chunk_blocks, 1, self.total_blocks)
        _check_int("lease_ms", self.lease_ms, 1, 86_400_000)
        _check_int("preempt_ms", self.preempt_ms, 1, 86_400_000)
        _check_int("token_budget", self.token_budget, 0, 1 << 30)
        _check_int("round_ms", self.round_ms, 1, 60_000)
        if self.clock not in CLOCKS:
            raise InvalidRequest(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")

    def args(self, name: str) -> list[str]:
        """The ten settings arguments of :data:`POOL_CREATE` (``ARGV[1..10]``)."""
        return [
            str(self.total_blocks),
            str(self.block_size),
            str(self.cap_permille),
            str(self.chunk_blocks),
            str(self.lease_ms),
            str(self.preempt_ms),
            str(self.token_budget),
            self.clock,
            name,
            str(self.round_ms),
        ]


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def weight_milli(weight: float) -> int:
    """A share weight in thousandths, as the scripts store it; ``InvalidRequest`` if out of
    range (0.001 to 100)."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise InvalidRequest(f"share weight must be a number, got {weight!r}")
    milli = round(weight * 1000)
    if not 1 <= milli <= round(MAX_WEIGHT * 1000):
        raise InvalidRequest(f"share weight must be between 0.001 and {MAX_WEIGHT:g}, got {weight}")
    return milli


def pool_keys(keys: Keys, name: str) -> list[str]:
    """``KEYS[1..4]`` of the pool scripts (scripts that need fewer ignore the rest)."""
    check_name("pool", name)
    return [keys.pool(name), keys.pool_members(name), keys.pool_preemptions(name), keys.pools]
