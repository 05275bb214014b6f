-- KEYS[1..n] = queue streams, in the order to read them (most urgent first, starved ones before;
--              a level's worker-routed stream just before its shared one)
-- ARGV[1] = consumer group name          ARGV[2] = consumer (the worker's name)
-- ARGV[3] = budget: entries to read at most, over all streams
-- ARGV[3+i] = entries to read at most from KEYS[i] (optional; absent or negative: no own cap)
-- ARGV[3+n+i] = level of KEYS[i] (optional): streams of one level share the cap given for the
--              first of them (what one read takes from the level, whichever stream it is in)
-- Returns {"ok", levels_read, groups_lost, reply...}: one XREADGROUP reply ({stream, entries})
-- per stream that had new entries; levels_read counts the streams read (empty or not) before
-- the budget ran out; groups_lost is 1 if a stream or its group was missing (deleted, e.g. by
-- FLUSHALL: the caller recreates them). Entries read from the other streams are returned all
-- the same: they are in the caller's pending list now. One round trip instead of one
-- XREADGROUP per priority. A stream whose own cap is 0 is skipped (and not counted as read).
-- A node that refuses writes now (NOREPLICAS: min-replicas-to-write; READONLY: a replica)
-- refuses the first XREADGROUP already, so nothing was read: that error is the script's reply
-- (the caller's outage handling), not a lost group.
local left = tonumber(ARGV[3])
local n = #KEYS
local out = {'ok', 0, 0}
local level_cap = {}
for i = 1, n do
  if left <= 0 then
    break
  end
  local count = left
  local level = ARGV[3 + n + i] or tostring(i)
  local cap = level_cap[level]
  if cap == nil then
    cap = tonumber(ARGV[3 + i] or '-1')
    level_cap[level] = cap
  end
  if cap >= 0 and cap < count then
    count = cap
  end
  if count > 0 then
    out[2] = i
    local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count,
                          'STREAMS', KEYS[i], '>')
    if type(r) == 'table' and r.err then
      if string.find(r.err, 'NOREPLICAS', 1, true) or string.find(r.err, 'READONLY', 1, true) then
        return r
      end
      out[3] = 1
    elseif r then
      out[#out + 1] = r[1]
      left = left - #r[1][2]
      if cap >= 0 then
        level_cap[level] = cap - #r[1][2]
      end
    end
  end
end
return out
