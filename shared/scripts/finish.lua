-- KEYS[1] = request record hash          KEYS[2] = request token list
-- KEYS[3] = request channel              KEYS[4] = the stream its entry is in
-- KEYS[5] = cancel set                    KEYS[6] = queue ends hash (Keys.tally)
-- KEYS[7] = dead-letter stream (Keys.dead_letter): an ``error`` end copies its entry there
-- ARGV[1] = request id                   ARGV[2] = terminal status (done|cancelled|...)
-- ARGV[3] = encoded terminal event       ARGV[4] = now (epoch seconds)
-- ARGV[5] = record TTL in seconds        ARGV[6] = stream entry id, or "" if none
-- ARGV[7] = consumer group name          ARGV[8] = finishing worker's name, or "" (no guard)
-- ARGV[9] = publish command for the channel (PUBLISH, or SPUBLISH on a Redis Cluster)
-- ARGV[10] = payload bytes a dead letter keeps  ARGV[11] = the dead-letter stream's MAXLEN (~)
-- KEYS[8] = the model's tenant book, KEYS[9] = the queue's active-tenant set (optional, both
--           or neither: docs/fairness.md); with them ARGV[12] = the request's tenant ("": it was
--           not admitted through a tenant queue), ARGV[13] = its prompt + output tokens,
--           ARGV[14] = its output tokens, and the record fields start at ARGV[15]
-- ARGV[12..] = extra record fields as field, value pairs (text, finish_reason, usage, ...)
-- Tenants: the first terminal transition (reply "ok") adds ARGV[13] to the tenant's "served|T"
-- (T = ARGV[12], or "default") and charges ARGV[14] output tokens to a tenant-queue request's
-- virtual time: each request's tokens count once, whichever worker ends it.
-- Returns {"ok"} after publishing, {"already", status} if the record was already terminal, or
-- {"lost", holder} (nothing changed) if ARGV[8] is set and the live record is not held by it,
-- or is gone and the end is done (never a truncated success; an error end is written).
-- @include tf_keep_failed.lua
-- @include tf_finish.lua
-- @include tf_route.lua
-- @include tf_tenants.lua

local function keep_failed(stream, sid, rid, holder, fields)
  tf_keep_failed(KEYS[7], ARGV[10], ARGV[11], stream, sid, rid, holder, fields)
end

local tenants = #KEYS >= 9
local first = tenants and 15 or 12
local fields = {}
for i = first, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
local reply = tf_finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2], ARGV[3],
                        ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], fields, ARGV[9],
                        KEYS[6], keep_failed)
if tenants and reply[1] == 'ok' then
  local tenant = ARGV[12]
  local served = tonumber(ARGV[13]) or 0
  if served > 0 then
    redis.call('HINCRBY', KEYS[8], 'served|' .. (tenant ~= '' and tenant or 'default'), served)
  end
  if tenant ~= '' then
    tt_charge(KEYS[9], KEYS[8], tenant, tonumber(ARGV[14]) or 0)
  end
end
return reply
