"""Cancel a request, and expire a waiting request whose deadline has passed (producer side).

Both act on one request whose keys the caller knows (it read the record's model and priority
first) and both end the request through ``tf_finish``, so it gets exactly one terminal event.

* ``CANCEL``: a ``queued`` request is finished ``cancelled`` at once (its stream entry acked and
  deleted); a ``running`` one is added to the cancel set, which its worker checks every step; a
  terminal one is left alone.
* ``EXPIRE_OVERDUE``: a ``queued`` request whose deadline has passed is finished ``expired``;
  anything else is left alone. Clients run it from ``status()`` and while waiting on a result,
  so requests in a queue that no worker reads still end (docs/client.md, "Deadlines").
"""

from __future__ import annotations

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalEvent
from tokenfleet.shared.scripts.registry import load_lua
from tokenfleet.shared.tenants import DEFAULT_TENANT

# Both take the same KEYS and ARGV (see :func:`withdraw_keys_args`).
CANCEL = load_lua("tokenfleet.shared.scripts", "cancel.lua", ok_codes=("requested", "already"))
EXPIRE_OVERDUE = load_lua(
    "tokenfleet.shared.scripts", "expire_overdue.lua", ok_codes=("live", "already")
)


def withdraw_keys_args(
    keys: Keys,
    event: TerminalEvent,
    *,
    model: str,
    priority: Priority,
    now: float,
    ttl_s: int,
    routed_to: str = "",
    tenant: str = "",
) -> tuple[list[str], list[str]]:
    """KEYS and ARGV for :data:`CANCEL` and :data:`EXPIRE_OVERDUE`. ``routed_to``: the
    record's (a queued request routed to that worker waits in its routed stream); ``tenant``:
    the record's ("" for the default tenant), whose tenant queue the request may wait in (the
    script reads the record's ``tenant_queued`` to know, atomically)."""
    rid = event.request_id
    key_list = [
        keys.record(rid),
        keys.tokens(rid),
        keys.channel(rid),
        keys.routed(model, priority, routed_to) if routed_to else keys.stream(model, priority),
        keys.cancel_set,
        keys.tally,
        keys.tenant_queue(model, priority, tenant or DEFAULT_TENANT),
        keys.tenant_backlog(model, priority),
    ]
    args = [
        rid,
        event.encode().decode(),
        repr(now),
        str(ttl_s),
        CONSUMER_GROUP,
        event.message or "",
        keys.publish_command,
    ]
    return key_list, args
