-- KEYS[1] = pool settings hash (Keys.pool): HGET clock, HINCRBY manual_now_ms
-- KEYS[2..4] = as for the other pool scripts (pool_keys): passed, not touched
-- ARGV[1] = milliseconds to add to the pool's manual clock
-- Only pools created with clock=manual (deterministic tests and simulations) have this clock.
-- Returns {"ok", new now ms}; {"pool", message} for a missing pool or one on the Redis clock.
-- @include prelude.lua

local clock = redis.call('HGET', KEYS[1], 'clock')
if clock ~= 'manual' then
  return {'pool', 'pool ' .. LABEL .. ' does not run on a manual clock'}
end
return {'ok', redis.call('HINCRBY', KEYS[1], 'manual_now_ms', ARGV[1])}
