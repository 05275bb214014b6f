"""One pub/sub connection and one daemon reader thread shared by every ``Handle`` of a ``Client``.

A web app with a thousand streaming requests holds two connections per process (commands and
pub/sub), not a thousand. Only the reader thread reads the socket and only it (re)connects;
other threads send SUBSCRIBE / UNSUBSCRIBE under the lock. After any connection error the reader
opens a fresh connection, re-subscribes every channel and, once Redis confirms, puts ``RESYNC``
in every mailbox: messages published while disconnected are lost, so readers re-read the
durable record and token list (see ``core/cursor.py``).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import redis

from tokenfleet.producer.core.subscriptions import (
    CLOSED_MESSAGE,
    Backoff,
    MailboxBase,
    SubscriptionTable,
    not_confirmed,
)

log = logging.getLogger(__name__)
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class Subscription(MailboxBase):
    """One mailbox on one channel. ``get()`` returns raw message bytes, ``RESYNC``, or None on
    timeout. ``close()`` is idempotent and safe from finalizers. Messages arrive only once
    Redis has confirmed the SUBSCRIBE (``wait_confirmed``)."""

    def __init__(self, subscriber: Subscriber, channel: str, box_id: int) -> None:
        super().__init__(subscriber, channel, box_id)
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.confirmation = threading.Event()  # set by the reader thread

    def confirmed_within(self, timeout: float) -> bool:
        """Whether Redis confirms the subscription within ``timeout`` seconds."""
        return self.confirmation.wait(timeout)

    def wait_confirmed(self, timeout: float) -> None:
        """Return once Redis has confirmed the subscription; closes the subscription and
        raises ``redis.ConnectionError`` if that takes more than ``timeout`` seconds."""
        if not self.confirmation.wait(timeout):
            self.close()
            raise not_confirmed(self.channel, timeout)

    def get(self, timeout: float | None) -> object | None:
        """Next item, waiting up to ``timeout`` seconds (None: forever)."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None


class Subscriber:
    """The shared pub/sub connection of one client.

    Invariants: only the reader thread reads from or (re)connects the connection; the table is
    changed only under ``_lock``; every listened channel is subscribed on the current connection
    or has a SUBSCRIBE in flight.
    """

    def __init__(
        self,
        connection_factory: Callable[[], Any],
        *,
        poll_s: float = 1.0,
        commands: tuple[str, str] = ("SUBSCRIBE", "UNSUBSCRIBE"),
    ) -> None:
        """``commands``: (subscribe, unsubscribe), ``subscriptions.subscribe_commands``."""
        self._factory = connection_factory
        self._commands = commands
        self._poll_s = poll_s
        # Reentrant: a handle garbage-collected while this thread holds the lock unsubscribes
        # from its finalizer, in the same thread.
        self._lock = threading.RLock()
        self._table = SubscriptionTable()
        self._conn: Any = None
        self._broken = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.connects = 0  # connections opened so far (reconnects = connects - 1)

    def subscribe(self, channel: str, timeout: float, *, confirm: bool = True) -> Subscription:
        """Listen to ``channel``; returns once Redis confirmed the subscription, or at once
        (SUBSCRIBE sent, confirmation pending: ``Subscription.wait_confirmed``) if not
        ``confirm``.

        Raises:
            redis.ConnectionError: the client is closed, or not confirmed within ``timeout``
            seconds.
        """
        if self._closed.is_set():
            raise redis.ConnectionError(CLOSED_MESSAGE)
        sub = Subscription(self, channel, next(self._ids))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tokenfleet-subscriber", daemon=True
                )
                self._thread.start()
            if self._table.add(channel, sub._box_id, sub.queue.put, sub.confirmation):
                self._send(self._commands[0], channel)
        if confirm:
            sub.wait_confirmed(timeout)
        return sub

    def unsubscribe(self, channel: str, box_id: int) -> None:
        """Remove one mailbox (called by ``Subscription.close``)."""
        with self._lock:
            if self._table.remove(channel, box_id):
                self._send(self._commands[1], channel)

    def close(self) -> None:
        """Stop the reader thread and drop the connection."""
        self._closed.set()
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()  # wakes the reader out of its poll
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._poll_s + 1.0)

    @property
    def closed(self) -> bool:
        """``close()`` was called: subscribing raises ``redis.ConnectionError``."""
        return self._closed.is_set()

    @property
    def num_channels(self) -> int:
        """How many channels are listened to (for tests and leak checks)."""
        with self._lock:
            return len(self._table.channels)

    # -- internals: _send needs the lock held ---------------------------------------------------
    def _send(self, *args: str) -> None:
        if self._conn is None or self._broken:
            return  # the reader reconnects and re-subscribes every channel in the table
        try:
            self._conn.send_command(*args, check_health=False)
        except _CONNECTION_ERRORS:
            self._broken = True

    def _reconnect(self) -> bool:
        with self._lock:
            old, self._conn = self._conn, None
        if old is not None:
            old.disconnect()
        conn = self._factory()
        try:
            conn.connect()
        except _CONNECTION_ERRORS as exc:
            log.warning("tokenfleet subscriber: cannot connect: %s", exc)
            conn.disconnect()
            return False
        with self._lock:
            self._conn, self._broken = conn, False
            self.connects += 1
            channels = self._table.reset_for_reconnect(resync=self.connects > 1)
            if channels:
                self._send(self._commands[0], *channels)
        return True

    def _run(self) -> None:
        backoff = Backoff()
        while not self._closed.is_set():
            conn = self._conn
            if conn is None or self._broken:
                if self._reconnect():
                    backoff.reset()
                else:
                    self._closed.wait(backoff.next())
                continue
            try:
                if not conn.can_read(timeout=self._poll_s):
                    continue
                reply = conn.read_response()
            except Exception as exc:  # closed under us, or any socket / parser failure
                if self._closed.is_set():
                    break
                log.debug("tokenfleet subscriber: reconnecting after %r", exc)
                with self._lock:
                    self._broken = True
                continue
            with self._lock:
                if self._table.dispatch(reply):  # the cluster moved a channel's slot
                    self._broken = True
        log.debug("tokenfleet subscriber stopped")
