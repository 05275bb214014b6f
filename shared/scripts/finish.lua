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
-- ARGV[12..] = extra record fields as field, value pairs (text, finish_reason, usage, ...)
-- Returns {"ok"} after publishing, {"already", status} if the record was already terminal, or
-- {"lost", holder} (nothing changed) if ARGV[8] is set and the live record is not held by it,
-- or is gone and the end is done (never a truncated success; an error end is written).
-- @include tf_keep_failed.lua
-- @include tf_finish.lua

local function keep_failed(stream, sid, rid, holder, fields)
  tf_keep_failed(KEYS[7], ARGV[10], ARGV[11], stream, sid, rid, holder, fields)
end

local fields = {}
for i = 12, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
return tf_finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2], ARGV[3],
                 ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], fields, ARGV[9],
                 KEYS[6], keep_failed)
