-- KEYS: none (an include, not a script: `-- @include tf_tenants.lua` pastes it into enqueue.lua,
--       worker_pull.lua, worker_overflow.lua and finish.lua, after tf_route.lua, and includes
--       tf_backlog.lua; its functions take their keys as arguments: the queue's streams, its
--       active-tenants set and tenant backlog, the lane's tenant book and the model's routers
--       set and load hash come from the caller's KEYS[]; a tenant's queue, a request's record
--       and a worker's routed stream are built by the caller from templates that
--       tokenfleet.shared.keys.Keys made, all in the model's lane: docs/protocol.md, "Keys in
--       scripts")
-- ARGV: none
-- Fair admission between tenants (docs/fairness.md), the virtual token counter of Sheng et al.
-- (OSDI 2024) kept in Redis. Per queue (model, priority):
--   tenant queue  P:tq:M:L:T  stream of T's waiting requests (fields id, d, dl, n: prompt tokens;
--                             r and rt: the worker the enqueue routed it to and why, tf_route;
--                             the record of a request waiting there has tenant = T and
--                             tenant_queued = "1", emptied when it is admitted)
--   active set    P:tact:M:L  sorted set: backlogged tenant -> its virtual time
--   backlog       P:tlen:M:L  list: one element per entry of the queue's tenant queues (its LLEN
--                             is their total, what KEDA adds to the shared stream's lag)
--   book          P:tbook:M   hash: "vt|T" virtual time (weighted tokens served, per model),
--                             "w|T" weight, "max|T" own bound ("" or absent: none), "at|T"
--                             when those two were set (tt_seed), "served|T", "admitted|T"
-- Invariants:
--   * a tenant is in the active set iff its tenant queue may hold entries (a member whose queue
--     turned out empty is removed when the picker meets it), and its score is its "vt|T";
--   * admission (tt_admit) takes the head of the active tenant with the least virtual time, moves
--     it to the queue's shared stream (a new entry with field t = tenant and o = the id it had
--     when enqueued, its age for drop-oldest; the record's stream_id follows it) and charges its
--     prompt tokens / weight, in one script: any number of workers and producers agree on the
--     order. A request that was routed (field r) goes into that worker's routed stream instead
--     while the worker is still a routing target (tf_route.lua's rule: live, serving the level,
--     load below twice its max_num_seqs), its record's route and routed_to set then; else into
--     the shared stream, its record without them (route "shared");
--   * the backlog's length is the number of entries in the queue's tenant queues: every XADD to
--     a tenant queue pushes one element (tt_backlog), every XDEL that removed one pops one; it is
--     deleted when the active set becomes empty (every tenant queue is empty then), which also
--     mends it should it ever have drifted;
--   * a tenant that becomes backlogged again starts at max(its own, the least active) virtual
--     time (tt_activate): idling banks no credit.
-- @include tf_backlog.lua

local function tt_weight(book, tenant)
  local w = tonumber(redis.call('HGET', book, 'w|' .. tenant) or '')
  if not w or w <= 0 then w = 1 end
  return w
end

-- charge `tokens` of service to `tenant`: its virtual time grows by tokens / weight
local function tt_charge(active, book, tenant, tokens)
  if tokens <= 0 then return end
  local d = tokens / tt_weight(book, tenant)
  redis.call('HINCRBYFLOAT', book, 'vt|' .. tenant, d)
  redis.call('ZADD', active, 'XX', 'INCR', d, tenant)
end

-- mark `tenant` backlogged (no-op when it is), lifted to the least active virtual time
local function tt_activate(active, book, tenant)
  if redis.call('ZSCORE', active, tenant) then return end
  local vt = tonumber(redis.call('HGET', book, 'vt|' .. tenant) or '0') or 0
  local least = redis.call('ZRANGE', active, 0, 0, 'WITHSCORES')
  if least[2] and tonumber(least[2]) > vt then
    vt = tonumber(least[2])
    redis.call('HSET', book, 'vt|' .. tenant, least[2])
  end
  redis.call('ZADD', active, vt, tenant)
end

-- `tenant`'s queue turned out empty: it leaves the active set (and with the last one, the
-- backlog list goes: nothing waits in a tenant queue then)
local function tt_deactivate(active, backlog, tenant)
  redis.call('ZREM', active, tenant)
  if backlog and redis.call('ZCARD', active) == 0 then redis.call('DEL', backlog) end
end

local function tt_field(entry, name)
  local f = entry[2]
  for i = 1, #f, 2 do
    if f[i] == name then return f[i + 1] end
  end
  return nil
end

-- entries of `tt_stream` not yet delivered to `group` (XLEN - pending), and whether it has the
-- group (what the enqueue script counts; Redis 6.2 has no XINFO lag)
local function tt_undelivered(tt_stream, group)
  local groups = redis.pcall('XINFO', 'GROUPS', tt_stream)
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      local name, pending
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'pending' then pending = g[j + 1] end
      end
      if name == group then
        return redis.call('XLEN', tt_stream) - (tonumber(pending) or 0), true
      end
    end
  end
  return 0, false
