"""Batches from Python: ``AsyncClient.submit_batch`` / ``Client.submit_batch`` and their handles.

``submit_batch`` uploads the lines as a batch file and creates the batch (the same objects
``POST /v1/files`` and ``POST /v1/batches`` make); the handle reads its progress and results.
``wait()`` also *drives* the batch while it waits — it runs a ``BatchRunner`` in this process —
so a fleet with no gateway still makes progress; with gateways running, the runners share the
work through the batch's lease and each line is still written exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.gateway.batches.files import FileStore
from tokenfleet.producer.gateway.batches.objects import BatchObject
from tokenfleet.producer.gateway.batches.runner import BatchRunner
from tokenfleet.producer.gateway.batches.store import BatchStore
from tokenfleet.shared.cancellation import cancel_checkpoint
from tokenfleet.shared.redis_connect import async_redis_client
from tokenfleet.shared.settings import Settings

Progress = Callable[[BatchObject], None]
BatchInput = str | os.PathLike[str] | Iterable[str | Mapping[str, Any]]


def batch_bytes(lines: BatchInput) -> tuple[str, bytes]:
    """(file name, JSONL bytes) of a path or of lines (JSON strings or objects)."""
    if isinstance(lines, str | os.PathLike):
        path = Path(lines)
        return path.name, path.read_bytes()
    out = [line if isinstance(line, str) else orjson.dumps(dict(line)).decode() for line in lines]
    return "batch.jsonl", ("\n".join(out) + "\n").encode()


class AsyncBatchHandle:
    """One batch, from asyncio code."""

    def __init__(self, client: AsyncClient, redis_client: redis.asyncio.Redis, batch_id: str):
        self.batch_id = batch_id
        self._client = client
        self._redis = redis_client
        settings = client.settings
        self._batches = BatchStore(redis_client, settings)
        self._files = FileStore(redis_client, settings)

    async def status(self) -> BatchObject:
        """The batch now (``.status``, ``.completed``, ``.failed``, ``.total``)."""
        return await self._batches.get(self.batch_id)

    async def cancel(self) -> BatchObject:
        """Stop feeding lines, cancel the running ones, finalize with what is done."""
        return await self._batches.cancel(self.batch_id)

    async def wait(
        self,
        *,
        progress: Progress | None = None,
        poll_s: float = 0.5,
        drive: bool = True,
        timeout: float | None = None,
    ) -> BatchObject:
        """Until the batch is final, calling ``progress`` with each new state; with ``drive``
        (default) a runner in this process feeds this batch's lines meanwhile (other batches
        are left to their own runners). ``timeout`` (seconds): raise ``TimeoutError`` with the
        batch's state if it is not final by then (the batch goes on). If the runner dies, its
        error is raised."""
        runner = (
            BatchRunner(
                self._client, self._redis, self._client.settings, only=frozenset({self.batch_id})
            )
            if drive
            else None
        )
        task = asyncio.get_running_loop().create_task(runner.run()) if runner else None
        until = None if timeout is None else time.monotonic() + timeout
        try:
            last: tuple[str, int, int] | None = None
            while True:
                cancel_checkpoint()
                batch = await self.status()
                now = (batch.status, batch.completed, batch.failed)
                if progress is not None and now != last:
                    progress(batch)
                last = now
                if batch.final:
                    return batch
                if task is not None and task.done():  # run() only ends by raising
                    task.result()
                    raise RuntimeError(f"the runner of batch {self.batch_id} stopped")
                if until is not None and time.monotonic() >= until:
                    raise TimeoutError(
                        f"batch {self.batch_id} is not final after {timeout} s: {batch.status}, "
                        f"{batch.completed} completed and {batch.failed} failed of {batch.total}"
                    )
                await asyncio.sleep(poll_s)
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def results(self) -> list[dict[str, Any]]:
        """The output file's lines (once final), parsed, in the order they were written."""
        batch = await self.status()
        if not batch.output_file_id:
            return []
        return [orjson.loads(line) for line in await self._files.lines(batch.output_file_id)]

    async def errors(self) -> list[dict[str, Any]]:
        """The error file's lines (invalid lines and failed requests), parsed."""
        batch = await self.status()
        if not batch.error_file_id:
            return []
        return [orjson.loads(line) for line in await self._files.lines(batch.error_file_id)]


async def submit_batch(
    client: AsyncClient,
    redis_client: redis.asyncio.Redis,
    lines: BatchInput,
    *,
    endpoint: str = "/v1/chat/completions",
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
) -> AsyncBatchHandle:
    """Upload ``lines`` and create their batch; invalid lines go to its error file."""
    name, data = batch_bytes(lines)
    settings: Settings = client.settings
    upload = await FileStore(redis_client, settings).create("batch", name, data)
    batch = await BatchStore(redis_client, settings).create(
        upload.id, endpoint, completion_window, metadata
    )
    return AsyncBatchHandle(client, redis_client, batch.id)


class BatchHandle:
    """One batch, from synchronous code: each method runs its ``AsyncBatchHandle`` twin on a
    connection of its own (``asyncio.run``; not from inside a running event loop)."""

    def __init__(self, settings: Settings, batch_id: str) -> None:
        self.batch_id = batch_id
        self._settings = settings

    def _run(self, call: Callable[[AsyncBatchHandle], Any]) -> Any:
        settings = self._settings

        async def go() -> Any:
            r = async_redis_client(settings)
            client = AsyncClient(r, settings=settings)
            try:
                return await call(AsyncBatchHandle(client, r, self.batch_id))
            finally:
                await client.aclose()
                await r.aclose()

        return asyncio.run(go())

    def status(self) -> BatchObject:
        """See ``AsyncBatchHandle.status``."""
        return self._run(lambda h: h.status())

    def cancel(self) -> BatchObject:
        """See ``AsyncBatchHandle.cancel``."""
        return self._run(lambda h: h.cancel())

    def wait(
        self,
        *,
        progress: Progress | None = None,
        poll_s: float = 0.5,
        drive: bool = True,
        timeout: float | None = None,
    ) -> BatchObject:
        """See ``AsyncBatchHandle.wait``."""
        return self._run(
            lambda h: h.wait(progress=progress, poll_s=poll_s, drive=drive, timeout=timeout)
        )

    def results(self) -> list[dict[str, Any]]:
        """See ``AsyncBatchHandle.results``."""
        return self._run(lambda h: h.results())

    def errors(self) -> list[dict[str, Any]]:
        """See ``AsyncBatchHandle.errors``."""
        return self._run(lambda h: h.errors())


def submit_batch_sync(
    settings: Settings,
    lines: BatchInput,
    *,
    endpoint: str = "/v1/chat/completions",
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
) -> BatchHandle:
    """``submit_batch`` for synchronous code."""

    async def go() -> str:
        r = async_redis_client(settings)
        client = AsyncClient(r, settings=settings)
        try:
            handle = await submit_batch(
                client,
                r,
                lines,
                endpoint=endpoint,
                completion_window=completion_window,
                metadata=metadata,
            )
            return handle.batch_id
        finally:
            await client.aclose()
            await r.aclose()

    return BatchHandle(settings, asyncio.run(go()))
