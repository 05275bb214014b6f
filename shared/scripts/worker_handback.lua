-- KEYS[1] = request record hash          KEYS[2] = queue stream of the entry
-- KEYS[3] = stream to re-queue into (optional; absent: KEYS[2]): the shared stream of the
--           request's queue when the entry is in a routed one (a handback goes to any worker)
-- ARGV[1] = request id                   ARGV[2] = worker name
-- ARGV[3] = stream entry id              ARGV[4] = consumer group name
-- ARGV[5] = entry field d (payload)
-- ARGV[6] = entry field t (the tenant whose queue admitted it, docs/fairness.md), ARGV[7] =
--           entry field n (its prompt tokens): optional, kept on the new entry when not ""
-- Returns {"ok", new_entry_id}: the request is queued again at the tail of its stream (the
-- handback does not count as an attempt; its deadline is dropped, field "deadline" and the new
-- entry's dl, because it has started; the new entry has h = 1: its record may hold tokens to
-- resume from); or {"lost"} if the caller no longer runs it (a terminal record's entry is still
-- acked and deleted).
local h = redis.call('HMGET', KEYS[1], 'status', 'worker')
if h[1] ~= 'running' or h[2] ~= ARGV[2] then
  if h[1] and h[1] ~= 'running' and h[1] ~= 'queued' then
    redis.call('XACK', KEYS[2], ARGV[4], ARGV[3])
    redis.call('XDEL', KEYS[2], ARGV[3])
  end
  return {'lost'}
end
local target = KEYS[2]
if KEYS[3] then
  target = KEYS[3]
end
local new
if ARGV[6] and ARGV[6] ~= '' then  -- (no tenant queue again: it was admitted once)
  new = redis.call('XADD', target, '*', 'id', ARGV[1], 'd', ARGV[5], 'dl', '', 'h', '1',
                   't', ARGV[6], 'n', ARGV[7] or '0')
else
  new = redis.call('XADD', target, '*', 'id', ARGV[1], 'd', ARGV[5], 'dl', '', 'h', '1')
end
redis.call('XACK', KEYS[2], ARGV[4], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '', 'stream_id', new, 'routed_to', '')
redis.call('HDEL', KEYS[1], 'deadline')
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
return {'ok', new}
