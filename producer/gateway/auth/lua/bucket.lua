-- KEYS: none of its own (an include, not a script: api_key_admit.lua and api_key_settle.lua
--       paste it after their own KEYS/ARGV header with `-- @include bucket.lua`).
-- The token-bucket arithmetic of API-key quotas; the algorithm is written out in
-- tokenfleet.producer.gateway.auth.quota (its docstring). Expects KEYS[1] = the API key's hash
-- (Keys.api_key); builds no key name.
-- A bucket's level counts units of 1/SCALE of a request (or token); a limit of L per minute
-- refills exactly L units per millisecond, so all of this is integer arithmetic, exact in Lua's
-- doubles (limits are at most 1e9: levels stay below 2**53).
-- Mirrors quota.SCALE and quota.PERIOD_MS (a test checks that they agree).
local SCALE = 60000
local PERIOD_MS = 60000
local KEY = KEYS[1]

-- Now in ms: ARGV's test clock when one is given, else Redis TIME (one clock for every gateway).
local function now_ms(test_now)
  if test_now ~= nil and test_now ~= '' then return tonumber(test_now) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A level refilled for `elapsed` ms, capped at the capacity; a bucket never used is full; an
-- unlimited dimension (limit 0) has no bucket: level 0, never checked.
local function refill(level, limit, elapsed)
  if limit <= 0 then return 0 end
  if level == nil then return limit * SCALE end
  return math.min(limit * SCALE, level + elapsed * limit)
end

-- The key's limits and both buckets refilled to `now`; nil when the key has no live record
-- (no digest: never created, or revoked).
local function load_buckets(now)
  local f = redis.call('HMGET', KEY, 'digest', 'rpm', 'tpm', 'rq', 'tk', 'ts')
  if not f[1] then return nil end
  local b = {rpm = tonumber(f[2]) or 0, tpm = tonumber(f[3]) or 0}
  -- Never negative (a clock that stepped back refills nothing) and at most two periods: enough
  -- to refill the deepest debt (-capacity) to full, and it keeps elapsed * limit small.
  local elapsed = 2 * PERIOD_MS
  local ts = tonumber(f[6])
  if ts then elapsed = math.max(0, math.min(now - ts, 2 * PERIOD_MS)) end
  b.rq = refill(tonumber(f[4]), b.rpm, elapsed)
  b.tk = refill(tonumber(f[5]), b.tpm, elapsed)
  return b
end

-- Both levels as of `now` (they share one timestamp); a key with no limit keeps no state.
local function save(b, now)
  if b.rpm <= 0 and b.tpm <= 0 then return end
  redis.call('HSET', KEY, 'rq', b.rq, 'tk', b.tk, 'ts', now)
end