end

-- Where an admitted request goes when it was routed while it waited (the entry's field r: its
-- worker): that worker's state and routed stream while the worker is a routing target
-- (tf_route.lua's route_target, its load below twice its max_num_seqs); nil: the shared stream.
-- `rt` (nil: no routing at admission) holds the level's routed streams' name before a worker's
-- (pre), the level, now, the consumer group, the caller's worker name (me, "" for none) and
-- `seen`: each worker's state in this call; `routers` and `loads` are the model's routers set
-- and load hash.
local function tt_routed(rt, worker, routers, loads)
  if not rt or not worker or worker == '' then return nil end
  local routed_stream = rt.pre .. worker
  local t = rt.seen[worker]
  if not t then
    local live, running, cap = route_target(routers, loads, worker, rt.now, rt.level)
    local queued, grouped = tt_undelivered(routed_stream, rt.group)
    t = {live = live, load = running + queued, cap = cap, grouped = grouped}
    rt.seen[worker] = t
  end
  if not t.live or t.load >= 2 * t.cap then return nil end
  if not t.grouped then
    redis.call('XGROUP', 'CREATE', routed_stream, rt.group, '0', 'MKSTREAM')
    t.grouped = true
  end
  return t, routed_stream
end

-- Admit `head`, the first entry of `tenant`'s queue `queue`, into stream `into`, charging its
-- prompt tokens (the caller pops the backlog list for it). `rec_pre`/`rec_suf` surround a
-- request id in its record's name. An entry whose request is no longer queued there (ended
-- while it waited; cancel, expiry and eviction normally remove it at once) is removed without
-- admitting or charging it; one whose deadline is not after `now` is removed and ended by
-- `expire(queue, rid)` (the caller's tf_finish: "expired"), neither admitted nor charged.
-- Returns the record's name, or nil when it was not admitted.
local function tt_admit_head(tenant, queue, head, into, active, book, rec_pre, rec_suf, now,
                             expire)
  redis.call('XDEL', queue, head[1])
  local rid = tt_field(head, 'id') or ''
  local rec = rec_pre .. rid .. rec_suf
  local held = redis.call('HMGET', rec, 'status', 'stream_id')
  local dl = tonumber(tt_field(head, 'dl') or '')
  if held[1] ~= 'queued' or held[2] ~= head[1] then
    return nil  -- ended while it waited, or a stale entry: nothing to admit
  elseif dl and dl <= tonumber(now) then
    expire(queue, rid)
    return nil
  end
  local prompt = tonumber(tt_field(head, 'n') or '') or 0
  local sid = redis.call('XADD', into, '*', 'id', rid, 'd', tt_field(head, 'd') or '',
                         'dl', tt_field(head, 'dl') or '', 't', tenant, 'n', prompt,
                         'o', tt_field(head, 'o') or head[1])
  redis.call('HSET', rec, 'stream_id', sid, 'tenant_queued', '')
  redis.call('HINCRBY', book, 'admitted|' .. tenant, 1)
  tt_charge(active, book, tenant, math.max(prompt, 1))
  return rec
end

-- Admit waiting requests from the tenant queues, each from the active tenant with the least
-- virtual time (tt_admit_head), into `stream` (the queue's shared stream) or, routed (`rt`,
-- tt_routed: its record gets route and routed_to then), into its worker's routed stream, until
-- `n` of them went to `stream` or to worker `rt.me`'s routed stream (what the caller reads
-- next; the others wake their workers). `tq` is the tenant queue's name before the tenant (the
-- names end with it). Returns how many went to `stream` or to `rt.me`.
local function tt_admit(n, stream, active, backlog, book, tq, rec_pre, rec_suf, now, expire, rt,
                        routers, loads)
  local moved, taken = 0, 0
  while moved < n do
    local least = redis.call('ZRANGE', active, 0, 0)
    local tenant = least[1]
    if not tenant then break end
    local queue = tq .. tenant
    local firsts = redis.call('XRANGE', queue, '-', '+', 'COUNT', 2)  -- (a second: not last)
    local head = firsts[1]
    if not head then
      tt_deactivate(active, backlog, tenant)
    else
      taken = taken + 1
      local worker = tt_field(head, 'r')
      local into = stream
      local target, routed_stream = tt_routed(rt, worker, routers, loads)
      if target then
        into = routed_stream
      end
      local rec = tt_admit_head(tenant, queue, head, into, active, book, rec_pre, rec_suf, now,
                                expire)
      if rec and target then
        target.load = target.load + 1
        redis.call('HSET', rec, 'route', tt_field(head, 'rt') or '', 'routed_to', worker)
      end
      if rec and (not target or worker == rt.me) then moved = moved + 1 end
      if not firsts[2] then  -- its queue is empty now
        tt_deactivate(active, backlog, tenant)
      end
    end
  end
  tt_backlog(backlog, -taken)  -- (after a DEL by tt_deactivate: nothing left to pop)
  return moved
