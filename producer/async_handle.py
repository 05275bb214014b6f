"""``AsyncHandle``: one submitted request, seen from the ``AsyncClient``.

A thin face over ``core.handle_core.HandleCore``, as ``Handle`` is (see ``handle.py``): each
method awaits one of its plans on the client's asyncio driver.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from tokenfleet.producer.core.handle_core import HandleCore
from tokenfleet.producer.core.result import Result
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import Event

if TYPE_CHECKING:
    from tokenfleet.producer.async_client import AsyncClient
    from tokenfleet.producer.async_io.subscriber import AsyncSubscription


class AsyncHandle(HandleCore):
    """A submitted request: ``async for event in handle.stream()``, ``await handle.result()``.

    Invariants as ``Handle``: consecutive indices from ``from_index``, then exactly one terminal
    event; one handle per task; the subscription is released at the terminal event, by
    ``close()`` / ``async with``, or on garbage collection.
    """

    _client: AsyncClient
    _sub: AsyncSubscription | None

    async def stream(
        self, from_index: int = 0, *, timeout: float | None = None
    ) -> AsyncIterator[Event]:
        """Token events from ``from_index`` on, then the terminal event (see ``Handle``)."""
        run = self._client._run
        await run(self._start_at(from_index))
        i = from_index
        while True:
            while i - self._base < len(self._tokens):
                yield self._tokens[i - self._base]
                i += 1
            if self._terminal is not None:
                yield self._terminal
                return
            await run(self._next_event(timeout))

    async def result(self, timeout: float | None = None) -> Result:
        """Wait for the end; the result if ``done``, else ``RequestFailed`` (see ``Handle``)."""
        return await self._client._run(self._result(timeout))

    async def cancel(self) -> bool:
        """Ask for cancellation (see ``Client.cancel``)."""
        return await self._client.cancel(self.request_id)

    async def status(self) -> RequestRecord:
        """The durable record (see ``Client.status``)."""
        return await self._client.status(self.request_id)

    async def __aenter__(self) -> AsyncHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
