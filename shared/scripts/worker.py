"""The worker's Lua scripts: start a request, append a step's tokens, hand a request back.

Each keeps one invariant of the durable record atomically:

* ``START`` moves ``queued -> running`` (or notices the request must not run), so a worker
  never starts a cancelled, expired, terminal or poisoned request.
* ``APPEND_TOKENS`` (all the requests of one engine step in one call) appends a request's
  tokens only while the caller still owns it and only at the index its list has reached, so
  the token list (and the channel) stays gap-free and duplicate-free even when a worker that
  was presumed dead wakes up.
* ``HANDBACK`` re-queues a running request at the tail of its stream (new entry, old one acked
  and deleted) so that any worker resumes it at once from its token list.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.scripts.registry import KeyOrArg, LuaScript

START = LuaScript(
    name="worker_start",
    ok_codes=frozenset({"missing", "foreign", "terminal", "cancelled", "expired", "poison"}),
    source="""
-- KEYS[1] = request record hash          KEYS[2] = queue stream of the entry
-- KEYS[3] = cancel set
-- ARGV[1] = request id                   ARGV[2] = worker name
-- ARGV[3] = now (epoch seconds)          ARGV[4] = stream entry id
-- ARGV[5] = consumer group name          ARGV[6] = poison limit (max workers per request)
-- ARGV[7] = deadline (epoch seconds) or ""
-- KEYS[4] = request token list
-- Returns one of
--   {"ok", attempts, num_tokens, event0, event1, ...}  now running, held by ARGV[2]; the
--                                 events are the token list (what earlier workers published)
--   {"missing"}                   no record (never enqueued properly, or its TTL lapsed)
--   {"foreign", stream_id}        the record belongs to another entry; this one is acked+deleted
--   {"terminal", status}          already ended; the entry is acked+deleted
--   {"cancelled"}                 cancellation was asked for: caller finishes it cancelled
--   {"expired"}                   never started and its deadline passed: caller finishes expired
--   {"poison", attempts}          taken by more than ARGV[6] workers: caller finishes worker_lost
local h = redis.call('HMGET', KEYS[1], 'status', 'stream_id', 'started_at', 'attempts',
                     'num_tokens')
local status = h[1]
if not status then
  return {'missing'}
end
if h[2] and h[2] ~= ARGV[4] then
  redis.call('XACK', KEYS[2], ARGV[5], ARGV[4])
  redis.call('XDEL', KEYS[2], ARGV[4])
  return {'foreign', h[2]}
end
if status ~= 'queued' and status ~= 'running' then
  redis.call('XACK', KEYS[2], ARGV[5], ARGV[4])
  redis.call('XDEL', KEYS[2], ARGV[4])
  return {'terminal', status}
end
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then
  return {'cancelled'}
end
local started = h[3] and h[3] ~= ''
if not started and ARGV[7] ~= '' and tonumber(ARGV[7]) <= tonumber(ARGV[3]) then
  return {'expired'}
end
local attempts = tonumber(h[4] or '0') + 1
if attempts > tonumber(ARGV[6]) then
  return {'poison', tostring(attempts - 1)}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[2], 'attempts', attempts)
if not started then
  redis.call('HSET', KEYS[1], 'started_at', ARGV[3])
end
local out = {'ok', tostring(attempts), h[5] or '0'}
if tonumber(h[5] or '0') > 0 then
  for _, ev in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
    out[#out + 1] = ev
  end
end
return out
""",
)

APPEND_TOKENS = LuaScript(
    name="worker_append_tokens",
    source="""
-- One engine step's tokens, every request of the step in one call (one script run per step
-- instead of one per request: less work for Redis and one reply for the worker to read).
-- KEYS[3i-2] = request i's record hash   KEYS[3i-1] = request i's token list
-- KEYS[3i]   = request i's channel       (i = 1 .. #KEYS / 3)
-- ARGV[1] = worker name                  ARGV[2] = now (epoch seconds)
-- ARGV[3] = record TTL in seconds
-- ARGV[4..] = for each request i, in KEYS order: the index of its first event, the number of
--             its events c, then its c encoded token events in index order
-- Returns {"ok", reply_1, ..., reply_n}, one reply per request: {"ok"}; {"lost", status,
-- holder} if the caller no longer runs it; or {"gap", length} if its list does not end at its
-- first index. Nothing is written for a request unless its reply is "ok".
local out = {'ok'}
local a = 4
for i = 1, #KEYS / 3 do
  local rec, list, ch = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local first, count = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local ev = a + 2
  a = ev + count
  local h = redis.call('HMGET', rec, 'status', 'worker')
  if h[1] ~= 'running' or h[2] ~= ARGV[1] then
    out[i + 1] = {'lost', tostring(h[1]), tostring(h[2])}
  else
    local n = redis.call('LLEN', list)
    if n ~= first then
      out[i + 1] = {'gap', tostring(n)}
    else
      for j = ev, a - 1 do
        redis.call('RPUSH', list, ARGV[j])
        redis.call('PUBLISH', ch, ARGV[j])
      end
      redis.call('HSET', rec, 'num_tokens', n + count)
      if first == 0 then
        redis.call('HSET', rec, 'first_token_at', ARGV[2])
        redis.call('EXPIRE', list, ARGV[3])
      end
      out[i + 1] = {'ok'}
    end
  end
