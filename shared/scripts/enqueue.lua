-- KEYS[1] = queue stream                 KEYS[2] = queue config hash
-- KEYS[3] = set of queue names           KEYS[4] = cancel set
-- KEYS[5] = served models (sorted set: model -> expiry of its live servers' heartbeats)
-- KEYS[6] = declared models (set)
-- KEYS[7] = queue ends hash (Keys.tally: evictions and reclaims count there, tf_finish.lua)
-- KEYS[8] = recent requests list (Keys.recent): each new request's id is pushed at its head,
--   and the list trimmed to ARGV[26] ids (no dead-letter key: an eviction is never an error, and
--   a producer's ACL user may not write the dead-letter stream)
-- KEYS[9] = the queue's active tenants (sorted set, Keys.tenants_active)
-- KEYS[10] = the model's tenant book (hash, Keys.tenant_book; tf_tenants.lua)
-- KEYS[11] = the queue's tenant backlog (list, Keys.tenant_backlog: one element per request
--   waiting in its tenant queues; tf_tenants.lua)
-- KEYS[12 .. 11+R] = routing keys (R = ARGV[23]; none when 0): KEYS[12] = the model's routers
--   (sorted set), KEYS[13] = its load hash, then per candidate worker c = 1 .. C: its prefix
--   set, its routed stream of this queue; then the session keys the requests name (tf_route.lua)
-- KEYS[12+R+i] = record hash of request i (i = 1 .. n, in the order of the requests in ARGV)
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
-- ARGV[27] = a tenant queue's name before its tenant (Keys.tenant_queue with an empty tenant)
-- ARGV[28] = "1": every request goes through its tenant queue (the fleet's fairness "always");
--            "" (the default): a default-tenant request goes to the shared stream while no
--            other tenant waits in this queue (no cost for a fleet of one tenant)
-- ARGV[29 .. 28+C] = the candidates' names
-- ARGV[29+C] = S, the number of tenant settings that follow
-- ARGV[30+C .. 29+C+4S] = quadruples: tenant, weight, own bound or "" (none), when they were set
--              (what `tokenfleet tenants set` stored in the fleet's hash, which the producer
--              read: stored in the book unless it holds settings set later, tt_seed)
-- ARGV[30+C+4S ..] = nonuples: request id, encoded request, deadline (epoch seconds) or "",
--              the request's fingerprint (kept in the record as "fingerprint"), or "" for none
--              (a generated id: no other request can carry it, so nothing to compare), the
--              KEYS index of its session key or "" (none), its prefix chain (links separated
--              by spaces) or "", its tenant, the tenant's weight or "" (kept as it is), its
--              prompt tokens (as the producer counts them: what admission charges)
-- Tenants (docs/fairness.md, tf_tenants.lua): a request of the default tenant goes to the
-- shared stream as before while the queue's active-tenant set is empty; otherwise it waits in
-- its tenant's queue, with the worker routing chose for it and why (fields r and rt: the pick
-- is made here, session pin included; its record gets route and routed_to when it is admitted),
-- and is admitted by tt_admit into that worker's routed stream if the worker is still a target,
-- else into the shared stream: here (one request when the shared stream has nothing
-- undelivered, so that a worker wakes up; it routes only when this call has candidates: their
-- routed streams' names give the level's, a candidate's name removed) and in worker_pull.lua
-- (and worker_overflow.lua for an overflow worker). When the first
-- other tenant becomes active, the default tenant's undelivered shared entries (not handed-back
-- ones) move to its tenant queue, so a backlog from before does not wait ahead of everyone.
-- A request waiting in a tenant queue has "tenant" and "tenant_queued" = "1" in its record (the
-- latter emptied when it is admitted): cancel and expiry find it there (cancel.lua).
-- A tenant's own bound ("max|T" in the book) refuses (overloaded) past that many waiting in its
-- tenant queue; the queue's bound counts every tenant queue's entries too.
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
-- @include tf_tenants.lua

local R, C = tonumber(ARGV[23]), tonumber(ARGV[24])
local S = tonumber(ARGV[29 + C])
local F = 11  -- the fixed keys before the routing keys
local J0 = 30 + C + 4 * S  -- the first request's ARGV
local W = 9  -- ARGVs per request
if #KEYS ~= F + R + (#ARGV - J0 + 1) / W then
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
    if sid ~= '' then redis.call('XDEL', from, sid) end
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
  for j = J0, #ARGV, W do
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
local router = new_router(F + 1, {unpack(ARGV, 29, 28 + C)}, tonumber(now), ARGV[25],
                          undelivered, ARGV[6])
local waiting = undelivered(stream) + router.waiting()
local reclaimed = false

-- the queue's streams whose waiting entries count, as {name, grouped}: the shared and routed
-- streams (waiting = undelivered to the group) and the active tenants' queues (no group: every
-- entry waits)
local counted = {{stream, true}}
for c = 1, C do counted[#counted + 1] = {KEYS[F + 2 + 2 * c], true} end
local active, book, backlog, tq = KEYS[9], KEYS[10], KEYS[11], ARGV[27]
for j = 30 + C, 29 + C + 4 * S, 4 do
  tt_seed(book, ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3])
