-- KEYS: none (an include, not a script: `-- @include tf_take.lua` pastes it into worker_steal.lua
--       and worker_overflow.lua; tf_take reads the streams KEYS[1 .. n] of its caller)
-- ARGV: none (the caller says where its per-stream ARGV start: tf_take's arguments)
-- Taking aged work: for each stream KEYS[i] (i = 1 .. n) in order, the leading run of its
-- undelivered entries (after the group's last-delivered id, oldest first) that are at least
-- ARGV[age0 + i] ms old (default `min_age`) by Redis's clock (TIME) is read with XREADGROUP
-- under `consumer`: a taken entry is an ordinary pending entry of the taker (same group),
-- acked, claimed and handed back like any other. ARGV[cap0 + i] caps what one call takes from
-- KEYS[i] (negative: no own cap); streams of one level (ARGV[lvl0 + i]) share the cap given for
-- the first of them; `budget` caps the whole call. A stream or group that is missing is skipped.
-- An entry's age runs from its id's time, or, where `admit` is given, from its field o when it
-- has one (an entry admitted from a tenant queue: o is the id it had when enqueued, tf_tenants).
-- `admit` (optional) is called as admit(i, room, now_ms, age) when the aged run is every
-- undelivered entry of KEYS[i] and `room` more could be taken: it may append up to `room` aged
-- entries to KEYS[i] (admission from tenant queues) and returns how many it appended, which
-- are taken too. Returns {"ok", reply...}: one XREADGROUP reply ({stream, entries}) per stream
-- it took from.
local function tf_take(n, group, consumer, budget, min_age, cap0, lvl0, age0, admit)
  local left = budget
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local out = {'ok'}
  local level_cap = {}
  for i = 1, n do
    if left <= 0 then
      break
    end
    local level = ARGV[lvl0 + i] or tostring(i)
    local cap = level_cap[level]
    if cap == nil then
      cap = tonumber(ARGV[cap0 + i] or '-1')
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
          if name == group then last = l end
        end
      end
      if last then
        local age = tonumber(ARGV[age0 + i] or '') or min_age
        local aged = 0
        local waiting = redis.call('XRANGE', KEYS[i], '(' .. last, '+', 'COUNT', count)
        for _, e in ipairs(waiting) do
          local since = e[1]
          if admit then
            local f = e[2]
            for j = 1, #f, 2 do
              if f[j] == 'o' then since = f[j + 1] end
            end
          end
          local ms = tonumber(string.match(since, '^(%d+)'))
          if not ms or now_ms - ms < age then
            break
          end
          aged = aged + 1
        end
        if admit and aged == #waiting and aged < count then
          aged = aged + admit(i, count - aged, now_ms, age)
        end
        if aged > 0 then
          local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', aged,
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
end
