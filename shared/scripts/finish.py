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

from tokenfleet.shared import dead_letters
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalEvent
from tokenfleet.shared.scripts.registry import load_lua

# The terminal transition is one Lua function, ``tf_finish`` in tf_finish.lua, included by every
# script that ends a request (finish, cancel, expire, the enqueue script's eviction and reclaim),
# so there is exactly one definition of "reach a terminal state".
FINISH = load_lua("tokenfleet.shared.scripts", "finish.lua", ok_codes=("already", "lost"))


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
    stream: str | None = None,
    tenant: str | None = None,
    prompt_tokens: int = 0,
) -> tuple[list[str], list[str]]:
    """KEYS and ARGV for :data:`FINISH`, so every caller builds them the same way.

    The terminal event's own fields (finish_reason, code, message, usage, timings) are written
    into the record too; ``extra_fields`` adds more (e.g. the final ``text``). ``owner`` is the
    finishing worker's name when it runs the request (see the module's ownership guard).
    ``stream`` is the stream its entry is in (default: the shared stream of (model, priority));
    an entry read from a worker's routed stream is acked and deleted there. The end is counted
    in the queue's tally (``shared.tally``); an ``error`` end copies the entry to the
    dead-letter stream (``shared.dead_letters``). ``tenant`` (a worker ending a request it
    ran; "" for one that was not admitted through a tenant queue) counts its tokens served,
    ``prompt_tokens`` and the event's ``num_tokens``, and charges the output to a tenant's
    virtual time (docs/fairness.md); None (the default) counts nothing.
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
        keys.publish_command,
        str(dead_letters.PAYLOAD_BYTES),
        str(dead_letters.MAXLEN),
    ]
    if tenant is not None:
        output = max(0, event.num_tokens)
        args += [tenant, str(prompt_tokens + output), str(output)]
    for name, value in fields.items():
        args += [name, value]
    key_list = [
        keys.record(rid),
        keys.tokens(rid),
        keys.channel(rid),
        stream or keys.stream(model, priority),
        keys.cancel_set,
        keys.tally,
        keys.dead_letter,
    ]
    if tenant is not None:
        key_list += [keys.tenant_book(model), keys.tenants_active(model, priority)]
    return key_list, args
