"""``AsyncClient``: the asyncio twin of ``Client``, method for method (see ``client.py``).

Build it with ``AsyncClient.from_url(url)`` or around a ``redis.asyncio.Redis``. Handles share
one pub/sub connection and one reader task per client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import redis.asyncio

from tokenfleet.producer import ops
from tokenfleet.producer.async_handle import AsyncHandle
from tokenfleet.producer.async_subscriber import AsyncSubscriber, async_pubsub_connection_factory
from tokenfleet.producer.client import CANCELLED_MESSAGE
from tokenfleet.producer.request import Prepared, prepare, prepare_many
from tokenfleet.shared.errors import TokenfleetError, UnknownRequest
from tokenfleet.shared.keys import CONSUMER_GROUP, DEFAULT_MODEL, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.queue_config import QueueConfig, QueueStats
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import Event, TerminalEvent, TerminalStatus
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.cancel import CANCEL, EXPIRE_OVERDUE, withdraw_keys_args
from tokenfleet.shared.scripts.enqueue import ENQUEUE, EXPIRED_MESSAGE, enqueue_keys_args
from tokenfleet.shared.scripts.queue_stats import QUEUE_STATS
from tokenfleet.shared.settings import Settings


class AsyncClient:
    """Submit generation requests from asyncio code. Arguments as ``Client``."""

    def __init__(
        self,
        redis_client: redis.asyncio.Redis,
        *,
        settings: Settings | None = None,
        recheck_s: float = 5.0,
        subscribe_timeout_s: float = 10.0,
    ) -> None:
        self._redis = redis_client
        self.settings = settings if settings is not None else Settings.from_env()
        self._keys = Keys(self.settings.key_prefix)
        self.recheck_s = recheck_s
        self.subscribe_timeout_s = subscribe_timeout_s
        self._subscriber = AsyncSubscriber(async_pubsub_connection_factory(redis_client))
        self._owns_redis = False

    @classmethod
    def from_url(cls, url: str | None = None, **kwargs: Any) -> AsyncClient:
        """A client with its own connection pool; ``url`` defaults to the settings' one."""
        settings = kwargs.pop("settings", None) or Settings.from_env()
        settings = settings.with_url(url)
        client = cls(redis.asyncio.Redis.from_url(settings.redis_url), settings=settings, **kwargs)
        client._owns_redis = True
        return client

    async def aclose(self) -> None:
        """Stop the subscriber (and close the pool if ``from_url`` created it)."""
        await self._subscriber.aclose()
        if self._owns_redis:
            await self._redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- submitting -----------------------------------------------------------------------------
    async def submit(
        self, prompt: Any = None, *, timeout: float | None = None, **params: Any
    ) -> AsyncHandle:
        """See ``Client.submit``."""
        return await self._submit(prompt, params, timeout=timeout, try_only=False)

    async def try_submit(self, prompt: Any = None, **params: Any) -> AsyncHandle:
        """See ``Client.try_submit``."""
        params.pop("timeout", None)
        return await self._submit(prompt, params, timeout=0.0, try_only=True)

    async def _submit(
        self, prompt: Any, params: dict[str, Any], *, timeout: float | None, try_only: bool
    ) -> AsyncHandle:
        prepared = prepare(self.settings, now=time.time(), prompt=prompt, **params)
        if self._subscriber.closed:  # before the enqueue: a refused submit leaves no request
            raise redis.ConnectionError("the client is closed")
        until = None if timeout is None else time.monotonic() + timeout
        delay, growth, ceiling = ops.BLOCK_POLL
        while True:
            code, value = await self._enqueue(prepared, try_only)
            if code in ("new", "exists"):
                # SUBSCRIBE only now, unconfirmed: the request reaches Redis sooner, and the
                # handle's first read waits for the confirmation and then reads the record and
                # token list, so what was published before it is not lost (docs/protocol.md)
                channel = self._keys.channel(prepared.request_id)
                try:
                    sub = await self._subscriber.subscribe(
                        channel, self.subscribe_timeout_s, confirm=False
                    )
                except redis.ConnectionError:  # closed meanwhile: the request exists anyway
                    sub = None  # the handle subscribes on its first read (and says why not)
                return AsyncHandle(
                    self,
                    prepared.request_id,
                    subscription=sub,
                    deadline=prepared.deadline if code == "new" else None,
                )
            if code != "full" or (until is not None and time.monotonic() + delay > until):
                raise ops.refusal(code, value)
            await asyncio.sleep(delay)
            delay = min(delay * growth, ceiling)

    async def submit_many(
        self, requests: Sequence[str | Mapping[str, Any]]
    ) -> list[AsyncHandle | TokenfleetError]:
        """See ``Client.submit_many``."""
        now = time.time()
        prepared = prepare_many(self.settings, requests, now=now)
        plan = ops.plan_batches(prepared)
        pipe = self._redis.pipeline(transaction=False)
        for (model, priority), indices in plan:
            k, a = enqueue_keys_args(
                self._keys,
                model,
                priority,
                [ops.enqueue_item(prepared[i]) for i in indices],
                now=now,
                ttl_s=self.settings.record_ttl_s,
            )
            await registry.aqueue(self._redis, pipe, ENQUEUE, k, a)
        replies = await pipe.execute()
        results: dict[int, AsyncHandle | TokenfleetError] = {}
        for (_, indices), reply in zip(plan, replies, strict=True):
            pairs = ops.enqueue_pairs(registry.check_reply(ENQUEUE, reply))
            for i, (code, value) in zip(indices, pairs, strict=True):
                p = prepared[i]
                if code in ("new", "exists"):
                    results[i] = AsyncHandle(self, p.request_id, deadline=p.deadline)
                else:
                    results[i] = ops.refusal(code, value)
        return [results[i] for i in range(len(prepared))]

    async def _enqueue(self, prepared: Prepared, try_only: bool) -> tuple[str, str]:
        k, a = enqueue_keys_args(
            self._keys,
            prepared.model,
            prepared.priority,
            [ops.enqueue_item(prepared)],
            now=time.time(),
            ttl_s=self.settings.record_ttl_s,
            try_only=try_only,
        )
        return ops.enqueue_pairs(await registry.acall(self._redis, ENQUEUE, k, a))[0]

    # -- following requests ---------------------------------------------------------------------
    def handle(self, request_id: str) -> AsyncHandle:
        """A handle on an existing request."""
        return AsyncHandle(self, request_id)

    async def stream(self, request_id: str, from_index: int = 0) -> AsyncIterator[Event]:
        """Events of an existing request from ``from_index`` on."""
        handle = self.handle(request_id)
        try:
            async for event in handle.stream(from_index):
                yield event
        finally:
            handle.close()

    async def status(self, request_id: str) -> RequestRecord:
        """See ``Client.status``."""
        while True:
            raw = await self._redis.hgetall(self._keys.record(request_id))
            record = RequestRecord.from_hash(request_id, raw)
            if record is None:
                raise UnknownRequest(
                    f"no request {request_id} (never submitted, or its record expired)"
                )
            if not ops.is_overdue(record):
                return record
            await self._expire_overdue(record)  # then read it again: now expired

    async def cancel(self, request_id: str) -> bool:
        """See ``Client.cancel``."""
        record = await self.status(request_id)
        k, a = self._withdraw_args(record, TerminalStatus.CANCELLED, CANCELLED_MESSAGE)
        code = (await registry.acall(self._redis, CANCEL, k, a))[0]
        return code in ("ok", "requested")

    async def _expire_overdue(self, record: RequestRecord) -> None:
        k, a = self._withdraw_args(record, TerminalStatus.EXPIRED, EXPIRED_MESSAGE)
        with contextlib.suppress(UnknownRequest):
            await registry.acall(self._redis, EXPIRE_OVERDUE, k, a)

    def _withdraw_args(
        self, record: RequestRecord, status: TerminalStatus, message: str
    ) -> tuple[list[str], list[str]]:
        event = TerminalEvent(record.request_id, status, num_tokens=0, message=message)
        return withdraw_keys_args(
            self._keys,
            event,
            model=record.model or DEFAULT_MODEL,
            priority=Priority.parse(record.priority or "normal"),
            now=time.time(),
            ttl_s=self.settings.record_ttl_s,
        )

    # -- queues ---------------------------------------------------------------------------------
    async def queue_stats(self) -> list[QueueStats]:
        """See ``Client.queue_stats``."""
        queues = ops.sorted_queues(await self._redis.smembers(self._keys.queues))
        if not queues:
            return []
        keys = ops.stats_keys(self._keys, queues)
        reply = await registry.acall(self._redis, QUEUE_STATS, keys, [CONSUMER_GROUP])
        return ops.stats_rows(queues, reply)

    async def queue_config(
        self, priority: str | Priority = "normal", model: str | None = None
    ) -> QueueConfig:
        """See ``Client.queue_config``."""
        p = Priority.parse(priority)
        raw = await self._redis.hgetall(self._keys.queue_config(model or DEFAULT_MODEL, p))
        return QueueConfig.from_hash(raw)

    async def set_queue_config(
        self,
        priority: str | Priority = "normal",
        model: str | None = None,
        *,
        max_waiting: int | None = None,
        policy: str | None = None,
    ) -> QueueConfig:
        """See ``Client.set_queue_config``."""
        p = Priority.parse(priority)
        m = model or DEFAULT_MODEL
        config = ops.merged_config(await self.queue_config(p, m), max_waiting, policy)
        pipe = self._redis.pipeline(transaction=True)
        for field, value in config.to_hash().items():
            pipe.hset(self._keys.queue_config(m, p), field, value)
        pipe.sadd(self._keys.queues, self._keys.queue_member(m, p))
        await pipe.execute()
        return config
