-- KEYS[1] = queue stream                 KEYS[2] = queue config hash
-- KEYS[3] = set of queue names           KEYS[4] = cancel set
-- KEYS[5] = served models (sorted set: model -> expiry of its live servers' heartbeats)
-- KEYS[6] = declared models (set)
-- KEYS[6+i] = record hash of request i   (i = 1 .. n, in the order of the quadruples in ARGV)
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
-- ARGV[23..] = quadruples: request id, encoded request, deadline (epoch seconds) or "",
--              the request's fingerprint (kept in the record as "fingerprint"), or "" for none
--              (a generated id: no other request can carry it, so nothing to compare)
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

if #KEYS ~= 6 + (#ARGV - 22) / 4 then
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

local function end_waiting(sid, rid, status, template, message)
  if not rid or not string.find(rid, '^[A-Za-z0-9][A-Za-z0-9%._%-]*$') then
    redis.call('XDEL', stream, sid)
    return
  end
  local victim_record, victim_tokens, victim_channel = victim_keys(rid)
  tf_finish(victim_record, victim_tokens, victim_channel, stream, KEYS[4], rid, status,
            event_for(template, rid), now, ttl, sid, group, '',
            {'code', status, 'message', message, 'finish_reason', ''}, ARGV[22])
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
  local k = 6
  for j = 23, #ARGV, 4 do
    k = k + 1
    local code, value = 'unserved', unserved
    if bad_id(ARGV[j]) then
      code, value = 'invalid', BAD_ID
    elseif redis.call('EXISTS', KEYS[k]) == 1 then
      code, value = existing(KEYS[k], ARGV[j], ARGV[j + 3])
    end
    refused[#refused + 1] = k - 6
    refused[#refused + 1] = code
    refused[#refused + 1] = value
  end
  return refused
end

-- pending count and last-delivered id of the group, creating stream and group if needed
local pending, last = 0, '0-0'
local groups = redis.pcall('XINFO', 'GROUPS', stream)
local found = false
if type(groups) == 'table' and not groups.err then
  for _, g in ipairs(groups) do
    local name, p, l
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1]
      elseif g[i] == 'pending' then p = g[i + 1]
      elseif g[i] == 'last-delivered-id' then l = g[i + 1] end
    end
    if name == group then
      found, pending, last = true, tonumber(p), l
    end
  end
end
if not found then
  redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
end
local waiting = redis.call('XLEN', stream) - pending
local reclaimed = false

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
local any_exist = #KEYS > 1006 or (#KEYS > 6 and redis.call('EXISTS', unpack(KEYS, 7)) > 0)
local created = {}

local out = {'ok'}
local function answer(i, code, value)  -- a request that was not enqueued anew
  out[#out + 1] = i
  out[#out + 1] = code
  out[#out + 1] = value
end
local k = 6
for j = 23, #ARGV, 4 do
  local rid, payload, deadline, fp = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
  k = k + 1
  local rec = KEYS[k]
  if #rid > 128 or not string.find(rid, ID_PATTERN) then  -- bad_id(rid), without the call
    answer(k - 6, 'invalid', BAD_ID)
  elseif (any_exist or created[rid]) and redis.call('EXISTS', rec) == 1 then
    answer(k - 6, existing(rec, rid, fp))
  else
    if waiting >= max_waiting and not reclaimed then
      reclaimed = true
      local head = redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', tonumber(ARGV[18]))
      for _, e in ipairs(head) do
        local dl = field(e, 'dl')
        if dl and dl ~= '' and tonumber(dl) <= tonumber(now) then
          end_waiting(e[1], field(e, 'id'), 'expired', ARGV[16], ARGV[20])
          waiting = waiting - 1
        end
      end
    end
    local admit = waiting < max_waiting
    if not admit and policy == 'drop_oldest' and ARGV[21] == 'submit' then
      local victim = redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', 1)[1]
      if victim then
        end_waiting(victim[1], field(victim, 'id'), 'dropped', ARGV[15], ARGV[19])
        waiting = waiting - 1
        admit = true
      end
    end
    if admit then
      local sid = redis.call('XADD', stream, '*', 'id', rid, 'd', payload, 'dl', deadline)
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
      redis.call('HSET', rec, unpack(fields, 1, n))
      redis.call('PEXPIREAT', rec, expire_at)
      created[rid] = true
      waiting = waiting + 1
    elseif policy == 'block' and ARGV[21] == 'submit' then
      answer(k - 6, 'full', 'queue ' .. ARGV[4] .. ' is full (' .. max_waiting .. ' waiting)')
    else
      answer(k - 6, 'overloaded', 'queue ' .. ARGV[4] .. ' is full (' .. max_waiting
        .. ' waiting, policy ' .. policy .. ')')
    end
  end
end
redis.call('SADD', KEYS[3], ARGV[4])
return out
