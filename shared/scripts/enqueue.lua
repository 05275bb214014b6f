-- KEYS[1] = queue stream                 KEYS[2] = queue config hash
-- KEYS[3] = set of queue names           KEYS[4] = cancel set
-- KEYS[5] = served models (sorted set: model -> expiry of its live servers' heartbeats)
-- KEYS[6] = declared models (set)
-- KEYS[7] = queue ends hash (Keys.tally: evictions and reclaims count there, tf_finish.lua)
-- KEYS[8] = recent requests list (Keys.recent): each new request's id is pushed at its head,
--   and the list trimmed to ARGV[26] ids (no dead-letter key: an eviction is never an error, and
--   a producer's ACL user may not write the dead-letter stream)
-- KEYS[9 .. 8+R] = routing keys (R = ARGV[23]; none when 0): KEYS[9] = the model's routers
--   (sorted set), KEYS[10] = its load hash, then per candidate worker c = 1 .. C: its prefix
--   set, its routed stream of this queue; then the session keys the requests name (tf_route.lua)
-- KEYS[9+R+i] = record hash of request i (i = 1 .. n, in the order of the requests in ARGV)
-- ARGV[1] = now (epoch seconds)          ARGV[2] = record TTL in seconds
-- ARGV[3] = consumer group name          ARGV[4] = queue member name (model|label)
-- ARGV[5] = model                        ARGV[6] = priority label
-- ARGV[7] = default max_waiting          ARGV[8] = default policy
-- ARGV[9], ARGV[10]  = record key prefix, suffix of a waiting request   (only for victims,
-- ARGV[11], ARGV[12] = token list key prefix, suffix of one             see "Victims" below)
-- ARGV[13], ARGV[14] = channel prefix, suffix of one
-- ARGV[15] = encoded "dropped" terminal event with ARGV[17] in place of the id
-- ARGV[16] = encoded "expired" terminal event, same placeholder
-- ARGV[17] = the id placeholder          ARGV[18] = how many waiting entries to scan for expiry
-- ARGV[19] = dropped message             ARGV[20] = expired message
-- ARGV[21] = mode: "submit" (apply the queue's policy) or "try" (a full queue refuses,
--            whatever its policy: no eviction, no waiting)
-- ARGV[22] = publish command for channels (PUBLISH, or SPUBLISH on a Redis Cluster)
-- ARGV[23] = R, the number of routing keys   ARGV[24] = C, the number of candidate workers
-- ARGV[25] = session TTL (seconds)            ARGV[26] = how many ids the recent list keeps
-- ARGV[27 .. 26+C] = the candidates' names
-- ARGV[27+C ..] = sextuples: request id, encoded request, deadline (epoch seconds) or "",
--              the request's fingerprint (kept in the record as "fingerprint"), or "" for none
--              (a generated id: no other request can carry it, so nothing to compare), the
--              KEYS index of its session key or "" (none), its prefix chain (links separated
--              by spaces) or ""
-- Routing: each new request goes to a candidate's routed stream (tf_route.lua: its session's
-- worker, else the longest prefix match, else, with a session, the least loaded; the record
-- gets "routed_to" and "route") or to the shared stream KEYS[1] (route "shared"). The bound
-- counts the waiting (undelivered) entries of KEYS[1] and of every candidate's routed stream;
-- expiry reclaim scans the head of each, and drop-oldest evicts the oldest waiting entry of
-- them all (smallest stream id: the one that has waited longest, wherever it waits).
-- Returns {"ok", i1, code1, value1, i2, code2, value2, ...}: one triple per request that was
-- not enqueued anew, in order (i = its position in the call, from 1); a request not listed is
-- new (a bulk call that enqueued everything answers {"ok"}: half a microsecond less per
-- request, in Redis and in the client, than a pair for each). The codes:
--   "exists", status (a record with the same fingerprint, or one of the two without a
--   fingerprint) | "conflict", message (a record with another fingerprint: the id is
--   taken by a different request) | "overloaded", message (drop_newest, try mode, or
--   drop_oldest with nothing to evict) | "full", message (block policy, submit mode) |
--   "invalid", message (bad id) | "unserved", message (the model ARGV[5] has no live server,
--   is not declared, and the fleet is not empty: it declares models or has live servers)
-- Models: ARGV[5] is served while its KEYS[5] score is above ARGV[1]. A new request for a model
-- that is not served is accepted when the model is declared, or when the fleet is empty (no
-- declaration, no live server: a fleet that has not said what it serves), with its record's
-- "waiting_on" set to the model (the worker's START clears it); otherwise it is refused
-- ("unserved") and the call writes nothing at all (no stream, group, record or queue name).
-- Victims: a full queue ends waiting requests that are not in this call (drop_oldest evicts the
-- oldest; any of the ARGV[18] oldest past its deadline is reclaimed). Which ones is decided here,
-- from the stream, so no caller can name their keys beforehand: victim_keys() builds them from
-- the ARGV[9..14] templates (made by tokenfleet.shared.keys.Keys, never by names of this
-- script's own). It is the one place a script builds a key; docs/protocol.md ("Keys in
-- scripts") says why and what a Redis Cluster deployment needs instead.
-- @include tf_finish.lua
-- @include tf_route.lua

local R, C = tonumber(ARGV[23]), tonumber(ARGV[24])
local F = 8  -- the fixed keys before the routing keys
local J0 = 27 + C  -- the first request's ARGV
if #KEYS ~= F + R + (#ARGV - J0 + 1) / 6 then
  return redis.error_reply('enqueue: KEYS must hold one record key per request')
end
local stream, group, now, ttl = KEYS[1], ARGV[3], ARGV[1], ARGV[2]
local cfg = redis.call('HMGET', KEYS[2], 'max_waiting', 'policy')
local max_waiting = tonumber(cfg[1] or ARGV[7]) or tonumber(ARGV[7])
local policy = cfg[2] or ARGV[8]

local function event_for(template, rid)
  local i = string.find(template, ARGV[17], 1, true)
  return string.sub(template, 1, i - 1) .. rid .. string.sub(template, i + #ARGV[17])
end

local function victim_keys(rid)
  return ARGV[9] .. rid .. ARGV[10], ARGV[11] .. rid .. ARGV[12], ARGV[13] .. rid .. ARGV[14]
end

local function end_waiting(from, sid, rid, status, template, message)
  if not rid or not string.find(rid, '^[A-Za-z0-9][A-Za-z0-9%._%-]*$') then
    redis.call('XDEL', from, sid)
    return
  end
  local victim_record, victim_tokens, victim_channel = victim_keys(rid)
  tf_finish(victim_record, victim_tokens, victim_channel, from, KEYS[4], rid, status,
            event_for(template, rid), now, ttl, sid, group, '',
            {'code', status, 'message', message, 'finish_reason', ''}, ARGV[22],
            KEYS[7], nil)
end

local function field(entry, name)
  local f = entry[2]
  for i = 1, #f, 2 do
    if f[i] == name then return f[i + 1] end
  end
  return nil
end

local BAD_ID = 'request id must be 1-128 characters of [A-Za-z0-9._-]'
local ID_PATTERN = '^[A-Za-z0-9][A-Za-z0-9%._%-]*$'
local function bad_id(rid)
  return #rid > 128 or not string.find(rid, ID_PATTERN)
end

-- The code and value for a request whose record exists: the same request, or a conflict.
local function existing(rec, rid, fp)
  local held = redis.call('HMGET', rec, 'status', 'fingerprint')
  if held[2] and held[2] ~= '' and fp ~= '' and held[2] ~= fp then
    return 'conflict', 'request id ' .. rid .. ' is already taken by a different request '
      .. '(status ' .. (held[1] or 'queued') .. '): resubmit the same request to get it, '
      .. 'or choose another request_id'
  end
  return 'exists', held[1] or 'queued'
end

local function names(list, limit)
  table.sort(list)
  if #list == 0 then return 'none' end
  local shown = {}
  for i = 1, math.min(#list, limit) do shown[i] = list[i] end
  return table.concat(shown, ', ') .. (#list > limit and ', ...' or '')
end

-- Is the model served, waited on (declared, or an empty fleet) or refused? Before any write.
local waiting_on, unserved = false, nil
local expiry = redis.call('ZSCORE', KEYS[5], ARGV[5])
if not expiry or tonumber(expiry) <= tonumber(now) then
  waiting_on = true
  if redis.call('SISMEMBER', KEYS[6], ARGV[5]) == 0 then
    local live = redis.call('ZRANGEBYSCORE', KEYS[5], '(' .. now, '+inf')
    local declared = redis.call('SMEMBERS', KEYS[6])
    if #live > 0 or #declared > 0 then
      unserved = "model '" .. ARGV[5] .. "' is not served by any live worker and not declared "
        .. 'in this fleet (served: ' .. names(live, 10) .. '; declared: '
        .. names(declared, 10) .. ')'
    end
  end
end
if unserved then  -- nothing is written: existing ids still answer as they would
  local refused = {'ok'}
  local k = F + R
  for j = J0, #ARGV, 6 do
    k = k + 1
    local code, value = 'unserved', unserved
    if bad_id(ARGV[j]) then
      code, value = 'invalid', BAD_ID
    elseif redis.call('EXISTS', KEYS[k]) == 1 then
      code, value = existing(KEYS[k], ARGV[j], ARGV[j + 3])
    end
    refused[#refused + 1] = k - F - R
    refused[#refused + 1] = code
    refused[#refused + 1] = value
  end
  return refused
end

-- whether the group exists on stream s, its pending count and its last-delivered id
local function group_state(s)
  local groups = redis.pcall('XINFO', 'GROUPS', s)
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      local name, p, l
      for i = 1, #g, 2 do
        if g[i] == 'name' then name = g[i + 1]
        elseif g[i] == 'pending' then p = g[i + 1]
        elseif g[i] == 'last-delivered-id' then l = g[i + 1] end
      end
      if name == group then
        return true, tonumber(p), l
      end
    end
  end
  return false, 0, '0-0'
end

local function undelivered(s)
  local found, p = group_state(s)
  return found and redis.call('XLEN', s) - p or 0
end

-- the shared stream: creating stream and group if needed
local found = group_state(stream)
if not found then
  redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
end
local router = new_router(F + 1, {unpack(ARGV, 27, 26 + C)}, tonumber(now), ARGV[25],
                          undelivered, ARGV[6])
local waiting = undelivered(stream) + router.waiting()
local reclaimed = false

-- the queue's streams whose waiting entries count: KEYS indices (shared, then routed)
local counted = {1}
for c = 1, C do counted[#counted + 1] = F + 2 + 2 * c end

local function id_less(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, bm = tonumber(am), tonumber(bm)
  return am < bm or (am == bm and tonumber(as) < tonumber(bs))
end

-- the oldest waiting entry over the counted streams: KEYS index and entry, or nil
local function oldest_waiting()
  local at, victim = nil, nil
  for _, i in ipairs(counted) do
    local ok, _, last = group_state(KEYS[i])
    if ok then
      local e = redis.call('XRANGE', KEYS[i], '(' .. last, '+', 'COUNT', 1)[1]
      if e and (not victim or id_less(e[1], victim[1])) then at, victim = i, e end
    end
  end
  return at, victim
end

-- A new record's fields, one table for the call: stream id (fields[2]) and the optional
-- deadline and fingerprint are set per request, and HSET takes fields[1 .. n]. Fields whose
-- value would be the reader's default (num_tokens 0, attempts 0, worker and deadline "") are
-- left out: HSET costs about 0.1 us more per field, on every request (benchmarks/RESULTS.md).
local fields = {'stream_id', '', 'status', 'queued', 'enqueued_at', now, 'model', ARGV[5],
                'priority', ARGV[6]}
if waiting_on then
  fields[11] = 'waiting_on'
  fields[12] = ARGV[5]
end
local nfields = #fields
-- The records' expiry, one absolute time on Redis's own clock for the call: PEXPIREAT goes to
-- replicas and the AOF as it is, where EXPIRE is rewritten into it per request (0.2 us each).
local clock = redis.call('TIME')
local expire_at = string.format('%d', clock[1] * 1000 + math.floor(clock[2] / 1000)
                                      + tonumber(ttl) * 1000)

-- Which records exist: one EXISTS over all of the call's record keys says "none" in the usual
-- case, and then no request needs its own (0.3 us each); an id repeated within the call is
-- caught by `created`. Past 1000 keys (unpack's limit is near 8000) each request asks.
local any_exist = #KEYS > 1000 + F + R
  or (#KEYS > F + R and redis.call('EXISTS', unpack(KEYS, F + 1 + R)) > 0)
local created = {}
local fresh = {}  -- the ids enqueued anew, in order (the recent list)

local out = {'ok'}
local function answer(i, code, value)  -- a request that was not enqueued anew
  out[#out + 1] = i
  out[#out + 1] = code
  out[#out + 1] = value
end
local k = F + R
for j = J0, #ARGV, 6 do
  local rid, payload, deadline, fp = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
  k = k + 1
  local rec = KEYS[k]
  if #rid > 128 or not string.find(rid, ID_PATTERN) then  -- bad_id(rid), without the call
    answer(k - F - R, 'invalid', BAD_ID)
  elseif (any_exist or created[rid]) and redis.call('EXISTS', rec) == 1 then
    answer(k - F - R, existing(rec, rid, fp))
  else
    if waiting >= max_waiting and not reclaimed then
      reclaimed = true
      for _, i in ipairs(counted) do
        local ok, _, last = group_state(KEYS[i])
        local head = ok and redis.call('XRANGE', KEYS[i], '(' .. last, '+', 'COUNT',
                                       tonumber(ARGV[18])) or {}
        for _, e in ipairs(head) do
          local dl = field(e, 'dl')
          if dl and dl ~= '' and tonumber(dl) <= tonumber(now) then
            end_waiting(KEYS[i], e[1], field(e, 'id'), 'expired', ARGV[16], ARGV[20])
            waiting = waiting - 1
          end
        end
      end
    end
    local admit = waiting < max_waiting
    if not admit and policy == 'drop_oldest' and ARGV[21] == 'submit' then
      local at, victim = oldest_waiting()
      if victim then
        end_waiting(KEYS[at], victim[1], field(victim, 'id'), 'dropped', ARGV[15], ARGV[19])
        waiting = waiting - 1
        admit = true
      end
    end
    local chosen, route = nil, nil
    if admit and R > 0 then
      local chain = {}
      for link in string.gmatch(ARGV[j + 5], '%S+') do chain[#chain + 1] = link end
      chosen, route = router.pick(tonumber(ARGV[j + 4]), chain)
    end
    local target = 1
    if chosen then
      target = F + 2 + 2 * chosen
      if not group_state(KEYS[target]) then
        redis.call('XGROUP', 'CREATE', KEYS[target], group, '0', 'MKSTREAM')
      end
      router.added(chosen)
    end
    if admit then
      local sid = redis.call('XADD', KEYS[target], '*', 'id', rid, 'd', payload, 'dl', deadline)
      -- The payload lives in the stream entry only (the worker reads it there; a claim or a
      -- handback keeps the entry's fields), so the record does not store a second copy.
      fields[2] = sid
      local n = nfields
      if deadline ~= '' then
        fields[n + 1] = 'deadline'
        fields[n + 2] = deadline
        n = n + 2
      end
      if fp ~= '' then
        fields[n + 1] = 'fingerprint'
        fields[n + 2] = fp
        n = n + 2
      end
      if chosen then  -- (no "route" field: "shared", the reader's default)
        fields[n + 1] = 'route'
        fields[n + 2] = route
        fields[n + 3] = 'routed_to'
        fields[n + 4] = ARGV[26 + chosen]
        n = n + 4
      end
      redis.call('HSET', rec, unpack(fields, 1, n))
      redis.call('PEXPIREAT', rec, expire_at)
      created[rid] = true
      fresh[#fresh + 1] = rid
      waiting = waiting + 1
    elseif policy == 'block' and ARGV[21] == 'submit' then
      answer(k - F - R, 'full', 'queue ' .. ARGV[4] .. ' is full (' .. max_waiting .. ' waiting)')
    else
      answer(k - F - R, 'overloaded', 'queue ' .. ARGV[4] .. ' is full (' .. max_waiting
        .. ' waiting, policy ' .. policy .. ')')
    end
  end
end
redis.call('SADD', KEYS[3], ARGV[4])
if #fresh > 0 then
  redis.call('LPUSH', KEYS[8], unpack(fresh))
  redis.call('LTRIM', KEYS[8], 0, tonumber(ARGV[26]) - 1)
end
return out
