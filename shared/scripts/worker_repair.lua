-- KEYS[1] = request record hash          KEYS[2] = request token list
-- KEYS[3] = request channel              KEYS[4] = the stream this worker's entry is in
-- KEYS[5] = the stream of the entry the record names, when it is another one (a resubmission;
--           else KEYS[4])                 KEYS[6] = cancel set
-- KEYS[7] = queue ends hash (Keys.tally)
-- ARGV[1] = worker name                  ARGV[2] = now (epoch seconds)
-- ARGV[3] = record TTL in seconds        ARGV[4] = publish command (PUBLISH, or SPUBLISH)
-- ARGV[5] = consumer group name          ARGV[6] = request id
-- ARGV[7] = "running" (this worker runs it) or "finished" (it ended it: ARGV[13..14])
-- ARGV[8] = n: the token events this worker published (indices 0 .. n-1)
-- ARGV[9] = from: the index of the first event sent below (events before it are taken to be
--           in the list already: the caller read its length; a shorter list answers "retry")
-- ARGV[10] = this worker's attempt (its START's count)
-- ARGV[11] = this worker's entry id      ARGV[12] = the entry id the record named when the
--            caller read it, if another one (dropped: a resubmission), else ""
-- ARGV[13] = terminal status ("" while running)   ARGV[14] = encoded terminal event (or "")
-- ARGV[15] = R, then R field/value pairs: the record as this worker knows it (written when the
--            record is gone: model, priority, started_at, ...)
-- then E, then E field/value pairs: its entry's fields (re-added when the entry is gone)
-- then T, then T field/value pairs: the terminal fields (text, finish_reason, usage, ...)
-- then the encoded token events from index ``from`` to n-1
-- Puts back what a rollback (a failover, a restart from an older snapshot or AOF) took from a
-- request this worker runs or ended, from the worker's own memory; atomic and idempotent (run
-- twice, the second run changes nothing). An end written again is counted in the tally like any
-- end (the rollback took its count too); an ``error`` end leaves no second dead letter (the first
-- is in the dead-letter stream unless the rollback took it as well). Returns one of
--   {"ok", pushed, rewrote, ended, dropped, new_entry}: restored (or nothing to do): ``pushed``
--       token events appended (and published: live subscribers fill their gap, dropping indices
--       they have), ``rewrote`` 1 if the record was written again (gone, rolled back to queued,
--       or held by another worker that was behind), ``ended`` 1 if the terminal state was
--       written again (and published once more), ``dropped`` entries acked and deleted (one
--       that reappeared, a resubmission's), ``new_entry`` the id of the entry re-added for a
--       running request whose entry is gone (the caller's job takes it), or ""
--   {"retry"}          the list is shorter than ``from`` (it changed since the caller read it)
--   {"yield", why}     it is not this worker's to restore: another worker holds it as far or
--                      further along, or it ended otherwise (cancelled, ...) meanwhile
--   {"divergent", why} the list holds events this worker did not publish: nothing is written
-- @include tf_finish.lua

local worker, now, ttl, publish, group = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local mode, n, from = ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local mine, sid, other = tonumber(ARGV[10]), ARGV[11], ARGV[12]
local a = 15
local function pairs_at()
  local count = tonumber(ARGV[a])
  local out = {}
  for i = a + 1, a + 2 * count do out[#out + 1] = ARGV[i] end
  a = a + 2 * count + 1
  return out
end
local record_fields = pairs_at()
local entry_fields = pairs_at()
local end_fields = pairs_at()
local ev = a  -- ARGV[ev + j] is the event with index from + j

local h = redis.call('HMGET', KEYS[1], 'status', 'worker', 'stream_id', 'attempts')
local status, holder = h[1], h[2] or ''
local length = redis.call('LLEN', KEYS[2])
if length < from then
  return {'retry'}
end
local upto = math.min(length, n)
if upto > from then
  local have = redis.call('LRANGE', KEYS[2], from, upto - 1)
  for j = 1, #have do
    if have[j] ~= ARGV[ev + j - 1] then
      return {'divergent', 'its token list holds another event at index ' .. (from + j - 1)
              .. ' than the one this worker published'}
    end
  end
end

local terminal = {done = true, cancelled = true, expired = true, dropped = true, error = true}
local function push_missing()
  local pushed = 0
  for i = length, n - 1 do
    local data = ARGV[ev + i - from]
    redis.call('RPUSH', KEYS[2], data)
    if publish == 'SPUBLISH' then  -- a Redis Cluster: sharded pub/sub
      redis.call('SPUBLISH', KEYS[3], data)
    else
      redis.call('PUBLISH', KEYS[3], data)
    end
    pushed = pushed + 1
  end
  if pushed > 0 then
    redis.call('HSET', KEYS[1], 'num_tokens', n)
    redis.call('EXPIRE', KEYS[2], ttl)
  end
  return pushed
end
local function drop_entry(stream, id)
  if id == '' then return 0 end
  redis.call('XACK', stream, group, id)
  return redis.call('XDEL', stream, id)
end

if status and terminal[status] then
  if mode == 'finished' and status == ARGV[13] and length <= n then
    local pushed = push_missing()  -- (its end was published with all its tokens counted)
    local dropped = drop_entry(KEYS[4], sid)
    return {'ok', pushed, 0, 0, dropped, ''}
  end
  return {'yield', 'it ended ' .. status .. ' meanwhile'}
end
if length > n then
  if mode == 'finished' then
    return {'divergent', 'its token list holds ' .. length .. ' events where this worker ended '
            .. 'it after ' .. n}
  end
  if status ~= 'running' or holder ~= worker then
    return {'yield', 'worker ' .. holder .. ' holds it ' .. (length - n) .. ' tokens further'}
  end
end
if mode == 'running' and status == 'running' and holder ~= '' and holder ~= worker
    and length == n and (tonumber(h[4] or '0') or 0) >= mine then
  return {'yield', 'worker ' .. holder .. ' took it over at the same point'}
end

-- From here on, this worker's history is the request's: put it back.
local rewrote = 0
if not status then
  if #record_fields > 0 then
    redis.call('HSET', KEYS[1], unpack(record_fields))
  end
  redis.call('EXPIRE', KEYS[1], ttl)
  rewrote = 1
end
local pushed = push_missing()
local dropped = 0
if other ~= '' and other ~= sid then
  dropped = dropped + drop_entry(KEYS[5], other)
end
if mode == 'running' then
  local new_entry = ''
  if #redis.call('XRANGE', KEYS[4], sid, sid) == 0 then
    sid = redis.call('XADD', KEYS[4], '*', unpack(entry_fields))
    new_entry = sid
  end
  redis.call('XCLAIM', KEYS[4], group, worker, 0, sid, 'FORCE', 'JUSTID')
  if status ~= 'running' or holder ~= worker or h[3] ~= sid then
    local attempts = math.max(mine, tonumber(h[4] or '0') or 0)
    redis.call('HSET', KEYS[1], 'status', 'running', 'worker', worker, 'ran_on', worker,
               'stream_id', sid, 'attempts', attempts)
    rewrote = 1
  end
  return {'ok', pushed, rewrote, 0, dropped, new_entry}
end
-- It ended here: write the end again (counted, published), dropping this worker's entry.
redis.call('HSET', KEYS[1], 'num_tokens', n)
dropped = dropped + #redis.call('XRANGE', KEYS[4], sid, sid)  -- (tf_finish acks and deletes it)
local result = tf_finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6], ARGV[6], ARGV[13],
                         ARGV[14], now, ttl, sid, group, '', end_fields, publish, KEYS[7], nil)
local ended = 0
if result[1] == 'ok' then ended = 1 end
return {'ok', pushed, rewrote, ended, dropped, ''}