end
return out
""",
)


def append_tokens_keys_args(
    keys: Keys,
    worker: str,
    now: float,
    ttl_s: int,
    batch: Sequence[tuple[str, int, Sequence[bytes]]],
) -> tuple[list[KeyOrArg], list[KeyOrArg]]:
    """KEYS and ARGV of ``APPEND_TOKENS`` for ``batch``: (request id, index of its first event,
    its encoded events) per request, in the order the replies come back."""
    k: list[KeyOrArg] = []
    a: list[KeyOrArg] = [worker, repr(now), ttl_s]
    for rid, first, events in batch:
        k += (keys.record(rid), keys.tokens(rid), keys.channel(rid))
        a += (first, len(events), *events)
    return k, a


HANDBACK = LuaScript(
    name="worker_handback",
    ok_codes=frozenset({"lost"}),
    source="""
-- KEYS[1] = request record hash          KEYS[2] = queue stream of the entry
-- ARGV[1] = request id                   ARGV[2] = worker name
-- ARGV[3] = stream entry id              ARGV[4] = consumer group name
-- ARGV[5] = entry field d (payload)
-- Returns {"ok", new_entry_id}: the request is queued again at the tail of its stream (the
-- handback does not count as an attempt; its deadline is dropped, field "deadline" and the new
-- entry's dl, because it has started; the new entry has h = 1: its record may hold tokens to
-- resume from); or {"lost"} if the caller no longer runs it (a terminal record's entry is still
-- acked and deleted).
local h = redis.call('HMGET', KEYS[1], 'status', 'worker')
if h[1] ~= 'running' or h[2] ~= ARGV[2] then
  if h[1] and h[1] ~= 'running' and h[1] ~= 'queued' then
    redis.call('XACK', KEYS[2], ARGV[4], ARGV[3])
    redis.call('XDEL', KEYS[2], ARGV[3])
  end
  return {'lost'}
end
local new = redis.call('XADD', KEYS[2], '*', 'id', ARGV[1], 'd', ARGV[5], 'dl', '', 'h', '1')
redis.call('XACK', KEYS[2], ARGV[4], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '', 'stream_id', new)
redis.call('HDEL', KEYS[1], 'deadline')
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
return {'ok', new}
""",
)

PULL = LuaScript(
    name="worker_pull",
    source="""
-- KEYS[1..n] = queue streams, in the order to read them (most urgent first, starved ones before)
-- ARGV[1] = consumer group name          ARGV[2] = consumer (the worker's name)
-- ARGV[3] = budget: entries to read at most, over all streams
-- Returns {"ok", levels_read, groups_lost, reply...}: one XREADGROUP reply ({stream, entries})
-- per stream that had new entries; levels_read counts the streams read (empty or not) before
-- the budget ran out; groups_lost is 1 if a stream or its group was missing (deleted, e.g. by
-- FLUSHALL: the caller recreates them). Entries read from the other streams are returned all
-- the same: they are in the caller's pending list now. One round trip instead of one
-- XREADGROUP per priority.
local left = tonumber(ARGV[3])
local out = {'ok', 0, 0}
for i = 1, #KEYS do
  if left <= 0 then
    break
  end
  out[2] = i
  local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left,
                        'STREAMS', KEYS[i], '>')
  if type(r) == 'table' and r.err then
    out[3] = 1
  elseif r then
    out[#out + 1] = r[1]
    left = left - #r[1][2]
  end
end
return out
""",
)
