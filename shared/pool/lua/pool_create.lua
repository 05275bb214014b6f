-- KEYS[1] = pool settings hash (Keys.pool): HGETALL; HSET (settings, created_at) when created
-- KEYS[2] = pool members hash (Keys.pool_members): not touched
-- KEYS[3] = pool preemption orders hash (Keys.pool_preemptions): not touched
-- KEYS[4] = set of pool names (Keys.pools): SADD ARGV[9] when created
-- ARGV[1] = total blocks   ARGV[2] = block size (tokens)   ARGV[3] = cap (permille of total)
-- ARGV[4] = chunk (blocks) ARGV[5] = lease ms   ARGV[6] = preemption order timeout ms
-- ARGV[7] = token budget per round (0: no compute share)   ARGV[8] = clock: redis | manual
-- ARGV[9] = pool name (for the set of pools)   ARGV[10] = round ms (the token budget's period)
-- Creates the pool unless it exists.
-- Returns {"ok", created (1|0), total, block_size}; {"pool", message} if it exists with another
-- total or block size.
-- @include prelude.lua

local cfg, created = ensure_pool(1)
if cfg.err then return {'pool', cfg.err} end
return {'ok', created, cfg.total, cfg.block_size}
