-- KEYS[1..n] = streams to take aged entries from, in the order to take them (other workers'
--              routed streams; for an overflow worker, shared and routed streams alike)
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
-- missing is skipped.
local left = tonumber(ARGV[3])
local min_age = tonumber(ARGV[4])
local n = #KEYS
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {'ok'}
local level_cap = {}
for i = 1, n do
  if left <= 0 then
    break
  end
  local level = ARGV[4 + n + i] or tostring(i)
  local cap = level_cap[level]
  if cap == nil then
    cap = tonumber(ARGV[4 + i] or '-1')
    level_cap[level] = cap
  end
  local count = left
  if cap >= 0 and cap < count then
    count = cap
  end
  if count > 0 then
    local last = nil
    local groups = redis.pcall('XINFO', 'GROUPS', KEYS[i])
    if type(groups) == 'table' and not groups.err then
      for _, g in ipairs(groups) do
        local name, l
        for j = 1, #g, 2 do
          if g[j] == 'name' then name = g[j + 1]
          elseif g[j] == 'last-delivered-id' then l = g[j + 1] end
        end
        if name == ARGV[1] then last = l end
      end
    end
    if last then
      local age = tonumber(ARGV[4 + 2 * n + i] or '') or min_age
      local aged = 0
      for _, e in ipairs(redis.call('XRANGE', KEYS[i], '(' .. last, '+', 'COUNT', count)) do
        local ms = tonumber(string.match(e[1], '^(%d+)'))
        if not ms or now_ms - ms < age then
          break
        end
        aged = aged + 1
      end
      if aged > 0 then
        local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', aged,
                             'STREAMS', KEYS[i], '>')
        if r then
          out[#out + 1] = r[1]
          left = left - #r[1][2]
          if cap >= 0 then
            level_cap[level] = cap - #r[1][2]
          end
        end
      end
    end
  end
end
return out
