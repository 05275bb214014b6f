"""The producer's enqueue: validate ids, dedupe, check the bound, evict or refuse, XADD.

One script call enqueues a batch of requests into one (model, priority) queue, so ``submit`` (a
batch of one) and ``submit_many`` (many per call) share one code path. Invariants, under any
interleaving of producers:

* waiting (``XLEN - pending``) never exceeds the queue's ``max_waiting`` after the script;
* a request id with a record is never enqueued again (idempotent client-supplied ids); the
  record keeps the request's fingerprint (:func:`~tokenfleet.shared.schema.request.
  request_fingerprint`) when the client chose the id, and a resubmit whose fingerprint differs
  is refused (``conflict``);
* a request for a model that no live worker serves (``Keys.served``) and the fleet does not
  declare (``Keys.declared``) is refused (``unserved``) with nothing written, unless the fleet
  is empty (declares nothing and has no live worker); one accepted while its model has no live
  worker gets ``waiting_on`` in its record;
* an evicted request (drop-oldest) or a reclaimed one (deadline passed while waiting) goes
  through ``tf_finish``: its record turns terminal and its channel gets the terminal event.

Every key of the call's own requests comes through ``KEYS[]`` (one record key per request, built
by :class:`~tokenfleet.shared.keys.Keys`). The keys of evicted or reclaimed *waiting* requests
cannot: which requests those are is decided inside the script, from the stream. The script builds
them from prefix/suffix templates that ``Keys`` produces (never from names of its own), in one
function, ``victim_keys``; docs/protocol.md ("Keys in scripts") says what a Redis Cluster
deployment needs instead. Tokenfleet targets one Redis (or a primary).

Routing (docs/routing.md): with a :class:`RouteTargets` (the model's routing candidates, read
by the producer from ``Keys.routers``), each request carries its session key and prefix chain
and may go to a candidate's routed stream instead of the shared one; the bound counts the
routed streams' waiting entries too (see the script's header).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.prefix_chain import model_session_hash
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.queue_config import DEFAULT_QUEUE_CONFIG
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, request_fingerprint
from tokenfleet.shared.scripts.registry import load_lua
from tokenfleet.shared.tenants import DEFAULT_TENANT, TenantSettings

# How many of the oldest waiting entries a full queue inspects for passed deadlines before it
# evicts or refuses (bounded work per call; docs/client.md, "Deadlines").
RECLAIM_SCAN = 16
# How many of the newest request ids the recent list (``Keys.recent``) keeps per lane: what the
# console lists (bounded: one LPUSH and one LTRIM per enqueue call).
RECENT_REQUESTS = 1_000
ID_PLACEHOLDER = "tfid-placeholder"
DROPPED_MESSAGE = "evicted from its full queue by a newer request (policy drop_oldest)"
EXPIRED_MESSAGE = "its deadline passed before any worker started it"

# Read once, at import; registered once per connection by the registry.
ENQUEUE = load_lua("tokenfleet.shared.scripts", "enqueue.lua")


class EnqueueItemLike(Protocol):
    """What the enqueue script takes of a request (``EnqueueItem``, or the producer's prepared
    request as it is)."""

    @property
    def request_id(self) -> str: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def deadline(self) -> float | None: ...
    @property
    def chosen_id(self) -> bool: ...
    @property
    def session(self) -> str | None: ...
    @property
    def chain(self) -> tuple[str, ...]: ...
    @property
    def tenant(self) -> str: ...
    @property
    def weight(self) -> float | None: ...
    @property
    def prompt_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class EnqueueItem:
    """One request as the enqueue script takes it: id, encoded payload, deadline or None, and
    whether the client chose the id (only then is its fingerprint sent and kept)."""

    request_id: str
    payload: bytes
    deadline: float | None
    chosen_id: bool = True
    session: str | None = None  # the session key (``prefix_chain.session_of``), or None
    chain: tuple[str, ...] = ()  # the prefix chain (``prefix_chain.prefix_chain``)
    tenant: str = DEFAULT_TENANT  # who submitted it (docs/fairness.md)
    weight: float | None = None  # the tenant's weight to record with it; None: as it is
    prompt_tokens: int = 0  # its prompt's tokens as the producer counts them (admission's charge)


@dataclass(frozen=True, slots=True)
class RouteTargets:
    """The workers an enqueue call may route to (the model's routers the producer knows) and
    how long a session stays pinned. Empty ``workers``: routing on, nobody to route to yet."""

    workers: tuple[str, ...]
    session_ttl_s: int = 600


def _template(keys_method: object, marker: str = ID_PLACEHOLDER) -> tuple[str, str]:
    name = keys_method(marker)  # type: ignore[operator]
    before, _, after = name.partition(marker)
    return before, after


def expiry_args(keys: Keys) -> list[str | bytes]:
    """What a script that ends waiting requests ``expired`` by itself needs to name and tell
    them: a token list's and a channel's name around a request id, the encoded terminal event
    with :data:`ID_PLACEHOLDER` in place of the id, that placeholder, and the message
    (worker_pull.lua's admission; enqueue.lua takes the same among its ARGV)."""
    expired = TerminalEvent(
        ID_PLACEHOLDER, TerminalStatus.EXPIRED, message=EXPIRED_MESSAGE
    ).encode()
    return [
        *_template(keys.tokens),
        *_template(keys.channel),
        expired,
        ID_PLACEHOLDER,
        EXPIRED_MESSAGE,
    ]


def enqueue_keys_args(
    keys: Keys,
    model: str,
    priority: Priority,
    items: Sequence[EnqueueItemLike],
    *,
    now: float,
    ttl_s: int,
    try_only: bool = False,
    route: RouteTargets | None = None,
    always_fair: bool = False,
    tenant_settings: Mapping[str, TenantSettings] | None = None,
) -> tuple[list[str], list[str | bytes]]:
    """KEYS and ARGV for :data:`ENQUEUE` (one queue, any number of requests): the queue's four
    keys, the fleet's two model keys, the lane's tally and recent list, the queue's active
    tenants, the model's tenant book and the queue's tenant backlog, the routing keys, then
    one record key per item, in the items' order.

    ``try_only`` refuses when the queue is full whatever its policy (``try_submit``). A request
    whose id the client chose carries its fingerprint (the idempotency check); one with a
    generated id carries "" (no other request can hold that id, so there is nothing to compare,
    and bulk work is spared the hash: about a microsecond per request, measured). ``route``
    None: routing off (everything to the shared stream, only its waiting entries counted).
    Each item's tenant, weight and prompt tokens go with it (docs/fairness.md); ``always_fair``
    sends every request through its tenant queue, the default tenant's too.
    ``tenant_settings``: tenants' settings as the fleet's hash holds them (``Keys.tenants``,
    another slot on a cluster), stored in the model's book unless it holds newer ones.
    """
    member = keys.queue_member(model, priority)
    dropped = TerminalEvent(
        ID_PLACEHOLDER, TerminalStatus.DROPPED, message=DROPPED_MESSAGE
    ).encode()
    expired = TerminalEvent(
        ID_PLACEHOLDER, TerminalStatus.EXPIRED, message=EXPIRED_MESSAGE
    ).encode()
    args: list[str | bytes] = [
        repr(now),
        str(ttl_s),
        CONSUMER_GROUP,
        member,
        model,
        priority.label,
        str(DEFAULT_QUEUE_CONFIG.max_waiting),
        DEFAULT_QUEUE_CONFIG.policy.value,
        *_template(keys.record),
        *_template(keys.tokens),
        *_template(keys.channel),
        dropped,
        expired,
        ID_PLACEHOLDER,
        str(RECLAIM_SCAN),
        DROPPED_MESSAGE,
        EXPIRED_MESSAGE,
        "try" if try_only else "submit",
        keys.publish_command,
    ]
    key_list = [
        keys.stream(model, priority),
        keys.queue_config(model, priority),
        keys.queues,
        keys.cancel_set,
        keys.served,
        keys.declared,
        keys.tally,
        keys.recent,
        keys.tenants_active(model, priority),
        keys.tenant_book(model),
        keys.tenant_backlog(model, priority),
    ]
    workers = route.workers if route is not None else ()
    route_keys: list[str] = []
    session_at: dict[str, int] = {}  # session key -> its KEYS index (1-based)
    if route is not None:
        route_keys += [keys.routers(model), keys.route_load(model)]
        for w in workers:
            route_keys += [keys.prefixes(w), keys.routed(model, priority, w)]
        base = len(key_list) + 1 + len(route_keys)
        for item in items:
            if item.session is not None:
                name = keys.session(model_session_hash(model, item.session))
                if name not in session_at:
                    session_at[name] = base + len(session_at)
        route_keys += list(session_at)
    key_list += route_keys
    args += [
        str(len(route_keys)),
        str(len(workers)),
        str(route.session_ttl_s if route is not None else 0),
        str(RECENT_REQUESTS),
        keys.tenant_queue(model, priority, ""),
        "1" if always_fair else "",
        *workers,
        str(len(tenant_settings or ())),
    ]
    for name, held in (tenant_settings or {}).items():
        bound = "" if held.max_waiting is None else str(held.max_waiting)
        args += [name, repr(held.weight), bound, repr(held.at)]
    record = keys.record
    for item in items:
        key_list.append(record(item.request_id))
        session = ""
        if route is not None and item.session is not None:
            session = str(session_at[keys.session(model_session_hash(model, item.session))])
        args += [
            item.request_id,
            item.payload,
            "" if item.deadline is None else repr(item.deadline),
            request_fingerprint(item.payload) if item.chosen_id else "",
            session,
            " ".join(item.chain) if route is not None else "",
            item.tenant,
            "" if item.weight is None else repr(float(item.weight)),
            str(item.prompt_tokens),
        ]
    return key_list, args
