"""The one place a request reaches its terminal state.

Used by the worker (done, error, cancelled, expired) and by the producer side (dropped by a
drop-oldest queue, expired or cancelled while still waiting). Atomically: unless the record is
already terminal, set the terminal fields, publish the terminal event, and remove the request's
entry from its queue stream (XACK + XDEL). If the record is already terminal, only the stream
entry is cleaned up and nothing is published, so a request never gets two terminal events.

Ownership guard (``owner``): a worker finishing a request it runs passes its name; if the record
is still live but held by someone else (another worker claimed it after this one's heartbeat
lapsed, or it was handed back), the script changes nothing, not even the stream entry, and
returns ``{"lost", holder}``. Callers that do not own the request (producer side, expiry of a
request that never started) pass ``""``.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalEvent
from tokenfleet.shared.scripts.registry import LuaScript

# The terminal transition as a Lua function, shared by every script that ends a request (finish,
# cancel, expire, the enqueue script's drop-oldest eviction), so there is exactly one definition
# of "reach a terminal state". ``fields`` is a flat {name, value, ...} table of record fields.
FINISH_FUNCTION = """
local function tf_finish(rec, toks, chan, stream, cancel_set, rid, status, event, now, ttl,
                         sid, group, owner, fields)
  local h = redis.call('HMGET', rec, 'status', 'worker')
  local current, holder = h[1], h[2] or ''
  local live = current == 'queued' or current == 'running'
  if owner ~= '' and live and holder ~= owner then
    return {'lost', holder}
  end
  if sid ~= '' then
    redis.call('XACK', stream, group, sid)
    redis.call('XDEL', stream, sid)
  end
  redis.call('SREM', cancel_set, rid)
  if current and not live then
    return {'already', current}
  end
  redis.call('HSET', rec, 'status', status, 'finished_at', now, 'worker', '')
  for i = 1, #fields, 2 do
    redis.call('HSET', rec, fields[i], fields[i + 1])
  end
  redis.call('PUBLISH', chan, event)
  redis.call('EXPIRE', rec, ttl)
  redis.call('EXPIRE', toks, ttl)
  return {'ok'}
end
"""

FINISH = LuaScript(
    name="finish",
    ok_codes=frozenset({"already", "lost"}),
    source="""
-- KEYS[1] = request record hash          KEYS[2] = request token list
-- KEYS[3] = request channel              KEYS[4] = queue stream of the request
-- KEYS[5] = cancel set
-- ARGV[1] = request id                   ARGV[2] = terminal status (done|cancelled|...)
-- ARGV[3] = encoded terminal event       ARGV[4] = now (epoch seconds)
-- ARGV[5] = record TTL in seconds        ARGV[6] = stream entry id, or "" if none
-- ARGV[7] = consumer group name          ARGV[8] = finishing worker's name, or "" (no guard)
-- ARGV[9..] = extra record fields as field, value pairs (text, finish_reason, usage, ...)
-- Returns {"ok"} after publishing, {"already", status} if the record was already terminal, or
-- {"lost", holder} (nothing changed) if ARGV[8] is set and the live record is not held by it.
"""
    + FINISH_FUNCTION
    + """
local fields = {}
for i = 9, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
return tf_finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2], ARGV[3],
                 ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], fields)
""",
)


def finish_keys_args(
    keys: Keys,
    event: TerminalEvent,
    *,
    model: str,
    priority: Priority,
    now: float,
    ttl_s: int,
    stream_id: str = "",
    extra_fields: Mapping[str, str] | None = None,
    owner: str = "",
) -> tuple[list[str], list[str]]:
    """KEYS and ARGV for :data:`FINISH`, so every caller builds them the same way.

    The terminal event's own fields (finish_reason, code, message, usage, timings) are written
    into the record too; ``extra_fields`` adds more (e.g. the final ``text``). ``owner`` is the
    finishing worker's name when it runs the request (see the module's ownership guard).
    """
    rid = event.request_id
    fields: dict[str, str] = {
        "finish_reason": event.finish_reason or "",
        "code": event.code or "",
        "message": event.message or "",
        "usage": orjson.dumps(event.usage).decode(),
        "timings": orjson.dumps(event.timings).decode(),
    }
    fields.update(extra_fields or {})
    args = [
        rid,
        event.status.value,
        event.encode().decode(),
        repr(now),
        str(ttl_s),
        stream_id,
        CONSUMER_GROUP,
        owner,
    ]
    for name, value in fields.items():
        args += [name, value]
    key_list = [
        keys.record(rid),
        keys.tokens(rid),
        keys.channel(rid),
        keys.stream(model, priority),
        keys.cancel_set,
    ]
    return key_list, args
