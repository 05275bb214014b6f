-- KEYS[1] = pool settings hash (Keys.pool): HGETALL; HINCRBY lapsed_members, reclaimed_blocks
-- KEYS[2] = pool members hash (Keys.pool_members): HGETALL, HDEL
-- KEYS[3] = pool preemption orders hash (Keys.pool_preemptions): HGETALL, HDEL
-- KEYS[4] = set of pool names (Keys.pools): passed (pool_keys), not touched
-- ARGV[1] = member name
-- Removes the member: its blocks return to the pool, orders naming it are dropped.
-- Returns {"ok", blocks returned} ({"ok", 0} when the pool does not exist).
-- @include prelude.lua

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
