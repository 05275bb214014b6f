-- KEYS[1..n] = queue streams, in the order to read them (most urgent first, starved ones before;
--              a level's worker-routed stream just before its shared one)
-- KEYS[n+2j-1], KEYS[n+2j] = the active-tenant set (Keys.tenants_active) and the tenant
--              backlog (Keys.tenant_backlog) of the j-th shared stream that has a tenant-queue
--              name in ARGV (below), j = 1 .. m; when m > 0, then KEYS[n+2m+1] = the model's
--              tenant book (Keys.tenant_book), KEYS[n+2m+2] = the cancel set, KEYS[n+2m+3] =
--              the queue ends hash (Keys.tally): what ending an expired request at admission
--              needs
-- ARGV[1] = consumer group name          ARGV[2] = consumer (the worker's name)
-- ARGV[3] = budget: entries to read at most, over all streams
-- ARGV[4] = n, the number of streams
-- ARGV[4+i] = entries to read at most from KEYS[i] (negative: no own cap)
-- ARGV[4+n+i] = level of KEYS[i]: streams of one level share the cap given for the first of
--              them (what one read takes from the level, whichever stream it is in)
-- ARGV[5+2n], ARGV[6+2n] = a request record's name before and after the request id (optional)
-- ARGV[6+2n+i] = for a shared stream KEYS[i], its tenant queues' name before the tenant
--              (Keys.tenant_queue); "" or absent for a routed stream (optional)
-- ARGV[7+3n .. 16+3n] (when m > 0) = now (epoch seconds), record TTL in seconds, publish
--              command (PUBLISH or SPUBLISH), a token list's name before and after the request
--              id, a channel's name before and after it, the encoded "expired" terminal event
--              with the placeholder ARGV[15+3n] in place of the id, the expired message
-- Returns {"ok", levels_read, groups_lost, reply...}: one XREADGROUP reply ({stream, entries})
-- per stream that had new entries; levels_read counts the streams read (empty or not) before
-- the budget ran out; groups_lost is 1 if a stream or its group was missing (deleted, e.g. by
-- FLUSHALL: the caller recreates them). Entries read from the other streams are returned all
-- the same: they are in the caller's pending list now. One round trip instead of one
-- XREADGROUP per priority. A stream whose own cap is 0 is skipped (and not counted as read).
-- A node that refuses writes now (NOREPLICAS: min-replicas-to-write; READONLY: a replica)
-- refuses the first XREADGROUP already, so nothing was read: that error is the script's reply
-- (the caller's outage handling), not a lost group.
-- Tenants (docs/fairness.md, tf_tenants.lua): before a shared stream whose queue has active
-- tenants is read, requests are admitted into it from its tenant queues (the least virtual time
-- first) until it holds one more undelivered entry than the read takes; the one left over wakes
-- a worker blocked on that stream, whose own pull admits the rest. A queue with no active
-- tenant costs one ZCARD and is read as without tenants. A request met at admission with its
-- deadline passed is ended "expired" here (tf_finish), neither admitted nor charged.
-- @include tf_finish.lua
-- @include tf_tenants.lua

local left = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local out = {'ok', 0, 0}
local level_cap = {}
local rec_pre, rec_suf = ARGV[5 + 2 * n], ARGV[6 + 2 * n]
local active_of, backlog_of, fair = {}, {}, 0
for i = 1, n do
  local tq = ARGV[6 + 2 * n + i]
  if tq and tq ~= '' then
    fair = fair + 1
    active_of[i] = KEYS[n + 2 * fair - 1]
    backlog_of[i] = KEYS[n + 2 * fair]
  end
end
local book = KEYS[n + 2 * fair + 1]
local x = 7 + 3 * n  -- the expiry arguments
local now = ARGV[x]

-- end request `rid`, met at admission past its deadline (its tenant-queue entry is deleted)
local function expire(queue, rid)
  local event = ARGV[x + 7]
  local at = string.find(event, ARGV[x + 8], 1, true)
  event = string.sub(event, 1, at - 1) .. rid .. string.sub(event, at + #ARGV[x + 8])
  local expired_record = rec_pre .. rid .. rec_suf
  local expired_tokens = ARGV[x + 3] .. rid .. ARGV[x + 4]
  local expired_channel = ARGV[x + 5] .. rid .. ARGV[x + 6]
  tf_finish(expired_record, expired_tokens, expired_channel, queue, KEYS[n + 2 * fair + 2],
            rid, 'expired', event, now, ARGV[x + 1], '', ARGV[1], '',
            {'code', 'expired', 'message', ARGV[x + 9], 'finish_reason', ''}, ARGV[x + 2],
            KEYS[n + 2 * fair + 3], nil)
end

-- entries of stream not yet delivered to the group: XLEN - pending (what the enqueue script
-- counts; Redis 6.2 has no XINFO lag)
local function undelivered(stream)
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      local name, pending
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'pending' then pending = g[j + 1] end
      end
      if name == ARGV[1] then return redis.call('XLEN', stream) - (tonumber(pending) or 0) end
    end
  end
  return 0
end

for i = 1, n do
  if left <= 0 then
    break
  end
  local count = left
  local level = ARGV[4 + n + i] or tostring(i)
  local cap = level_cap[level]
  if cap == nil then
    cap = tonumber(ARGV[4 + i] or '-1')
    level_cap[level] = cap
  end
  if cap >= 0 and cap < count then
    count = cap
  end
  local active = active_of[i]
  if count > 0 and active and redis.call('ZCARD', active) > 0 then
    local need = count + 1 - undelivered(KEYS[i])
    if need > 0 then
      tt_admit(need, KEYS[i], active, backlog_of[i], book, ARGV[6 + 2 * n + i], rec_pre, rec_suf,
               now, expire)
    end
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
