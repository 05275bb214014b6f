"""``AsyncClient``: the asyncio face of the client, method for method as ``Client``.

Build it with ``AsyncClient.from_url(url)`` or around a ``redis.asyncio.Redis``. Each method
awaits one plan of ``core.client_core`` on the asyncio driver. Handles share one pub/sub
connection and one reader task per client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import redis.asyncio

from tokenfleet.producer.async_handle import AsyncHandle
from tokenfleet.producer.async_io.driver import AsyncDriver
from tokenfleet.producer.async_io.subscriber import AsyncSubscriber
from tokenfleet.producer.core.client_core import ClientCore
from tokenfleet.producer.core.effects import Mailbox
from tokenfleet.producer.core.fleet_status import fleet_status, tenant_stats
from tokenfleet.producer.core.models import ModelInfo
from tokenfleet.producer.core.request import Prepared
from tokenfleet.producer.core.subscriptions import (
    pubsub_connection_factory,
    subscribe_commands,
)
from tokenfleet.shared.errors import TokenfleetError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.queue_config import QueueConfig, QueueStats
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.redis_connect import async_redis_client
from tokenfleet.shared.schema import Event
from tokenfleet.shared.settings import Settings


class AsyncClient(ClientCore[AsyncHandle]):
    """Submit generation requests from asyncio code. Arguments as ``Client``."""

    _subscriber: AsyncSubscriber

    def __init__(
        self,
        redis_client: redis.asyncio.Redis,
        *,
        settings: Settings | None = None,
        recheck_s: float = 5.0,
        subscribe_timeout_s: float = 10.0,
        resubmit_lost: bool | None = None,
    ) -> None:
        super().__init__(
            redis_client,
            settings=settings,
            recheck_s=recheck_s,
            subscribe_timeout_s=subscribe_timeout_s,
            resubmit_lost=resubmit_lost,
        )
        self._run = AsyncDriver(self._slots, redis_client).run

    def redis_for_key(self, key: str) -> redis.asyncio.Redis:
        """The redis client this producer uses for ``key`` (on a cluster, the client of its
        slot: a lane's, built the first time; else the one client)."""
        return self._slots.client(key)

    @staticmethod
    def _subscriber_of(redis_client: redis.asyncio.Redis) -> AsyncSubscriber:
        # the reader task waits on the connection itself: no read timeout on it
        factory = pubsub_connection_factory(redis_client, socket_timeout=None)
        return AsyncSubscriber(factory, commands=subscribe_commands(redis_client))

    @staticmethod
    def _redis_for(settings: Settings, *, root: str | None = None) -> redis.asyncio.Redis:
        return async_redis_client(settings, root=root)

    def _new_handle(
        self,
        request_id: str,
        subscription: Mailbox | None,
        deadline: float | None,
        keys: Keys | None = None,
        prepared: Prepared | None = None,
    ) -> AsyncHandle:
        return AsyncHandle(
            self,
            request_id,
            subscription=subscription,
            deadline=deadline,
            keys=keys,
            prepared=prepared,
        )

    async def aclose(self) -> None:
        """Stop the subscribers (and close the pools this client created: ``from_url``'s, and
        on a cluster those of the lanes it used)."""
        for subscriber in self._slots.subscribers():
            await subscriber.aclose()
        for client in self._slots.owned():
            await client.aclose()
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
        return await self._run(self._submit(prompt, params, timeout=timeout, try_only=False))

    async def try_submit(self, prompt: Any = None, **params: Any) -> AsyncHandle:
        """See ``Client.try_submit``."""
        return await self._run(self._try_submit(prompt, params))

    async def submit_many(
        self, requests: Sequence[str | Mapping[str, Any]]
    ) -> list[AsyncHandle | TokenfleetError]:
        """See ``Client.submit_many``."""
        return await self._run(self._submit_many(requests))

    async def submit_batch(
        self,
        lines: Any,
        *,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> Any:
        """See ``Client.submit_batch``; returns an ``AsyncBatchHandle``."""
        from tokenfleet.producer.gateway.batches.handle import submit_batch  # gateway extra

        return await submit_batch(
            self,
            self._redis,
            lines,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
        )

    def batch(self, batch_id: str) -> Any:
        """See ``Client.batch``; returns an ``AsyncBatchHandle`` on this client's connection."""
        from tokenfleet.producer.gateway.batches.handle import AsyncBatchHandle  # gateway extra

        return AsyncBatchHandle(self, self._redis, batch_id)

    # -- following requests ---------------------------------------------------------------------
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
        return await self._run(self._status(request_id))

    async def cancel(self, request_id: str) -> bool:
        """See ``Client.cancel``."""
        return await self._run(self._cancel(request_id))

    # -- models and queues ----------------------------------------------------------------------
    async def models(self) -> list[ModelInfo]:
        """See ``Client.models``."""
        return await self._run(self._models())

    async def queue_stats(self) -> list[QueueStats]:
        """See ``Client.queue_stats``."""
        return await self._run(self._queue_stats())

    async def fleet_status(self) -> dict[str, Any]:
        """See ``Client.fleet_status``."""
        return await self._run(fleet_status(self))

    async def tenant_stats(self) -> list[dict[str, Any]]:
        """See ``Client.tenant_stats``."""
        return await self._run(tenant_stats(self))

    async def queue_config(
        self, priority: str | Priority = "normal", model: str | None = None
    ) -> QueueConfig:
        """See ``Client.queue_config``."""
        return await self._run(self._queue_config(priority, model))

    async def set_queue_config(
        self,
        priority: str | Priority = "normal",
        model: str | None = None,
        *,
        max_waiting: int | None = None,
        policy: str | None = None,
    ) -> QueueConfig:
        """See ``Client.set_queue_config``."""
        return await self._run(self._set_queue_config(priority, model, max_waiting, policy))
