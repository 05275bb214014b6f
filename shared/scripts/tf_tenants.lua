-- KEYS: none (an include, not a script: `-- @include tf_tenants.lua` pastes it into enqueue.lua,
--       worker_pull.lua and finish.lua, and includes tf_backlog.lua; its functions take their
--       keys as arguments: the queue's streams, its active-tenants set and tenant backlog and the
--       lane's tenant book come from the caller's KEYS[]; a tenant's queue and a request's
--       record are built by the caller from templates that tokenfleet.shared.keys.Keys made,
--       both in the model's lane: docs/protocol.md, "Keys in scripts")
-- ARGV: none
-- Fair admission between tenants (docs/fairness.md), the virtual token counter of Sheng et al.
-- (OSDI 2024) kept in Redis. Per queue (model, priority):
--   tenant queue  P:tq:M:L:T  stream of T's waiting requests (fields id, d, dl, n: prompt tokens;
--                             the record of a request waiting there has tenant = T and
--                             tenant_queued = "1", emptied when it is admitted)
--   active set    P:tact:M:L  sorted set: backlogged tenant -> its virtual time
--   backlog       P:tlen:M:L  list: one element per entry of the queue's tenant queues (its LLEN
--                             is their total, what KEDA adds to the shared stream's lag)
--   book          P:tbook:M   hash: "vt|T" virtual time (weighted tokens served, per model),
--                             "w|T" weight, "max|T" own bound, "served|T", "admitted|T"
-- Invariants:
--   * a tenant is in the active set iff its tenant queue may hold entries (a member whose queue
--     turned out empty is removed when the picker meets it), and its score is its "vt|T";
--   * admission (tt_admit) takes the head of the active tenant with the least virtual time, moves
--     it to the queue's shared stream (a new entry with field t = tenant and o = the id it had
--     when enqueued, its age for drop-oldest; the record's stream_id follows it) and charges its prompt tokens / weight, in one script: any number of workers
--     and producers agree on the order;
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

-- Admit up to `n` waiting requests from the tenant queues into `stream` (the queue's shared
-- stream), each from the active tenant with the least virtual time; `backlog` follows (the
-- queue's backlog list). `tq` is the tenant queue's name before the tenant (the names end with
-- it); `rec_pre`/`rec_suf` surround a request id in its record's name. An entry whose request is no longer queued there (ended while it waited;
-- cancel, expiry and eviction normally remove it at once) is removed without admitting or
-- charging it; one whose deadline is not after `now` is removed and ended by
-- `expire(queue, rid)` (the caller's tf_finish: "expired"), neither admitted nor charged.
-- Returns how many were admitted.
local function tt_admit(n, stream, active, backlog, book, tq, rec_pre, rec_suf, now, expire)
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
      redis.call('XDEL', queue, head[1])
      taken = taken + 1
      local rid = tt_field(head, 'id') or ''
      local rec = rec_pre .. rid .. rec_suf
      local held = redis.call('HMGET', rec, 'status', 'stream_id')
      local dl = tonumber(tt_field(head, 'dl') or '')
      if held[1] ~= 'queued' or held[2] ~= head[1] then
        -- ended while it waited, or a stale entry: nothing to admit
      elseif dl and dl <= tonumber(now) then
        expire(queue, rid)
      else
        local prompt = tonumber(tt_field(head, 'n') or '') or 0
        local sid = redis.call('XADD', stream, '*', 'id', rid, 'd', tt_field(head, 'd') or '',
                               'dl', tt_field(head, 'dl') or '', 't', tenant, 'n', prompt,
                               'o', tt_field(head, 'o') or head[1])
        redis.call('HSET', rec, 'stream_id', sid, 'tenant_queued', '')
        redis.call('HINCRBY', book, 'admitted|' .. tenant, 1)
        tt_charge(active, book, tenant, math.max(prompt, 1))
        moved = moved + 1
      end
      if not firsts[2] then  -- its queue is empty now
        tt_deactivate(active, backlog, tenant)
      end
    end
  end
  tt_backlog(backlog, -taken)  -- (after a DEL by tt_deactivate: nothing left to pop)
  return moved
end
