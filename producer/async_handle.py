"""``AsyncHandle``: one submitted request, seen from the ``AsyncClient``.

Same algorithm and invariants as ``Handle`` (see ``handle.py``), with awaits.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import redis

from tokenfleet.producer.async_subscriber import AsyncSubscription
from tokenfleet.producer.cursor import EventCursor
from tokenfleet.producer.handle import decode_tokens, wait_for
from tokenfleet.producer.result import Result, build_result
from tokenfleet.shared.errors import UnknownRequest
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import Event, RequestStatus, TerminalEvent, TokenEvent

if TYPE_CHECKING:
    from tokenfleet.producer.async_client import AsyncClient


class AsyncHandle:
    """A submitted request: ``async for event in handle.stream()``, ``await handle.result()``.

    Invariants as ``Handle``: consecutive indices from ``from_index``, then exactly one terminal
    event; one handle per task; the subscription is released at the terminal event, by
    ``close()`` / ``async with``, or on garbage collection.
    """

    def __init__(
        self,
        client: AsyncClient,
        request_id: str,
        *,
        subscription: AsyncSubscription | None = None,
        deadline: float | None = None,
    ) -> None:
        self.request_id = request_id
        self._client = client
        self._sub: AsyncSubscription | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._cursor = EventCursor(request_id, 0)  # syncs once subscribed
        self._base = 0
        self._tokens: list[TokenEvent] = []
        self._terminal: TerminalEvent | None = None
        self._ready: deque[Event] = deque()
        self._deadline = deadline
        if subscription is not None:
            self._attach(subscription)

    def __repr__(self) -> str:
        return f"AsyncHandle({self.request_id!r})"

    async def stream(
        self, from_index: int = 0, *, timeout: float | None = None
    ) -> AsyncIterator[Event]:
        """Token events from ``from_index`` on, then the terminal event (see ``Handle``)."""
        if isinstance(from_index, bool) or not isinstance(from_index, int) or from_index < 0:
            raise ValueError(f"from_index must be an integer >= 0, got {from_index!r}")
        await self._start_at(from_index)
        i = from_index
        while True:
            while i - self._base < len(self._tokens):
                yield self._tokens[i - self._base]
                i += 1
            if self._terminal is not None:
                yield self._terminal
                return
            until = None if timeout is None else time.monotonic() + timeout
            if not await self._pull(until):
                raise TimeoutError(f"no event for request {self.request_id} within {timeout}s")

    async def result(self, timeout: float | None = None) -> Result:
        """Wait for the end; the result if ``done``, else ``RequestFailed`` (see ``Handle``)."""
        until = None if timeout is None else time.monotonic() + timeout
        while self._terminal is None:
            if not await self._pull(until):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout}s")
        if self._base > 0:
            await self._backfill(0)
        return build_result(self._tokens, self._terminal)

    async def cancel(self) -> bool:
        """Ask for cancellation (see ``Client.cancel``)."""
        return await self._client.cancel(self.request_id)

    async def status(self) -> RequestRecord:
        """The durable record (see ``Client.status``)."""
        return await self._client.status(self.request_id)

    def close(self) -> None:
        """Release the subscription (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()

    async def __aenter__(self) -> AsyncHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _attach(self, sub: AsyncSubscription) -> None:
        self._sub = sub
        self._finalizer = weakref.finalize(self, sub.close)

    def _detach(self) -> None:
        """Release the subscription and forget it: the next read subscribes again."""
        self.close()
        self._sub, self._finalizer = None, None

    async def _start_at(self, from_index: int) -> None:
        untouched = (
            not self._tokens and self._terminal is None and not self._ready and self._base == 0
        )
        if untouched and self._cursor.next_index == 0 and from_index > 0:
            self._base = self._cursor.next_index = from_index
            self._cursor.needs_sync = True
        elif from_index < self._base:
            await self._backfill(from_index)

    async def _backfill(self, from_index: int) -> None:
        keys = self._client._keys
        raw = await self._client._redis.lrange(
            keys.tokens(self.request_id), from_index, self._base - 1
        )
        if len(raw) != self._base - from_index:
            raise UnknownRequest(f"the token list of {self.request_id} has expired")
        self._tokens[:0] = decode_tokens(self.request_id, raw, from_index)
        self._base = from_index

    def _record(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self._tokens.append(event)
        else:
            self._terminal = event
            self.close()

    async def _pull(self, until: float | None) -> bool:
        if self._sub is None:
            client = self._client
            channel = client._keys.channel(self.request_id)
            self._attach(await client._subscriber.subscribe(channel, client.subscribe_timeout_s))
            self._cursor.needs_sync = True
        sub = self._sub
        # subscribed at submit, not confirmed yet
        confirmed = sub is None or sub.confirmation.is_set() or await self._confirmed(sub, until)
        if not confirmed:
            return False
        while sub is not None:
            if self._ready:
                self._record(self._ready.popleft())
                return True
            if self._cursor.needs_sync:
                self._ready.extend(await self._sync())
                continue
            wait = wait_for(self._client.recheck_s, until, self._deadline)
            if wait is None:
                return False
            item = await sub.get(wait)
            if not isinstance(item, bytes):  # None (quiet) or RESYNC (reconnected)
                self._cursor.needs_sync = True
            else:
                self._ready.extend(self._cursor.on_message(item))
        return False

    async def _confirmed(self, sub: AsyncSubscription, until: float | None) -> bool:
        """See ``Handle._confirmed``."""
        limit = self._client.subscribe_timeout_s
        if until is not None and until - time.monotonic() < limit:
            try:
                await asyncio.wait_for(sub.confirmation.wait(), max(0.0, until - time.monotonic()))
            except TimeoutError:
                return False
            return True
        try:
            await sub.wait_confirmed(limit)
        except redis.ConnectionError:
            self._detach()
            raise
        return True

    async def _sync(self) -> list[Event]:
        client, keys, rid = self._client, self._client._keys, self.request_id
        while True:
            start = self._cursor.next_index
            pipe = client._redis.pipeline(transaction=True)
            pipe.hgetall(keys.record(rid))
            pipe.lrange(keys.tokens(rid), start, -1)
            raw, tokens = await pipe.execute()
            record = RequestRecord.from_hash(rid, raw)
            if record is not None and record.status is RequestStatus.QUEUED:
                self._deadline = record.deadline
                if record.deadline is not None and record.deadline <= time.time():
                    await client._expire_overdue(record)
                    continue
            else:
                self._deadline = None
            return self._cursor.on_sync(raw, tokens, start)
