-- KEYS[1] = request record hash          KEYS[2] = request token list
-- KEYS[3] = request channel              KEYS[4] = queue stream of the request
-- KEYS[5] = cancel set                    KEYS[6] = queue ends hash (Keys.tally)
-- KEYS[7] = the tenant queue of the request's tenant (Keys.tenant_queue; tenant "default"
--           when its record names none): where it waits while its record has tenant_queued
--           (docs/fairness.md), and KEYS[8] = the queue's tenant backlog (Keys.tenant_backlog),
--           which follows; both optional
-- ARGV[1] = request id                   ARGV[2] = encoded terminal event
-- ARGV[3] = now (epoch seconds)          ARGV[4] = record TTL in seconds
-- ARGV[5] = consumer group name          ARGV[6] = message for the record
-- ARGV[7] = publish command for the channel (PUBLISH, or SPUBLISH on a Redis Cluster)
-- Returns {"ok"} (it was queued past its deadline: now expired), {"live", status} (queued
-- within its deadline, or running), {"already", status} or {"unknown", message}.
-- @include tf_finish.lua
-- @include tf_backlog.lua

local h = redis.call('HMGET', KEYS[1], 'status', 'stream_id', 'deadline', 'tenant_queued')
local status = h[1]
if not status then
  return {'unknown', 'no request ' .. ARGV[1] .. ' (never submitted, or its record expired)'}
end
if status ~= 'queued' and status ~= 'running' then
  return {'already', status}
end
local deadline = tonumber(h[3] or '')
if status ~= 'queued' or not deadline or deadline > tonumber(ARGV[3]) then
  return {'live', status}
end
local queue, sid = KEYS[4], h[2] or ''
if h[4] == '1' and KEYS[7] then  -- waiting in its tenant queue: removed from it at once
  queue = KEYS[7]
  sid = tt_withdraw(queue, sid, KEYS[8])
end
return tf_finish(KEYS[1], KEYS[2], KEYS[3], queue, KEYS[5], ARGV[1], 'expired', ARGV[2],
                 ARGV[3], ARGV[4], sid, ARGV[5], '',
                 {'code', 'expired', 'message', ARGV[6], 'finish_reason', ''}, ARGV[7],
                 KEYS[6], nil)  -- never an error end: no dead letter
