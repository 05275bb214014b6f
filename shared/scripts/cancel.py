"""Cancel a request, and expire a waiting request whose deadline has passed (producer side).

Both act on one request whose keys the caller knows (it read the record's model and priority
first) and both end the request through ``tf_finish``, so it gets exactly one terminal event.

* ``CANCEL``: a ``queued`` request is finished ``cancelled`` at once (its stream entry acked and
  deleted); a ``running`` one is added to the cancel set, which its worker checks every step; a
  terminal one is left alone.
* ``EXPIRE_OVERDUE``: a ``queued`` request whose deadline has passed is finished ``expired``;
  anything else is left alone. Clients run it from ``status()`` and while waiting on a result,
  so requests in a queue that no worker reads still end (see README "Deadlines").
"""

from __future__ import annotations

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalEvent
from tokenfleet.shared.scripts.finish import FINISH_FUNCTION
from tokenfleet.shared.scripts.registry import LuaScript

_HEADER_KEYS = """
-- KEYS[1] = request record hash          KEYS[2] = request token list
-- KEYS[3] = request channel              KEYS[4] = queue stream of the request
-- KEYS[5] = cancel set
-- ARGV[1] = request id                   ARGV[2] = encoded terminal event
-- ARGV[3] = now (epoch seconds)          ARGV[4] = record TTL in seconds
-- ARGV[5] = consumer group name          ARGV[6] = message for the record
"""

CANCEL = LuaScript(
    name="cancel",
    ok_codes=frozenset({"requested", "already"}),
    source=_HEADER_KEYS
    + """-- Returns {"ok"} (was queued: now cancelled), {"requested"} (running: its worker will stop
-- it), {"already", status} (terminal) or {"unknown", message} (no record).
"""
    + FINISH_FUNCTION
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'stream_id')
local status = h[1]
if not status then
  return {'unknown', 'no request ' .. ARGV[1] .. ' (never submitted, or its record expired)'}
end
if status == 'running' then
  redis.call('SADD', KEYS[5], ARGV[1])
  return {'requested'}
end
if status ~= 'queued' then
  return {'already', status}
end
return tf_finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'cancelled', ARGV[2],
                 ARGV[3], ARGV[4], h[2] or '', ARGV[5], '',
                 {'code', 'cancelled', 'message', ARGV[6], 'finish_reason', ''})
""",
)

EXPIRE_OVERDUE = LuaScript(
    name="expire_overdue",
    ok_codes=frozenset({"live", "already"}),
    source=_HEADER_KEYS
    + """-- Returns {"ok"} (it was queued past its deadline: now expired), {"live", status} (queued
-- within its deadline, or running), {"already", status} or {"unknown", message}.
"""
    + FINISH_FUNCTION
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'stream_id', 'deadline')
local status = h[1]
if not status then
  return {'unknown', 'no request ' .. ARGV[1] .. ' (never submitted, or its record expired)'}
end
if status ~= 'queued' and status ~= 'running' then
  return {'already', status}
end
local deadline = tonumber(h[3] or '')
if status ~= 'queued' or not deadline or deadline > tonumber(ARGV[3]) then
  return {'live', status}
end
return tf_finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'expired', ARGV[2],
                 ARGV[3], ARGV[4], h[2] or '', ARGV[5], '',
                 {'code', 'expired', 'message', ARGV[6], 'finish_reason', ''})
""",
)


def withdraw_keys_args(
    keys: Keys,
    event: TerminalEvent,
    *,
    model: str,
    priority: Priority,
    now: float,
    ttl_s: int,
) -> tuple[list[str], list[str]]:
    """KEYS and ARGV for :data:`CANCEL` and :data:`EXPIRE_OVERDUE`."""
    rid = event.request_id
    key_list = [
        keys.record(rid),
        keys.tokens(rid),
        keys.channel(rid),
        keys.stream(model, priority),
        keys.cancel_set,
    ]
    args = [
        rid,
        event.encode().decode(),
        repr(now),
        str(ttl_s),
        CONSUMER_GROUP,
        event.message or "",
    ]
    return key_list, args
