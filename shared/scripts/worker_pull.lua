-- KEYS[1..n] = queue streams, in the order to read them (most urgent first, starved ones before;
--              a level's worker-routed stream just before its shared one)
-- KEYS[n+2j-1], KEYS[n+2j] = the active-tenant set (Keys.tenants_active) and the tenant
--              backlog (Keys.tenant_backlog) of the j-th shared stream that has a tenant-queue
--              name in ARGV (below), j = 1 .. m; when m > 0, then KEYS[n+2m+1] = the model's
--              tenant book (Keys.tenant_book), KEYS[n+2m+2] = the cancel set, KEYS[n+2m+3] =
--              the queue ends hash (Keys.tally): what ending an expired request at admission
--              needs, KEYS[n+2m+4] = the model's routers set (Keys.routers) and KEYS[n+2m+5] =
--              its load hash (Keys.route_load): where a routed request may be admitted
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
-- ARGV[16+3n+i] = for a shared stream KEYS[i] that has tenant queues, the routed streams' name
--              of its level before the worker (Keys.routed with worker ""); "" or absent for a
--              routed stream (optional: without it, admission routes nothing)
-- Returns {"ok", levels_read, groups_lost, reply...}: one XREADGROUP reply ({stream, entries})
-- per stream that had new entries; levels_read counts the streams read (empty or not) before
-- the budget ran out; groups_lost is 1 if a stream or its group was missing (deleted, e.g. by
-- FLUSHALL: the caller recreates them). Entries read from the other streams are returned all
-- the same: they are in the caller's pending list now. One round trip instead of one
-- XREADGROUP per priority. A stream whose own cap is 0 is skipped (and not counted as read).
-- A node that refuses writes now (NOREPLICAS: min-replicas-to-write; READONLY: a replica)
-- refuses the first XREADGROUP already, so nothing was read: that error is the script's reply
-- (the caller's outage handling), not a lost group.
-- Tenants (docs/fairness.md, tf_tenants.lua): before the first stream of a level whose queue
-- has active tenants is read, requests are admitted from its tenant queues (the least virtual
-- time first) into its shared stream, or into the routed stream of the worker each was routed
-- to (tt_admit), until the shared stream and what went to this worker's routed stream hold one
-- more undelivered entry than the read takes; the one left over wakes a worker blocked on the
-- shared stream, whose own pull admits the rest (and a request routed to another worker wakes
-- that one). A queue with no active tenant costs one ZCARD and is read as without tenants. A request met at admission with
-- its deadline passed is ended "expired" here (tf_finish), neither admitted nor charged.
-- @include tf_finish.lua
-- @include tf_route.lua
-- @include tf_tenants.lua

local left = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local out = {'ok', 0, 0}
local level_cap = {}
local rec_pre, rec_suf = ARGV[5 + 2 * n], ARGV[6 + 2 * n]
local fair = 0
local tenanted = {}  -- level -> {i = its shared stream's index, j = its tenant keys' number}
for i = 1, n do
  local level = ARGV[4 + n + i] or tostring(i)
  local tq = ARGV[6 + 2 * n + i]
  if tq and tq ~= '' then
    fair = fair + 1
    tenanted[level] = {i = i, j = fair}
  end
end
local book = KEYS[n + 2 * fair + 1]
local x = 7 + 3 * n  -- the expiry arguments
local now = ARGV[x]

-- end request `rid`, met at admission past its deadline (its tenant-queue entry is deleted)
local function expire(queue, rid)
  tt_expire(x, queue, rid, rec_pre, rec_suf, KEYS[n + 2 * fair + 2], KEYS[n + 2 * fair + 3],
            ARGV[1])
end

-- Admit into `level`'s streams from its tenant queues: until its shared stream, with what went
-- into this worker's routed stream (read first), holds one more than `count` undelivered (an
-- undelivered entry already in the routed stream is not counted: a one-entry XINFO less per
-- pull; what it leaves in the shared stream is the next pull's)
local function admit(level, count)
  local t = tenanted[level]
  if not t then return end
  local active, backlog = KEYS[n + 2 * t.j - 1], KEYS[n + 2 * t.j]
  if redis.call('ZCARD', active) == 0 then return end
  local need = count + 1 - tt_undelivered(KEYS[t.i], ARGV[1])
  if need <= 0 then return end
  local rt = nil  -- routing at admission (tt_routed)
  local routed = ARGV[16 + 3 * n + t.i]
  if routed and routed ~= '' then
    rt = {pre = routed, level = level, now = tonumber(now), group = ARGV[1], me = ARGV[2],
          seen = {}}
  end
  tt_admit(need, KEYS[t.i], active, backlog, book, ARGV[6 + 2 * n + t.i], rec_pre, rec_suf, now,
           expire, rt, KEYS[n + 2 * fair + 4], KEYS[n + 2 * fair + 5])
end

for i = 1, n do
  if left <= 0 then
    break
  end
  local count = left
  local level = ARGV[4 + n + i] or tostring(i)
  local cap = level_cap[level]
  local first = cap == nil  -- the level's first stream: admission from its tenant queues
  if first then
    cap = tonumber(ARGV[4 + i] or '-1')
    level_cap[level] = cap
  end
  if cap >= 0 and cap < count then
    count = cap
  end
  if first and count > 0 then
    admit(level, count)
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