end
local tenanted = {}  -- tenant -> true once its queue is in `counted`
local function count_tenant(t)
  if not tenanted[t] then
    tenanted[t] = true
    local tenant_queue = tq .. t
    counted[#counted + 1] = {tenant_queue, false}
    return redis.call('XLEN', tenant_queue)
  end
  return 0
end
local fair = ARGV[28] == '1' or redis.call('ZCARD', active) > 0
if fair then
  for _, t in ipairs(redis.call('ZRANGE', active, 0, -1)) do waiting = waiting + count_tenant(t) end
end

-- the first waiting entry of a counted stream (or nil), and the entries after it, up to `n`
local function waiting_head(c, n)
  local counted_stream = c[1]
  if c[2] then
    local ok, _, last = group_state(counted_stream)
    if not ok then return {} end
    return redis.call('XRANGE', counted_stream, '(' .. last, '+', 'COUNT', n)
  end
  return redis.call('XRANGE', counted_stream, '-', '+', 'COUNT', n)
end

local function id_less(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, bm = tonumber(am), tonumber(bm)
  return am < bm or (am == bm and tonumber(as) < tonumber(bs))
end

-- the oldest waiting entry over the counted streams: its counted stream and entry, or nil (an
-- entry admitted from a tenant queue is as old as its id there, field o)
local function oldest_waiting()
  local at, victim, age = nil, nil, nil
  for _, c in ipairs(counted) do
    local e = waiting_head(c, 1)[1]
    local since = e and (field(e, 'o') or e[1])
    if e and (not victim or id_less(since, age)) then at, victim, age = c, e, since end
  end
  return at, victim
end

-- end a waiting entry of counted stream c (a tenant queue's entry is deleted here: it has no
-- group for tf_finish to ack in)
local function end_counted(c, e, status, template, message)
  local counted_stream = c[1]
  if c[2] then
    end_waiting(counted_stream, e[1], field(e, 'id'), status, template, message)
  else
    tt_backlog(backlog, -redis.call('XDEL', counted_stream, e[1]))
    end_waiting(counted_stream, '', field(e, 'id'), status, template, message)
  end
end

-- The first other tenant to wait: the default tenant's undelivered shared entries move to its
-- tenant queue (handed-back ones stay: they resume), so they do not all run before it.
local function start_fairness()
  fair = true
  local ok, _, last = group_state(stream)
  if not ok then return end
  local moved = 0
  for _, e in ipairs(redis.call('XRANGE', stream, '(' .. last, '+')) do
    local rid = field(e, 'id')
    if rid and not field(e, 'h') and not field(e, 't') then
      local tenant_queue, moved_record = tq .. 'default', ARGV[9] .. rid .. ARGV[10]
      local sid = redis.call('XADD', tenant_queue, '*', 'id', rid, 'd', field(e, 'd') or '',
                             'dl', field(e, 'dl') or '', 'n', field(e, 'n') or '0', 'o', e[1])
      redis.call('XDEL', stream, e[1])
      redis.call('HSET', moved_record, 'stream_id', sid, 'tenant', 'default', 'tenant_queued',
                 '1')
      moved = moved + 1
    end
  end
  if moved > 0 then
    tt_backlog(backlog, moved)
    waiting = waiting + count_tenant('default')
    tt_activate(active, book, 'default')
  end
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
for j = J0, #ARGV, W do
  local rid, payload, deadline, fp = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
  local tenant, weight, prompt = ARGV[j + 6], ARGV[j + 7], ARGV[j + 8]
  k = k + 1
  local rec = KEYS[k]
  if #rid > 128 or not string.find(rid, ID_PATTERN) then  -- bad_id(rid), without the call
    answer(k - F - R, 'invalid', BAD_ID)
  elseif (any_exist or created[rid]) and redis.call('EXISTS', rec) == 1 then
    answer(k - F - R, existing(rec, rid, fp))
  else
    local own = tenant ~= 'default' or fair  -- waits in its tenant's queue
    if own and not fair then start_fairness() end
    local own_full = nil
    if own then
      if weight ~= '' then redis.call('HSET', book, 'w|' .. tenant, weight) end
      waiting = waiting + count_tenant(tenant)
      local bound = tonumber(redis.call('HGET', book, 'max|' .. tenant) or '')
      local tenant_queue = tq .. tenant
      if bound and redis.call('XLEN', tenant_queue) >= bound then
        own_full = 'tenant ' .. tenant .. ' has ' .. bound .. ' waiting in queue ' .. ARGV[4]
          .. ' (its own bound)'
      end
    end
    if waiting >= max_waiting and not reclaimed and not own_full then
      reclaimed = true
      for _, c in ipairs(counted) do
        for _, e in ipairs(waiting_head(c, tonumber(ARGV[18]))) do
          local dl = field(e, 'dl')
          if dl and dl ~= '' and tonumber(dl) <= tonumber(now) then
            end_counted(c, e, 'expired', ARGV[16], ARGV[20])
            waiting = waiting - 1
          end
        end
      end
    end
    local admit = waiting < max_waiting and not own_full
    if not admit and not own_full and policy == 'drop_oldest' and ARGV[21] == 'submit' then
      local at, victim = oldest_waiting()
      if victim then
        end_counted(at, victim, 'dropped', ARGV[15], ARGV[19])
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
    local target = stream
    if own then  -- the route goes with it (fields r, rt), applied when it is admitted
      target = tq .. tenant
    elseif chosen then
      target = KEYS[F + 2 + 2 * chosen]
      if not group_state(target) then
        redis.call('XGROUP', 'CREATE', target, group, '0', 'MKSTREAM')
      end
      router.added(chosen)
    end
    if admit then
      local sid
      if own and chosen then
        sid = redis.call('XADD', target, '*', 'id', rid, 'd', payload, 'dl', deadline,
                         'n', prompt, 'r', ARGV[28 + chosen], 'rt', route)
        chosen = nil  -- (the record says where it runs once it is admitted)
      else
        sid = redis.call('XADD', target, '*', 'id', rid, 'd', payload, 'dl', deadline,
                         'n', prompt)
      end
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
        fields[n + 4] = ARGV[28 + chosen]
        n = n + 4
      end
      if own then  -- (no "tenant" field: "default", the reader's default)
        fields[n + 1] = 'tenant'
        fields[n + 2] = tenant
        fields[n + 3] = 'tenant_queued'
        fields[n + 4] = '1'
        n = n + 4
      end
      redis.call('HSET', rec, unpack(fields, 1, n))
      redis.call('PEXPIREAT', rec, expire_at)
      if own then
        tt_backlog(backlog, 1)
        tt_activate(active, book, tenant)
      end
      created[rid] = true
      fresh[#fresh + 1] = rid
      waiting = waiting + 1
    elseif own_full then
      answer(k - F - R, 'overloaded', own_full)
    elseif policy == 'block' and ARGV[21] == 'submit' then
      answer(k - F - R, 'full', 'queue ' .. ARGV[4] .. ' is full (' .. max_waiting .. ' waiting)')
    else
      answer(k - F - R, 'overloaded', 'queue ' .. ARGV[4] .. ' is full (' .. max_waiting
        .. ' waiting, policy ' .. policy .. ')')
    end
  end
end
-- a worker blocked on the shared stream wakes for work waiting in tenant queues: one is
-- admitted whenever nothing there is undelivered (worker_pull.lua admits the rest)
if fair and undelivered(stream) == 0 then
  local rt = nil  -- (the routers set and load hash are KEYS[F + 1], KEYS[F + 2] when C > 0)
  if C > 0 then
    local first = KEYS[F + 4]
    rt = {level = ARGV[6], now = tonumber(now), pre = string.sub(first, 1, #first - #ARGV[29]),
          group = group, me = '', seen = {}}
  end
  tt_admit(1, stream, active, backlog, book, tq, ARGV[9], ARGV[10], now, function(queue, rid)
    end_waiting(queue, '', rid, 'expired', ARGV[16], ARGV[20])
  end, rt, KEYS[F + 1], KEYS[F + 2])
end
redis.call('SADD', KEYS[3], ARGV[4])
if #fresh > 0 then
  redis.call('LPUSH', KEYS[8], unpack(fresh))
  redis.call('LTRIM', KEYS[8], 0, tonumber(ARGV[26]) - 1)
end
return out
