-- KEYS[1] = pool settings hash (Keys.pool): HGETALL; HINCRBY order_seq, lapsed_members,
--           reclaimed_blocks
-- KEYS[2] = pool members hash (Keys.pool_members): HGETALL, HSET, HDEL
-- KEYS[3] = pool preemption orders hash (Keys.pool_preemptions): HGETALL, HSET, HDEL
-- KEYS[4] = set of pool names (Keys.pools): passed (pool_keys), not touched
-- ARGV[1] = member name      ARGV[2] = weight (thousandths)
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
--          now ms}; {"pool", message} when the pool is missing or full.
-- @include prelude.lua

local cfg = load_cfg()
if not cfg then return {'pool', 'pool ' .. LABEL .. ' does not exist'} end
local now = now_ms(cfg)
local m, names = load_hash(MEMBERS)
local orders = load_hash(ORDERS)
local live = reclaim(m, names, orders, now, true)
local name = ARGV[1]
local me, rejoined = m[name], 0
if not me then
  if #live >= MAX_MEMBERS then
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
