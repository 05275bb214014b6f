-- KEYS[3i-2] = request i's record hash   KEYS[3i-1] = request i's token list
-- KEYS[3i]   = request i's channel       (i = 1 .. #KEYS / 3)
-- ARGV[1] = worker name                  ARGV[2] = now (epoch seconds)
-- ARGV[3] = record TTL in seconds
-- ARGV[4] = publish command for the channels (PUBLISH, or SPUBLISH on a Redis Cluster)
-- ARGV[5..] = for each request i, in KEYS order: the index of its first event, the number of
--             its events c, then its c encoded token events in index order
-- Returns {"ok", reply_1, ..., reply_n}, one reply per request: {"ok"} (also when the list
-- already ends with exactly these events: an earlier try of the same round trip ran and its
-- reply was lost, so the worker's resend after a Redis outage writes nothing twice); {"lost", status,
-- holder} if the caller no longer runs it (another worker holds it, it was handed back, or it
-- ended); or {"corrupt", cause} if its state is poisoned: the record is gone or has a status no
-- request has, or it is the caller's but its list does not end at its first index (the caller
-- ends it error / corrupt_state). Nothing is written for a request unless its reply is "ok".
-- One engine step's tokens, every request of the step in one call (one script run per step
-- instead of one per request: less work for Redis and one reply for the worker to read).
local known = {queued = true, running = true, done = true, cancelled = true, expired = true,
               dropped = true, error = true}
local out = {'ok'}
local a = 5
local sharded = ARGV[4] == 'SPUBLISH'  -- a Redis Cluster: sharded pub/sub
for i = 1, #KEYS / 3 do
  local rec, list, ch = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local first, count = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local ev = a + 2
  a = ev + count
  local h = redis.call('HMGET', rec, 'status', 'worker')
  if not h[1] then
    out[i + 1] = {'corrupt', 'its record is gone while it ran (deleted, its TTL lapsed, or Redis lost it)'}
  elseif not known[h[1]] then
    out[i + 1] = {'corrupt', "its record's status '" .. h[1] .. "' is not a request status"}
  elseif h[1] ~= 'running' or h[2] ~= ARGV[1] then
    out[i + 1] = {'lost', tostring(h[1]), tostring(h[2])}
  else
    local n = redis.call('LLEN', list)
    local again = false  -- the list already ends with exactly these events: an earlier try ran
    if n == first + count and count > 0 then
      local tail = redis.call('LRANGE', list, first, n - 1)
      again = true
      for j = 1, count do
        if tail[j] ~= ARGV[ev + j - 1] then again = false end
      end
    end
    if again then
      out[i + 1] = {'ok'}  -- its reply was lost (a Redis outage): nothing to write twice
    elseif n ~= first then
      out[i + 1] = {'corrupt', 'its token list holds ' .. n .. ' events where this worker '
                    .. 'had published ' .. first}
    else
      for j = ev, a - 1 do
        redis.call('RPUSH', list, ARGV[j])
        if sharded then
          redis.call('SPUBLISH', ch, ARGV[j])
        else
          redis.call('PUBLISH', ch, ARGV[j])
        end
      end
      redis.call('HSET', rec, 'num_tokens', n + count)
      if first == 0 then
        redis.call('HSET', rec, 'first_token_at', ARGV[2])
        redis.call('EXPIRE', list, ARGV[3])
      end
      out[i + 1] = {'ok'}
    end
  end
end
return out
