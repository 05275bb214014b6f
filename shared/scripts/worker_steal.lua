-- KEYS[1..n] = streams to take aged entries from, in the order to take them (other workers'
--              routed streams; for an overflow worker, shared and routed streams alike: an
--              overflow worker whose queues have tenants waiting runs worker_overflow.lua)
-- ARGV[1] = consumer group name          ARGV[2] = consumer (the stealing worker's name)
-- ARGV[3] = budget: entries to take at most, over all streams
-- ARGV[4] = minimum age in milliseconds: only entries whose stream id time is at least this
--           far behind Redis's clock (TIME) are taken
-- ARGV[4+i] = entries to take at most from KEYS[i] (negative: no own cap)
-- ARGV[4+n+i] = level of KEYS[i]: streams of one level share the cap given for the first
-- ARGV[4+2n+i] = minimum age for KEYS[i] in milliseconds (optional; default ARGV[4])
-- Returns {"ok", reply...}: one XREADGROUP reply ({stream, entries}) per stream it took from.
-- Only undelivered entries are looked at (after the group's last-delivered id), oldest first;
-- the aged ones are a leading run of them (ids grow with time), and exactly that run is read
-- with XREADGROUP under ARGV[2]: a stolen entry is an ordinary pending entry of the stealer
-- (same group), acked, claimed and handed back like any other. A stream or group that is
-- missing is skipped (tf_take.lua).
-- @include tf_take.lua

local n = #KEYS
return tf_take(n, ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), 4, 4 + n, 4 + 2 * n,
               nil)
