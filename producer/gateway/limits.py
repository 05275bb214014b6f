"""Two small ASGI middlewares: the body size limit, and counting answers by status code.

``BodyLimit`` answers 413 before the app reads a byte of an oversized body: at once when its
``Content-Length`` says so, else (chunked uploads) as soon as the bytes received pass the limit
— the app never sees the rest, and nothing is enqueued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.producer.gateway.errors import error_body


class BodyTooLarge(HTTPException):
    """Raised inside ``receive`` when a chunked body passes the limit. An ``HTTPException``
    because FastAPI turns any other error met while reading a body into a 400."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, too_large_message(max_bytes))


def too_large_message(max_bytes: int) -> str:
    """What a 413 says."""
    return f"the request body is larger than the limit of {max_bytes} bytes"


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413 (``max_upload_bytes`` for the paths
    that take file uploads, ``upload_paths``)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        *,
        max_upload_bytes: int | None = None,
        upload_paths: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_upload_bytes = max_upload_bytes or max_bytes
        self.upload_paths = upload_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_upload_bytes if scope["path"] in self.upload_paths else self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._refuse(send, limit)
                return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, limit)

    async def _refuse(self, send: Send, limit: int) -> None:
        message = too_large_message(limit)
        body = orjson.dumps(error_body(413, message, code="body_too_large"))
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class CountResponses:
    """Count every answer in ``tokenfleet_gateway_requests_total{route, code}``."""

    def __init__(self, app: ASGIApp, metrics_of: Callable[[], Any]) -> None:
        self.app = app
        self.metrics_of = metrics_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                metrics = self.metrics_of()
                if metrics is not None:
                    route = scope.get("route")
                    path = getattr(route, "path", None) or "unmatched"
                    metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
