"""Bookkeeping of a shared pub/sub connection: who listens to which channel, and which
SUBSCRIBE commands the server has not confirmed yet; plus what the thread subscriber
(``sync_io``) and the task subscriber (``async_io``) decide alike: how their connections are
built, how a mailbox closes, how reconnects back off. Pure state, no I/O, no locking (the sync
subscriber guards the table with its lock; the asyncio one runs on one loop).

Redis answers the commands of one connection in order, so confirmations of one channel match
the SUBSCRIBEs sent for it first-in first-out: each SUBSCRIBE sent appends a ``PendingGroup``
and each ``subscribe`` confirmation pops the oldest one and wakes its waiters.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from tokenfleet.shared.cluster_connection import is_slot_client

RESYNC = "resync"  # put in a mailbox after a reconnect: re-read the record, events may be lost
CLOSED_MESSAGE = "the client is closed"  # redis.ConnectionError's text once a client is closed
# After a failed connect the reader waits FIRST s, doubling up to CEILING s (reset on success).
RECONNECT_BACKOFF_FIRST_S = 0.05
RECONNECT_BACKOFF_CEILING_S = 2.0


class Waiter(Protocol):
    """``threading.Event`` or ``asyncio.Event``."""

    def set(self) -> None: ...


Deliver = Callable[[object], None]


@dataclass(slots=True)
class PendingGroup:
    """Waiters released by one ``subscribe`` confirmation; ``resync`` after a reconnect."""

    waiters: list[Waiter] = field(default_factory=list)
    resync: bool = False


class SubscriptionTable:
    """Channel -> mailboxes, and channel -> unconfirmed SUBSCRIBEs.

    Invariants: a channel is in ``channels`` iff at least one mailbox listens to it; the server
    is subscribed to a channel in ``channels`` once its ``pending`` deque is empty.
    """

    def __init__(self) -> None:
        self.channels: dict[str, dict[int, Deliver]] = {}
        self.pending: dict[str, deque[PendingGroup]] = {}

    def add(self, channel: str, box_id: int, deliver: Deliver, waiter: Waiter) -> bool:
        """Register a mailbox; returns True if a SUBSCRIBE must be sent for ``channel``.

        ``waiter`` is set once the server has confirmed the subscription (at once if it has).
        """
        boxes = self.channels.setdefault(channel, {})
        first = not boxes
        boxes[box_id] = deliver
        groups = self.pending.setdefault(channel, deque())
        if first:
            groups.append(PendingGroup([waiter]))
            return True
        if groups:
            groups[-1].waiters.append(waiter)
        else:
            del self.pending[channel]
            waiter.set()
        return False

    def remove(self, channel: str, box_id: int) -> bool:
        """Unregister a mailbox; returns True if an UNSUBSCRIBE must be sent."""
        boxes = self.channels.get(channel)
        if boxes is None or boxes.pop(box_id, None) is None:
            return False
        if boxes:
            return False
        del self.channels[channel]
        return True

    def confirmed(self, channel: str) -> None:
        """The server confirmed one SUBSCRIBE of ``channel``."""
        groups = self.pending.get(channel)
        if not groups:
            return
        group = groups.popleft()
        if not groups:
            del self.pending[channel]
        for waiter in group.waiters:
            waiter.set()
        if group.resync:
            for deliver in list(self.channels.get(channel, {}).values()):
                deliver(RESYNC)

    def message(self, channel: str, data: bytes) -> None:
        """A published message: hand it to every mailbox of ``channel``."""
        for deliver in list(self.channels.get(channel, {}).values()):
            deliver(data)

    def reset_for_reconnect(self, resync: bool = True) -> list[str]:
        """A new connection: every listened channel needs one SUBSCRIBE, whose confirmation
        releases all earlier waiters and, if ``resync`` (a reconnect, not the first connection),
        tells every mailbox to resync. Returns the channels."""
        old = self.pending
        self.pending = {}
        for channel, groups in old.items():
            if channel not in self.channels:
                for group in groups:
                    for waiter in group.waiters:
                        waiter.set()
        for channel in self.channels:
            waiters = [w for g in old.get(channel, ()) for w in g.waiters]
            self.pending[channel] = deque([PendingGroup(waiters, resync=resync)])
        return list(self.channels)

    def dispatch(self, reply: object) -> bool:
        """Route one reply read from the pub/sub connection (plain or sharded pub/sub). Returns
        True if the server dropped a channel still listened to (a Redis Cluster unsubscribes
        a shard channel when its slot moves to another node: failover, migration); the caller
        then reconnects, which subscribes again where the slot is now."""
        if not isinstance(reply, list) or len(reply) < 3:
            return False
        kind = _text(reply[0])
        channel = _text(reply[1])
        if kind in ("message", "smessage") and isinstance(reply[2], bytes | str):
            data = reply[2]
            self.message(channel, data if isinstance(data, bytes) else data.encode())
        elif kind in ("subscribe", "ssubscribe"):
            self.confirmed(channel)
        elif kind == "sunsubscribe" and channel in self.channels:
            return True
        return False


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def subscribe_commands(client: Any) -> tuple[str, str]:
    """(SUBSCRIBE, UNSUBSCRIBE), or their sharded twins for a cluster-mode ``client`` (a plain
    PUBLISH on a cluster is broadcast to every node; the scripts SPUBLISH on the slot's shard)."""
    if is_slot_client(client):
        return "SSUBSCRIBE", "SUNSUBSCRIBE"
    return "SUBSCRIBE", "UNSUBSCRIBE"


def pubsub_connection_factory(client: Any, **overrides: Any) -> Callable[[], Any]:
    """Build connections like ``client``'s pool does (sync or asyncio), but always RESP2 and
    undecoded bytes, with ``overrides`` on top."""
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(decode_responses=False, protocol=2, **overrides)
    connection_class = pool.connection_class

    def make() -> Any:
        return connection_class(**kwargs)

    return make


class NotConfirmed(redis.ConnectionError):
    """Redis did not confirm a SUBSCRIBE in time. Raised to the reader as it is, not ridden
    out like a lost command connection (``outage.py``): the request is unaffected, and the next
    read subscribes afresh."""


def not_confirmed(channel: str, timeout: float) -> redis.ConnectionError:
    """The error of a SUBSCRIBE that Redis did not confirm within ``timeout`` seconds."""
    return NotConfirmed(
        f"could not subscribe to {channel} within {timeout:g}s (is Redis reachable?)"
    )


class Unsubscriber(Protocol):
    """A subscriber, as its mailboxes see it."""

    def unsubscribe(self, channel: str, box_id: int) -> None: ...


class MailboxBase:
    """One mailbox on one channel of a shared subscriber. ``close()`` is idempotent and safe
    from finalizers; the channel is unsubscribed when its last mailbox closes."""

    def __init__(self, subscriber: Unsubscriber, channel: str, box_id: int) -> None:
        self.channel = channel
        self._subscriber = subscriber
        self._box_id = box_id
        self.closed = False

    def close(self) -> None:
        """Stop listening (the channel is unsubscribed when its last mailbox closes)."""
        if not self.closed:
            self.closed = True
            self._subscriber.unsubscribe(self.channel, self._box_id)


class Backoff:
    """Delays between failed connection attempts: first, then doubling up to a ceiling, each
    drawn between half and all of that bound."""

    __slots__ = ("delay", "jitter")

    def __init__(self, jitter: Callable[[], float] = random.random) -> None:
        self.delay = RECONNECT_BACKOFF_FIRST_S
        self.jitter = jitter  # a draw in [0, 1)

    def reset(self) -> None:
        """A connection succeeded: the next failure waits the first delay again."""
        self.delay = RECONNECT_BACKOFF_FIRST_S

    def next(self) -> float:
        """The delay to wait now, drawn between half and all of the current bound (jitter: many
        clients do not reconnect in lockstep); the bound doubles (up to the ceiling)."""
        delay = self.delay
        self.delay = min(delay * 2, RECONNECT_BACKOFF_CEILING_S)
        return delay * (0.5 + 0.5 * self.jitter())
