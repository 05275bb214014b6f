"""SSE responses with a keep-alive that no client mis-reads.

Every SSE endpoint of the gateway answers through :func:`event_stream`. Between events it sends
a keep-alive: one comment line (``: keep-alive``) with **no blank line after it**.

Why no blank line: in SSE a blank line dispatches an event. A spec-following browser drops an
event with no data, but the official ``openai`` SDKs and ``httpx-sse`` keep the last ``id:`` they
saw and dispatch an event with empty data on every blank line once an id has been seen; the SDK
then calls ``json.loads("")`` and the stream dies with ``JSONDecodeError``. Our token events carry
ids (``Last-Event-ID`` resume), so sse-starlette's own ping (a comment *and* a blank line) broke
every SDK stream that outlived one interval. A lone comment line carries bytes (proxies see a live
connection) and is skipped by every parser; the next event's own blank line ends it as usual.

Invariant: a keep-alive is only ever written between two whole events (sse-starlette writes an
event and a ping under one lock), so it can never split an event's lines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent

KEEPALIVE_LINE = b": keep-alive\r\n"  # sse-starlette frames lines with CRLF; so do we


class KeepAliveComment(ServerSentEvent):
    """A comment line without the blank line that would dispatch an (empty) event."""

    def encode(self) -> bytes:
        return KEEPALIVE_LINE


def event_stream(
    events: AsyncIterator[Any],
    *,
    keepalive_s: float,
    headers: Mapping[str, str] | None = None,
    on_client_close: Callable[[Any], Awaitable[None]] | None = None,
) -> EventSourceResponse:
    """An SSE response of ``events`` with a :class:`KeepAliveComment` every ``keepalive_s``
    seconds of silence-or-not (sse-starlette's ping task runs on its own clock)."""
    return EventSourceResponse(
        events,
        headers=headers,
        ping=keepalive_s,
        ping_message_factory=KeepAliveComment,
        client_close_handler_callable=on_client_close,
    )
