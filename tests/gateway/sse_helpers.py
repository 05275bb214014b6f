"""What the keep-alive tests need beside a fleet: httpx transports that keep a copy of every
byte a client reads (so a test knows which keep-alives the client's own parser went through),
and a staller that SIGSTOPs a worker mid-stream until the client has read keep-alives."""

from __future__ import annotations

import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import httpx2
from gateway_helpers import Proc, wait_for

from tokenfleet.producer.gateway.keepalive import KEEPALIVE_LINE


class ReadBytes:
    """Every byte of every response a client has read so far, in order (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bodies: list[bytearray] = []

    def new_body(self) -> bytearray:
        body = bytearray()
        with self._lock:
            self._bodies.append(body)
        return body

    def add(self, body: bytearray, chunk: bytes) -> None:
        with self._lock:
            body += chunk

    def bodies(self) -> list[bytes]:
        with self._lock:
            return [bytes(b) for b in self._bodies]

    def keepalives_after_an_id(self) -> int:
        """Keep-alive lines read after the first ``id:`` line of their response, summed."""
        return sum(keepalives_after_first_id(body) for body in self.bodies())

    def ids_seen(self) -> int:
        return sum(body.count(b"\nid: ") + body.startswith(b"id: ") for body in self.bodies())


def keepalives_after_first_id(body: bytes) -> int:
    at = body.find(b"id: ")
    return 0 if at < 0 else body[at:].count(KEEPALIVE_LINE)


def _recording_transports(lib: Any) -> tuple[Any, Any]:
    """A sync and an asyncio transport of the HTTP library ``lib`` (``httpx``, or ``httpx2``,
    which the openai SDK 3.x is built on) whose responses' bytes are also kept in a
    :class:`ReadBytes` given as their first argument."""

    class TeeSync(lib.SyncByteStream):
        def __init__(self, inner: Any, read: ReadBytes) -> None:
            self._inner, self._read, self._body = inner, read, read.new_body()

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self._inner:
                self._read.add(self._body, chunk)
                yield chunk

        def close(self) -> None:
            self._inner.close()

    class TeeAsync(lib.AsyncByteStream):
        def __init__(self, inner: Any, read: ReadBytes) -> None:
            self._inner, self._read, self._body = inner, read, read.new_body()

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self._inner:
                self._read.add(self._body, chunk)
                yield chunk

        async def aclose(self) -> None:
            await self._inner.aclose()

    class Recording(lib.HTTPTransport):
        def __init__(self, read: ReadBytes, **kw: Any) -> None:
            super().__init__(**kw)
            self.read = read

        def handle_request(self, request: Any) -> Any:
            response = super().handle_request(request)
            response.stream = TeeSync(response.stream, self.read)
            return response

    class AsyncRecording(lib.AsyncHTTPTransport):
        def __init__(self, read: ReadBytes, **kw: Any) -> None:
            super().__init__(**kw)
            self.read = read

        async def handle_async_request(self, request: Any) -> Any:
            response = await super().handle_async_request(request)
            response.stream = TeeAsync(response.stream, self.read)
            return response

    return Recording, AsyncRecording


# For httpx clients (httpx-sse, plain HTTP) and for the openai SDK's own httpx2 clients.
RecordingTransport, AsyncRecordingTransport = _recording_transports(httpx)
SdkRecordingTransport, SdkAsyncRecordingTransport = _recording_transports(httpx2)


class Staller:
    """On a thread: once the client has read a token event (an ``id:`` line), SIGSTOP the
    worker, hold it until the client has read ``keepalives`` keep-alive lines after that id,
    then SIGCONT it. The stream therefore stalls mid-generation for several keep-alive
    intervals, and the client's parser demonstrably went through them. ``join()`` re-raises
    what went wrong on the thread (the worker is always continued)."""

    def __init__(self, read: ReadBytes, worker: Proc, keepalives: int = 5) -> None:
        self.read, self.worker, self.keepalives = read, worker, keepalives
        self.error: BaseException | None = None
        self._abandoned = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Staller:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:  # the client failed: continue the worker, keep that error
            self._abandoned.set()
            self._thread.join(timeout=30)
            return
        self.join()

    def _until(self, check: Callable[[], bool], what: str) -> None:
        def done() -> bool:
            if self._abandoned.is_set():
                raise AssertionError(f"abandoned while waiting for {what}")
            return check()

        wait_for(done, what)

    def _run(self) -> None:
        try:
            self._until(lambda: self.read.ids_seen() > 0, "a token event read by the client")
            before = self.read.keepalives_after_an_id()
            self.worker.signal(signal.SIGSTOP)
            try:
                self._until(
                    lambda: self.read.keepalives_after_an_id() >= before + self.keepalives,
                    f"{self.keepalives} keep-alives read while the worker is stopped",
                )
            finally:
                self.worker.signal(signal.SIGCONT)
        except BaseException as exc:  # handed to the test thread by join()
            self.error = exc

    def join(self) -> None:
        self._thread.join(timeout=180)
        if self.error is not None:
            raise self.error
