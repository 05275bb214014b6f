"""``Handle``: one submitted request, seen from the sync client.

A thin face over ``core.handle_core.HandleCore`` (how events are read, once for both faces):
each method runs one of its plans with the client's blocking driver.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from tokenfleet.producer.core.handle_core import HandleCore
from tokenfleet.producer.core.result import Result
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import Event

if TYPE_CHECKING:
    from tokenfleet.producer.client import Client
    from tokenfleet.producer.sync_io.subscriber import Subscription


class Handle(HandleCore):
    """A submitted request: stream its events, wait for its result, cancel it.

    Invariants: ``stream()`` yields token events with consecutive indices from ``from_index``
    and then exactly one terminal event; the handle caches what it has received, so ``result()``
    after ``stream()`` reads nothing twice. Not thread-safe: use one handle per thread. Its
    subscription is released at the terminal event, by ``close()`` / ``with``, or when the
    handle is garbage-collected.
    """

    _client: Client
    _sub: Subscription | None

    def stream(self, from_index: int = 0, *, timeout: float | None = None) -> Iterator[Event]:
        """Token events from ``from_index`` on, then the terminal event.

        ``timeout`` bounds the wait for each next event (builtin ``TimeoutError``). A caller
        that reconnects passes the index it has reached.
        """
        run = self._client._run
        run(self._start_at(from_index))
        i = from_index
        while True:
            while i - self._base < len(self._tokens):
                yield self._tokens[i - self._base]
                i += 1
            if self._terminal is not None:
                yield self._terminal
                return
            run(self._next_event(timeout))

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the end; the result if ``done``, else ``RequestFailed`` with its code.

        ``timeout`` bounds the whole wait (builtin ``TimeoutError``).
        """
        return self._client._run(self._result(timeout))

    def cancel(self) -> bool:
        """Ask for cancellation (see ``Client.cancel``)."""
        return self._client.cancel(self.request_id)

    def status(self) -> RequestRecord:
        """The durable record (see ``Client.status``)."""
        return self._client.status(self.request_id)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
