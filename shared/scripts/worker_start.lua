-- KEYS[1] = request record hash          KEYS[2] = queue stream of the entry
-- KEYS[3] = cancel set                   KEYS[4] = request token list
-- KEYS[5] = queue drain counters (optional: absent skips the count): hash queue member -> starts
-- KEYS[6] = the request's session key (optional, with a "stolen_by:W" ARGV[11]; needs KEYS[5])
-- ARGV[1] = request id                   ARGV[2] = worker name
-- ARGV[3] = now (epoch seconds)          ARGV[4] = stream entry id
-- ARGV[5] = consumer group name          ARGV[6] = poison limit (max workers per request)
-- ARGV[7] = deadline (epoch seconds) or ""
-- ARGV[8] = the request's model, ARGV[9] = its priority label (optional: absent or "" skips
--           the comparison with the record's)
-- ARGV[10] = the queue member (model|label) whose counter in KEYS[5] counts this start
-- ARGV[11] = how the entry came to this worker (optional: "stolen_by:W" / "overflow:W"),
--            written to the record's "taken" when not ""; "route" and "routed_to" (where the
--            request was routed, and why) are kept. With KEYS[6], the session is pinned to
--            ARGV[2] for ARGV[12] seconds: its next turn goes where this turn's history is
--            (a hint: a SET the caller may not run, e.g. under an older ACL, is skipped)
-- ARGV[12] = the session TTL in seconds (with KEYS[6])
-- Returns one of
--   {"ok", attempts, num_tokens, event0, event1, ...}  now running, held by ARGV[2]; the
--                                 events are the token list (what earlier workers published);
--                                 the record's "waiting_on" (its model had no live worker
--                                 when it was enqueued) is removed
--   {"missing"}                   no record (never enqueued properly, or its TTL lapsed)
--   {"foreign", stream_id}        the record belongs to another entry; this one is acked+deleted
--   {"terminal", status}          already ended; the entry is acked+deleted
--   {"cancelled"}                 cancellation was asked for: caller finishes it cancelled
--   {"expired"}                   never started and its deadline passed: caller finishes expired
--   {"poison", attempts}          taken by more than ARGV[6] workers: caller finishes worker_lost
--   {"corrupt", cause}            the record or token list is inconsistent (unknown status,
--                                 a count that is not a number, a token list whose length is
--                                 not the record's num_tokens, a record for another model or
--                                 priority): caller finishes error / corrupt_state with the cause
local h = redis.call('HMGET', KEYS[1], 'status', 'stream_id', 'started_at', 'attempts',
                     'num_tokens', 'model', 'priority', 'waiting_on')
local status = h[1]
if not status then
  return {'missing'}
end
if h[2] and h[2] ~= ARGV[4] then
  redis.call('XACK', KEYS[2], ARGV[5], ARGV[4])
  redis.call('XDEL', KEYS[2], ARGV[4])
  return {'foreign', h[2]}
end
local terminal = {done = true, cancelled = true, expired = true, dropped = true, error = true}
if terminal[status] then
  redis.call('XACK', KEYS[2], ARGV[5], ARGV[4])
  redis.call('XDEL', KEYS[2], ARGV[4])
  return {'terminal', status}
end
if status ~= 'queued' and status ~= 'running' then
  return {'corrupt', "the record's status '" .. status .. "' is not a request status"}
end
local attempts, num_tokens = tonumber(h[4] or '0'), tonumber(h[5] or '0')
if not attempts or attempts < 0 or not num_tokens or num_tokens < 0 then
  return {'corrupt', "the record's attempts '" .. tostring(h[4]) .. "' or num_tokens '"
          .. tostring(h[5]) .. "' is not a count"}
end
local length = redis.call('LLEN', KEYS[4])
if length ~= num_tokens then
  return {'corrupt', 'its token list holds ' .. length .. ' events but its record says '
          .. num_tokens .. ' were published'}
end
if ARGV[8] and ARGV[8] ~= '' and h[6] and h[6] ~= ARGV[8] then
  return {'corrupt', "its record is for model '" .. h[6] .. "', its request for '"
          .. ARGV[8] .. "'"}
end
if ARGV[9] and ARGV[9] ~= '' and h[7] and h[7] ~= ARGV[9] then
  return {'corrupt', "its record has priority '" .. h[7] .. "', its request '"
          .. ARGV[9] .. "'"}
end
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then
  return {'cancelled'}
end
local started = h[3] and h[3] ~= ''
if not started and ARGV[7] ~= '' and tonumber(ARGV[7]) <= tonumber(ARGV[3]) then
  return {'expired'}
end
attempts = attempts + 1
if attempts > tonumber(ARGV[6]) then
  return {'poison', tostring(attempts - 1)}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[2], 'ran_on', ARGV[2],
           'attempts', attempts)
if KEYS[5] then  -- a waiting request left its queue: the gateway's Retry-After reads the rate
  redis.call('HINCRBY', KEYS[5], ARGV[10], 1)
end
if not started then
  redis.call('HSET', KEYS[1], 'started_at', ARGV[3])
end
if ARGV[11] and ARGV[11] ~= '' then
  redis.call('HSET', KEYS[1], 'taken', ARGV[11])
  if KEYS[6] then
    redis.pcall('SET', KEYS[6], ARGV[2], 'EX', ARGV[12])
  end
end
if h[8] then
  redis.call('HDEL', KEYS[1], 'waiting_on')
end
local out = {'ok', tostring(attempts), tostring(num_tokens)}
if num_tokens > 0 then
  for _, ev in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
    out[#out + 1] = ev
  end
end
return out
