"""Bookkeeping of a shared pub/sub connection: who listens to which channel, and which
SUBSCRIBE commands the server has not confirmed yet. Pure state, no I/O, no locking (the sync
subscriber guards it with its lock; the asyncio one runs on one loop).

Redis answers the commands of one connection in order, so confirmations of one channel match
the SUBSCRIBEs sent for it first-in first-out: each SUBSCRIBE sent appends a ``PendingGroup``
and each ``subscribe`` confirmation pops the oldest one and wakes its waiters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

RESYNC = "resync"  # put in a mailbox after a reconnect: re-read the record, events may be lost


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

    def dispatch(self, reply: object) -> None:
        """Route one reply read from the pub/sub connection."""
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind = _text(reply[0])
        channel = _text(reply[1])
        if kind == "message" and isinstance(reply[2], bytes | str):
            data = reply[2]
            self.message(channel, data if isinstance(data, bytes) else data.encode())
        elif kind == "subscribe":
            self.confirmed(channel)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
