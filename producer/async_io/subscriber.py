"""The asyncio twin of ``sync_io/subscriber.py``: one pub/sub connection and one reader task per
``AsyncClient``, shared by all its handles. Runs on one event loop, so the table needs no lock;
only the reader task reads from or (re)connects the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
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
from tokenfleet.shared.cancellation import cancel_checkpoint

log = logging.getLogger(__name__)
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class AsyncSubscription(MailboxBase):
    """One mailbox on one channel; ``get()`` returns raw bytes, ``RESYNC`` or None on timeout.
    ``close()`` is callable from sync code (a finalizer)."""

    def __init__(self, subscriber: AsyncSubscriber, channel: str, box_id: int) -> None:
        super().__init__(subscriber, channel, box_id)
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.confirmation = asyncio.Event()  # set by the reader task

    async def confirmed_within(self, timeout: float) -> bool:
        """Whether Redis confirms the subscription within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self.confirmation.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def wait_confirmed(self, timeout: float) -> None:
        """See ``Subscription.wait_confirmed``."""
        if not await self.confirmed_within(timeout):
            self.close()
            raise not_confirmed(self.channel, timeout)

    async def get(self, timeout: float | None) -> object | None:
        """Next item, waiting up to ``timeout`` seconds (None: forever)."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None


class AsyncSubscriber:
    """The shared pub/sub connection of one ``AsyncClient``.

    Invariants: only the reader task reads or (re)connects; every listened channel is
    subscribed on the current connection or has a SUBSCRIBE in flight.
    """

    def __init__(
        self,
        connection_factory: Callable[[], Any],
        *,
        commands: tuple[str, str] = ("SUBSCRIBE", "UNSUBSCRIBE"),
    ) -> None:
        """``commands``: (subscribe, unsubscribe), ``subscriptions.subscribe_commands``."""
        self._factory = connection_factory
        self._commands = commands
        self._table = SubscriptionTable()
        self._conn: Any = None
        self._broken = False
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._pending_sends: set[asyncio.Task[None]] = set()
        self.connects = 0  # connections opened so far (reconnects = connects - 1)

    async def subscribe(
        self, channel: str, timeout: float, *, confirm: bool = True
    ) -> AsyncSubscription:
        """See ``Subscriber.subscribe``."""
        if self._closed:
            raise redis.ConnectionError(CLOSED_MESSAGE)
        sub = AsyncSubscription(self, channel, next(self._ids))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        if self._table.add(channel, sub._box_id, sub.queue.put_nowait, sub.confirmation):
            await self._send(self._commands[0], channel)
        if confirm:
            await sub.wait_confirmed(timeout)
        return sub

    def unsubscribe(self, channel: str, box_id: int) -> None:
        """Remove one mailbox; the UNSUBSCRIBE is sent in the background if needed."""
        if not self._table.remove(channel, box_id) or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._broken = True  # called from a finalizer outside the loop: resubscribe fresh
            return
        task = loop.create_task(self._unsubscribe_later(channel))
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)

    async def _unsubscribe_later(self, channel: str) -> None:
        # A mailbox may listen to the channel again before this task runs (a handle closed
        # and read again, a resumed stream): its SUBSCRIBE is already out, and this stale
        # UNSUBSCRIBE would end it on the server, so nothing would reach it until a recheck.
        if channel not in self._table.channels:
            await self._send(self._commands[1], channel)

    async def aclose(self) -> None:
        """Stop the reader task and drop the connection."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None:
            await self._conn.disconnect()
            self._conn = None

    @property
    def closed(self) -> bool:
        """``aclose()`` was called: subscribing raises ``redis.ConnectionError``."""
        return self._closed

    @property
    def num_channels(self) -> int:
        """How many channels are listened to."""
        return len(self._table.channels)

    async def _send(self, *args: str) -> None:
        conn = self._conn
        if conn is None or self._broken:
            return  # the reader reconnects and re-subscribes every channel in the table
        try:
            await conn.send_command(*args, check_health=False)
        except _CONNECTION_ERRORS:
            self._broken = True

    async def _reconnect(self) -> bool:
        old, self._conn = self._conn, None
        if old is not None:
            await old.disconnect()
        conn = self._factory()
        try:
            await conn.connect()
        except _CONNECTION_ERRORS as exc:
            log.warning("tokenfleet subscriber: cannot connect: %s", exc)
            return False
        self._conn, self._broken = conn, False
        self.connects += 1
        channels = self._table.reset_for_reconnect(resync=self.connects > 1)
        if channels:
            await self._send(self._commands[0], *channels)
        return True

    async def _run(self) -> None:
        backoff = Backoff()
        while not self._closed:
            cancel_checkpoint()
            conn = self._conn
            if conn is None or self._broken:
                if await self._reconnect():
                    backoff.reset()
                else:
                    await asyncio.sleep(backoff.next())
                continue
            try:
                reply = await conn.read_response(timeout=math.inf, disconnect_on_error=False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any socket / parser failure: start over
                log.debug("tokenfleet subscriber: reconnecting after %r", exc)
                self._broken = True
                continue
            if self._table.dispatch(reply):  # the cluster moved a channel's slot
                self._broken = True
