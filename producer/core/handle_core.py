"""``HandleCore``: how a handle reads one request's events, written once for ``Handle`` and
``AsyncHandle``.

Reading events: subscribe (at submit time, or lazily on first use), then sync from the durable
record and token list whenever the cursor asks for it (start, gap, reconnect, a quiet channel),
else follow the channel. A quiet channel is re-checked every ``recheck_s`` seconds, and at the
request's deadline, when a still-queued request is finished ``expired`` right there.

Redis outages (``outage.py``): a read that loses its connection waits with jittered backoff and
syncs again from the durable record; a record that is gone once the request was known to exist
(submitted by this handle, or seen by an earlier sync) means Redis lost it (a failover, a restart
from an older snapshot). A handle that submitted the request submits it again, same id and
parameters, once per loss (``Client(resubmit_lost=...)``, on by default) and reads on from the
index it has: the new run's first tokens (equal for greedy sampling) are dropped as indices
already seen, and if a worker still running it puts it back first (worker/service/repair.py), the
resubmission finds it there. Other handles, or with ``resubmit_lost`` off: ``RequestLost``.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import redis
from redis.commands.core import HashCommands, ListCommands

from tokenfleet.producer.core.cursor import EventCursor
from tokenfleet.producer.core.effects import (
    AwaitConfirmation,
    Command,
    Mailbox,
    Plan,
    Receive,
    Sleep,
    Subscribe,
    Transaction,
)
from tokenfleet.producer.core.outage import REDIS_DOWN, OutageClock
from tokenfleet.producer.core.request import Prepared
from tokenfleet.producer.core.result import Result, build_result
from tokenfleet.producer.core.subscriptions import NotConfirmed
from tokenfleet.shared.errors import (
    ProtocolError,
    RedisUnavailable,
    RequestLost,
    UnknownRequest,
)
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import (
    Event,
    RequestStatus,
    TerminalEvent,
    TokenEvent,
    decode_event,
)

if TYPE_CHECKING:
    from tokenfleet.producer.core.client_core import ClientCore

log = logging.getLogger(__name__)


def wait_for(recheck_s: float, until: float | None, deadline: float | None) -> float | None:
    """How long to wait for the next message: until the next re-check, the caller's timeout
    (monotonic ``until``) or the request's deadline (epoch seconds), whichever is first.
    Returns None when ``until`` has passed."""
    wait = recheck_s
    if until is not None:
        remaining = until - time.monotonic()
        if remaining <= 0:
            return None
        wait = min(wait, remaining)
    if deadline is not None:
        wait = min(wait, max(deadline - time.time(), 0.0) + 0.005)
    return wait


def decode_tokens(request_id: str, raw: list[Any], start: int) -> list[TokenEvent]:
    """Stored token events from index ``start``; ``ProtocolError`` if one is out of place."""
    out = []
    for offset, data in enumerate(raw):
        event = decode_event(data)
        if not isinstance(event, TokenEvent) or event.index != start + offset:
            raise ProtocolError(f"token list of {request_id} is corrupt at {start + offset}")
        out.append(event)
    return out


class HandleCore:
    """A submitted request's read state and plans (the faces add ``stream``, ``result``, ...).

    A face narrows ``_client`` (and ``_sub``) to its own client (and subscription) class.

    Invariants: ``_tokens`` holds token events with consecutive indices from ``_base``;
    ``_terminal`` is set at most once, and no token is appended after it; the subscription is
    released at the terminal event, by ``close()``, or when the handle is garbage-collected.
    """

    def __init__(
        self,
        client: ClientCore[Any],
        request_id: str,
        *,
        subscription: Mailbox | None = None,
        deadline: float | None = None,
        keys: Keys | None = None,
        prepared: Prepared | None = None,
    ) -> None:
        self.request_id = request_id
        self._prepared = prepared  # the request as submitted: sent again if Redis loses it
        self.resubmits = 0  # times this handle submitted its request again (lost by Redis)
        self._client = client
        self._sub: Mailbox | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._cursor = EventCursor(request_id, 0)  # syncs once subscribed
        self._base = 0  # index of self._tokens[0]
        self._tokens: list[TokenEvent] = []
        self._terminal: TerminalEvent | None = None
        self._ready: deque[Event] = deque()
        self._deadline = deadline
        self._keys = keys  # the names of the request's lane, once known (``_lane``)
        self._seen = subscription is not None  # the record existed (submitted, or synced)
        if subscription is not None:
            self._attach(subscription)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.request_id!r})"

    def close(self) -> None:
        """Release the subscription (idempotent). A later read subscribes again and re-reads the
        record (a closed mailbox receives nothing: keeping it made a later ``result()`` wait a
        whole ``recheck_s`` for its end)."""
        if self._finalizer is not None:
            self._finalizer()
        self._sub, self._finalizer = None, None

    # -- plans the faces run --------------------------------------------------------------------
    def _start_at(self, from_index: int) -> Plan[None]:
        """Position a new ``stream(from_index)``: a fresh handle starts reading there; an
        index before the cached ones is read back from the token list."""
        if isinstance(from_index, bool) or not isinstance(from_index, int) or from_index < 0:
            raise ValueError(f"from_index must be an integer >= 0, got {from_index!r}")
        untouched = (
            not self._tokens and self._terminal is None and not self._ready and self._base == 0
        )
        if untouched and self._cursor.next_index == 0 and from_index > 0:
            self._base = self._cursor.next_index = from_index
            self._cursor.needs_sync = True
        elif from_index < self._base:
            yield from self._backfill(from_index)

    def _next_event(self, timeout: float | None) -> Plan[None]:
        """Receive one more event into the cache; ``TimeoutError`` after ``timeout`` s."""
        until = None if timeout is None else time.monotonic() + timeout
        if not (yield from self._pull(until)):
            raise TimeoutError(f"no event for request {self.request_id} within {timeout}s")

    def _result(self, timeout: float | None) -> Plan[Result]:
        """Wait for the end (``timeout`` bounds the whole wait); the result if ``done``, else
        ``RequestFailed`` with its code."""
        until = None if timeout is None else time.monotonic() + timeout
        while self._terminal is None:
            if not (yield from self._pull(until)):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout}s")
        if self._base > 0:
            yield from self._backfill(0)
        return build_result(self._tokens, self._terminal)

    # -- internals ------------------------------------------------------------------------------
    def _attach(self, sub: Mailbox) -> None:
        self._sub = sub
        self._finalizer = weakref.finalize(self, sub.close)

    def _detach(self) -> None:
        """Release the subscription and forget it: the next read subscribes again."""
        self.close()

    def _backfill(self, from_index: int) -> Plan[None]:
        key = (yield from self._lane()).tokens(self.request_id)
        raw = yield Command(ListCommands.lrange, (key, from_index, self._base - 1))
        if len(raw) != self._base - from_index:
            raise UnknownRequest(f"the token list of {self.request_id} has expired")
        self._tokens[:0] = decode_tokens(self.request_id, raw, from_index)
        self._base = from_index

    def _lane(self) -> Plan[Keys]:
        """The names of the request's lane (a cluster: its model's; else the fleet's), found
        once (``core.lanes``: the client remembers the ids it submitted)."""
        if self._keys is None:
            self._keys = yield from self._client._lanes.keys_of(self.request_id)
        return self._keys

    def _record(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self._tokens.append(event)
        else:
            self._terminal = event
            self.close()

    def _pull(self, until: float | None) -> Plan[bool]:
        """Receive one more event into the cache; False if ``until`` passed first. Rides out
        a Redis outage (module doc)."""
        outage: OutageClock | None = None
        while True:
            try:
                return (yield from self._pull_once(until))
            except REDIS_DOWN as exc:
                if self._client._subscriber.closed or isinstance(
                    exc, RedisUnavailable | NotConfirmed
                ):
                    raise
                if outage is None:
                    outage = OutageClock(self._client.settings.redis_retry_s)
                wait = outage.next_wait(exc, until)
                if wait is None:
                    return False
                yield Sleep(wait)

    def _pull_once(self, until: float | None) -> Plan[bool]:
        if self._sub is None:
            client = self._client
            channel = (yield from self._lane()).channel(self.request_id)
            self._attach((yield Subscribe(channel, client.subscribe_timeout_s, confirm=True)))
            self._cursor.needs_sync = True
        sub = self._sub
        # subscribed at submit, not confirmed yet
        if (
            sub is not None
            and not sub.confirmation.is_set()
            and not (yield from self._confirmed(sub, until))
        ):
            return False
        while sub is not None:
            if self._ready:
                self._record(self._ready.popleft())
                return True
            if self._cursor.needs_sync:
                self._ready.extend((yield from self._sync()))
                continue
            wait = wait_for(self._client.recheck_s, until, self._deadline)
            if wait is None:
                return False
            item = yield Receive(sub, wait)
            if not isinstance(item, bytes):  # None (quiet) or RESYNC (reconnected)
                self._cursor.needs_sync = True  # re-read the record and the token list
            else:
                self._ready.extend(self._cursor.on_message(item))
        return False

    def _confirmed(self, sub: Mailbox, until: float | None) -> Plan[bool]:
        """Wait for Redis to confirm ``sub``: False if the caller's ``until`` comes first.
        Raises ``redis.ConnectionError`` after ``subscribe_timeout_s``; the next read then
        subscribes afresh."""
        limit = self._client.subscribe_timeout_s
        if until is not None and until - time.monotonic() < limit:
            remaining = max(0.0, until - time.monotonic())
            return bool((yield AwaitConfirmation(sub, remaining, strict=False)))
        try:
            yield AwaitConfirmation(sub, limit, strict=True)
        except redis.ConnectionError:
            self._detach()
            raise
        return True

    def _sync(self) -> Plan[list[Event]]:
        client, keys, rid = self._client, (yield from self._lane()), self.request_id
        while True:
            start = self._cursor.next_index
            read = (
                Command(HashCommands.hgetall, (keys.record(rid),)),
                Command(ListCommands.lrange, (keys.tokens(rid), start, -1)),
            )
            raw, tokens = yield Transaction(read)
            record = RequestRecord.from_hash(rid, raw)
            if record is None and self._seen and self._prepared and client.resubmit_lost:
                yield from client._resubmit(self._prepared)
                self.resubmits += 1
                log.warning(
                    "resubmitted %s after Redis lost it (its record vanished); reading on "
                    "from index %d",
                    rid,
                    self._cursor.next_index,
                )
                continue
            if record is None and self._seen:
                raise RequestLost(
                    f"request {rid} is gone from Redis: its record vanished while it was being "
                    "read (Redis restarted without persistence or was flushed, or the record's "
                    "TTL lapsed); no more events will come for it"
                )
            self._seen = record is not None
            if record is not None and record.status is RequestStatus.QUEUED:
                self._deadline = record.deadline
                if record.deadline is not None and record.deadline <= time.time():
                    yield from client._expire_overdue(record)
                    continue
            else:
                self._deadline = None
            return self._cursor.on_sync(raw, tokens, start)
