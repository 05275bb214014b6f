-- KEYS: none (an include, not a script: `-- @include tf_finish.lua` pastes it into finish.lua,
--       cancel.lua, expire_overdue.lua and enqueue.lua; tf_finish takes its keys as arguments
--       and every caller passes names it got through its own KEYS[])
-- ARGV: none
-- The terminal transition, shared by every script that ends a request (finish, cancel, expire,
-- the enqueue script's drop-oldest eviction and reclaim), so there is exactly one definition of
-- "reach a terminal state". ``fields`` is a flat {name, value, ...} table of record fields;
-- ``publish`` is the command that publishes on ``chan`` (each caller's ARGV gives it: PUBLISH,
-- or SPUBLISH on a Redis Cluster, where a plain PUBLISH is broadcast to every node).
-- Every transition is also counted in ``tally`` (the queue ends hash, Keys.tally: its request's
-- queue and status, in all and in the current minute's slot, shared/tally.py); a request that
-- ends ``error`` while its stream entry is still there leaves a copy of that entry in ``dead``
-- (the dead-letter stream, Keys.dead_letter), with the reason, its payload cut to ``keep``
-- bytes, the stream trimmed to about ``maxlen`` entries (shared/dead_letters.py), so that it
-- can be looked at and requeued: ``keep_failed`` (nil where the caller never ends a request
-- ``error``) is called with (stream, sid, rid, holder, fields) to do that (tf_keep_failed.lua).
-- Returns {"ok"} after publishing, {"already", status} if the record was already terminal (the
-- stream entry is still acked and deleted), or {"lost", holder} (nothing changed) if ``owner`` is
-- set and the live record is held by someone else, or is gone and the end is ``done`` (a record
-- Redis lost is never recreated as a truncated success; an error end is still written, so the
-- client sees why its request ended).
local function tf_count_end(tally, model, priority, status, now)
  if not model or model == '' or not priority or priority == '' then return end
  local base = model .. '|' .. priority .. '|' .. status
  redis.call('HINCRBY', tally, base, 1)
  local minute = math.floor(tonumber(now) / 60)
  local slot = base .. '|' .. (minute % 2)
  local held = redis.call('HGET', tally, slot)
  local at, n = nil, 0
  if held then at, n = string.match(held, '^(%d+) (%d+)$') end
  if tonumber(at) == minute then n = tonumber(n) + 1 else n = 1 end
  redis.call('HSET', tally, slot, string.format('%d %d', minute, n))
end

local function tf_finish(rec, toks, chan, stream, cancel_set, rid, status, event, now, ttl,
                         sid, group, owner, fields, publish, tally, keep_failed)
  local h = redis.call('HMGET', rec, 'status', 'worker', 'model', 'priority', 'ran_on')
  local current, holder = h[1], h[2] or ''
  local live = current == 'queued' or current == 'running'
  if owner ~= '' and ((not current and status == 'done') or (live and holder ~= owner)) then
    return {'lost', holder}  -- held by another, or gone (Redis lost it): no truncated success
  end
  local terminal = current == 'done' or current == 'cancelled' or current == 'expired'
      or current == 'dropped' or current == 'error'
  if sid ~= '' then
    if keep_failed and status == 'error' and current and not terminal then
      keep_failed(stream, sid, rid, holder ~= '' and holder or h[5] or '', fields)
    end
    redis.call('XACK', stream, group, sid)
    redis.call('XDEL', stream, sid)
  end
  redis.call('SREM', cancel_set, rid)
  if terminal then
    return {'already', current}
  end  -- a status no request has (a poisoned record) is overwritten like a live one
  tf_count_end(tally, h[3], h[4], status, now)
  redis.call('HSET', rec, 'status', status, 'finished_at', now, 'worker', '')
  for i = 1, #fields, 2 do
    redis.call('HSET', rec, fields[i], fields[i + 1])
  end
  if publish == 'SPUBLISH' then  -- a Redis Cluster: sharded pub/sub, on the slot's shard only
    redis.call('SPUBLISH', chan, event)
  else
    redis.call('PUBLISH', chan, event)
  end
  redis.call('EXPIRE', rec, ttl)
  redis.call('EXPIRE', toks, ttl)
  return {'ok'}
end