end

-- when `entry` of a tenant queue was enqueued, in ms (its field o, else its id: docs/fairness.md)
local function tt_since_ms(entry)
  return tonumber(string.match(tt_field(entry, 'o') or entry[1], '^(%d+)')) or 0
end

-- An overflow worker's admission (worker_overflow.lua): up to `n` requests into `stream` (the
-- shared stream, never a routed one: the caller takes them at once), each the head of the
-- tenant with the least virtual time among those whose head has waited at least `age` ms by
-- `now_ms`; admitted (or ended expired) as by tt_admit_head. Returns how many were admitted.
local function tt_admit_aged(n, stream, active, backlog, book, tq, rec_pre, rec_suf, now_ms, age,
                             expire)
  local vt = {}  -- tenant -> its virtual time, while its head is aged
  local members = redis.call('ZRANGE', active, 0, -1, 'WITHSCORES')
  for j = 1, #members, 2 do
    local queue = tq .. members[j]
    local head = redis.call('XRANGE', queue, '-', '+', 'COUNT', 1)[1]
    if head and now_ms - tt_since_ms(head) >= age then vt[members[j]] = tonumber(members[j + 1]) end
  end
  local moved, taken = 0, 0
  while moved < n do
    local tenant = nil
    for t, v in pairs(vt) do
      if not tenant or v < vt[tenant] or (v == vt[tenant] and t < tenant) then tenant = t end
    end
    if not tenant then break end
    local queue = tq .. tenant
    local firsts = redis.call('XRANGE', queue, '-', '+', 'COUNT', 2)  -- (a second: not last)
    local head = firsts[1]
    local aged = head and now_ms - tt_since_ms(head) >= age
    if aged then
      taken = taken + 1
      if tt_admit_head(tenant, queue, head, stream, active, book, rec_pre, rec_suf,
                       now_ms / 1000, expire) then
        moved = moved + 1
      end
      vt[tenant] = tonumber(redis.call('ZSCORE', active, tenant) or '') or vt[tenant]
    else
      vt[tenant] = nil  -- (its head has not waited that long: not this call's)
    end
    if not head or (aged and not firsts[2]) then  -- its queue is empty now
      tt_deactivate(active, backlog, tenant)
      vt[tenant] = nil
    end
  end
  tt_backlog(backlog, -taken)  -- (after a DEL by tt_deactivate: nothing left to pop)
  return moved
end

-- End request `rid`, met at admission (PULL, OVERFLOW) with its deadline passed, as tf_finish
-- does ("expired"; its tenant-queue entry `queue` is already deleted): ARGV[x .. x + 9] hold
-- now, the record TTL, the publish command, a token list's and a channel's name around the id,
-- the encoded "expired" event with the placeholder ARGV[x + 8] for the id, and the message
-- (enqueue.py's expiry_args); `cancel_set` and `tally` are the caller's KEYS.
local function tt_expire(x, queue, rid, rec_pre, rec_suf, cancel_set, tally, group)
  local event = ARGV[x + 7]
  local at = string.find(event, ARGV[x + 8], 1, true)
  event = string.sub(event, 1, at - 1) .. rid .. string.sub(event, at + #ARGV[x + 8])
  local expired_record = rec_pre .. rid .. rec_suf
  local expired_tokens = ARGV[x + 3] .. rid .. ARGV[x + 4]
  local expired_channel = ARGV[x + 5] .. rid .. ARGV[x + 6]
  tf_finish(expired_record, expired_tokens, expired_channel, queue, cancel_set, rid, 'expired',
            event, ARGV[x], ARGV[x + 1], '', group, '',
            {'code', 'expired', 'message', ARGV[x + 9], 'finish_reason', ''}, ARGV[x + 2],
            tally, nil)
end

-- Store a tenant's settings as `tokenfleet tenants set` stored them in the fleet's hash (which
-- lives in another slot on a Redis Cluster: the producer read them and passes them here), unless
-- the book holds settings set at `at` or later ("at|T"): a model used for the first time after a
-- set gets them with its first requests, and a producer's stale copy never undoes a newer set.
-- `bound` "" is no own bound (stored as "": readers take it as none; no HDEL, which producers'
-- ACL users are not granted).
local function tt_seed(book, tenant, weight, bound, at)
  local held = tonumber(redis.call('HGET', book, 'at|' .. tenant) or '')
  if held and held >= tonumber(at) then return end
  redis.call('HSET', book, 'w|' .. tenant, weight, 'max|' .. tenant, bound, 'at|' .. tenant, at)
end
