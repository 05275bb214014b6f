-- KEYS[1] = pool settings hash (Keys.pool): HGETALL; HINCRBY lapsed_members, reclaimed_blocks;
--           HSET (settings, created_at) when the join creates the pool
-- KEYS[2] = pool members hash (Keys.pool_members): HGETALL, HSET, HDEL
-- KEYS[3] = pool preemption orders hash (Keys.pool_preemptions): HGETALL, HDEL
-- KEYS[4] = set of pool names (Keys.pools): SADD ARGV[11] when the join creates the pool
-- ARGV[1] = member name    ARGV[2] = weight (thousandths)
-- ARGV[3..12] = pool settings as for pool_create ARGV[1..10]; ARGV[3] = 0 joins an existing pool
-- A (re)join starts the member afresh: blocks a previous incarnation held return to the pool and
-- orders naming it are dropped.
-- Returns {"ok", created (1|0), total, block_size, cap, chunk, lease_ms, token_budget,
--          returned blocks, round_ms}; {"pool", message} when the pool is missing or differs.
-- @include prelude.lua

local cfg, created = ensure_pool(3)
if cfg.err then return {'pool', cfg.err} end
local now = now_ms(cfg)
local m, names = load_hash(MEMBERS)
local orders = load_hash(ORDERS)
local live = reclaim(m, names, orders, now, true)
local me, returned = ARGV[1], 0
if m[me] then
  returned = m[me].held
elseif #live >= MAX_MEMBERS then
  return {'pool', 'pool ' .. LABEL .. ' already has ' .. #live .. ' members'}
end
for donor, o in pairs(orders) do
  if donor == me or o.r == me then redis.call('HDEL', ORDERS, donor) end
end
save(me, new_member(tonumber(ARGV[2]), now, cfg.lease_ms))
return {'ok', created, cfg.total, cfg.block_size, cfg.cap, cfg.chunk, cfg.lease_ms,
        cfg.token_budget, returned, cfg.round_ms}
