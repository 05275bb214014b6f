"""``Client``: the sync producer API a web app or a cron job uses (``AsyncClient`` mirrors it).

A thin face: each method runs one plan of ``core.client_core`` with the blocking driver.
Connections: one command connection pool (the redis client's) plus one shared pub/sub
connection with one reader thread, however many handles stream at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import redis

from tokenfleet.producer.core.client_core import ClientCore
from tokenfleet.producer.core.effects import Mailbox
from tokenfleet.producer.core.fleet_status import fleet_status, tenant_stats
from tokenfleet.producer.core.models import ModelInfo
from tokenfleet.producer.core.request import Prepared
from tokenfleet.producer.core.subscriptions import (
    pubsub_connection_factory,
    subscribe_commands,
)
from tokenfleet.producer.handle import Handle
from tokenfleet.producer.sync_io.driver import SyncDriver
from tokenfleet.producer.sync_io.subscriber import Subscriber
from tokenfleet.shared.errors import TokenfleetError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.queue_config import QueueConfig, QueueStats
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.redis_connect import redis_client as redis_client_for
from tokenfleet.shared.schema import Event
from tokenfleet.shared.settings import Settings


class Client(ClientCore[Handle]):
    """Submit generation requests and get tokens back.

    Args (keyword-only after ``redis_client``):
        redis_client: a ``redis.Redis``; its pool carries commands, and one extra connection
            built like it carries pub/sub.
        settings: prefix, record TTL and limits (default: ``Settings.from_env()``).
        recheck_s: how long a handle lets its channel stay quiet before re-reading the record.
        subscribe_timeout_s: how long a handle's first read waits for Redis to confirm its
            subscription (``submit`` does not wait) before raising ``redis.ConnectionError``.
        resubmit_lost: a handle of a request this client submitted whose record Redis lost
            (a failover, a restart from an older snapshot) submits it again, same id and
            parameters, once per loss, instead of raising ``RequestLost`` (default: the
            settings' ``resubmit_lost``, on; docs/redis-modes.md).
    """

    _subscriber: Subscriber

    def __init__(
        self,
        redis_client: redis.Redis,
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
        self._run = SyncDriver(self._slots, redis_client).run

    def redis_for_key(self, key: str) -> redis.Redis:
        """The redis client this producer uses for ``key`` (on a cluster, the client of its
        slot: a lane's, built the first time; else the one client)."""
        return self._slots.client(key)

    @staticmethod
    def _subscriber_of(redis_client: redis.Redis) -> Subscriber:
        return Subscriber(
            pubsub_connection_factory(redis_client), commands=subscribe_commands(redis_client)
        )

    @staticmethod
    def _redis_for(settings: Settings, *, root: str | None = None) -> redis.Redis:
        return redis_client_for(settings, root=root)

    def _new_handle(
        self,
        request_id: str,
        subscription: Mailbox | None,
        deadline: float | None,
        keys: Keys | None = None,
        prepared: Prepared | None = None,
    ) -> Handle:
        return Handle(
            self,
            request_id,
            subscription=subscription,
            deadline=deadline,
            keys=keys,
            prepared=prepared,
        )

    def close(self) -> None:
        """Stop the subscribers (and close the pools this client created: ``from_url``'s, and
        on a cluster those of the lanes it used)."""
        for subscriber in self._slots.subscribers():
            subscriber.close()
        for client in self._slots.owned():
            client.close()
        if self._owns_redis:
            self._redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submitting -----------------------------------------------------------------------------
    def submit(self, prompt: Any = None, *, timeout: float | None = None, **params: Any) -> Handle:
        """Enqueue one request and return its handle (parameters: docs/client.md).

        On a full queue: ``drop_newest`` raises ``Overloaded``; ``drop_oldest`` evicts the
        oldest waiting request; ``block`` waits for room up to ``timeout`` seconds (None: no
        limit), then raises ``Overloaded``. Invalid input raises ``InvalidRequest`` before
        anything touches Redis; a model that no live worker serves and the fleet does not
        declare raises ``ModelNotServed`` (nothing is written).
        """
        return self._run(self._submit(prompt, params, timeout=timeout, try_only=False))

    def try_submit(self, prompt: Any = None, **params: Any) -> Handle:
        """Like ``submit`` but never waits and never evicts: a full queue raises ``Overloaded``
        at once, whatever its policy (for cron callers that should skip a firing)."""
        return self._run(self._try_submit(prompt, params))

    def submit_many(
        self, requests: Sequence[str | Mapping[str, Any]]
    ) -> list[Handle | TokenfleetError]:
        """Enqueue many requests in one pipeline (bulk and background work).

        Each element is a prompt string or a mapping of ``submit`` keyword arguments. All are
        validated first (``InvalidRequest`` names the index; nothing is enqueued then). Returns,
        in order, a ``Handle`` per accepted (or already existing) request and the exception of
        each refused one (``Overloaded``: a full queue refuses at once here, even with policy
        ``block``; ``IdempotencyConflict``; ``ModelNotServed``). Handles subscribe lazily, when
        first streamed or waited on.
        """
        return self._run(self._submit_many(requests))

    def submit_batch(
        self,
        lines: Any,
        *,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> Any:
        """Run an OpenAI-style batch: ``lines`` is a JSONL path or an iterable of batch lines
        (``{"custom_id", "method": "POST", "url": endpoint, "body"}``, as dicts or JSON
        strings). Invalid lines go to its error file; the rest run at priority ``batch``, a
        window at a time. Returns a ``BatchHandle`` (``status()``, ``wait(progress=...)``,
        which also drives the batch, ``results()``, ``errors()``, ``cancel()``). Needs the
        ``gateway`` extra (docs/batches.md)."""
        from tokenfleet.producer.gateway.batches.handle import submit_batch_sync  # gateway extra

        return submit_batch_sync(
            self.settings,
            lines,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
        )

    def batch(self, batch_id: str) -> Any:
        """A ``BatchHandle`` on an existing batch (made here, by the CLI or through a gateway's
        ``/v1/batches``): ``status()``, ``wait()``, ``results()``, ``errors()``, ``cancel()``.
        Nothing is read until a method is called."""
        from tokenfleet.producer.gateway.batches.handle import BatchHandle  # gateway extra

        return BatchHandle(self.settings, batch_id)

    # -- following requests ---------------------------------------------------------------------
    def stream(self, request_id: str, from_index: int = 0) -> Iterator[Event]:
        """Events of an existing request from ``from_index`` on (reconnecting readers)."""
        with self.handle(request_id) as handle:
            yield from handle.stream(from_index)

    def status(self, request_id: str) -> RequestRecord:
        """The durable record; a queued request past its deadline is finished ``expired``
        first. Raises ``UnknownRequest`` if there is no record."""
        return self._run(self._status(request_id))

    def cancel(self, request_id: str) -> bool:
        """Cancel a request: a queued one ends ``cancelled`` now, a running one is stopped by
        its worker at its next step. True if cancelled or asked for; False if it had already
        ended. Raises ``UnknownRequest`` if there is no record."""
        return self._run(self._cancel(request_id))

    # -- models and queues ----------------------------------------------------------------------
    def models(self) -> list[ModelInfo]:
        """Every model the fleet serves now or declares (or served within the last hour),
        sorted by name: whether a live worker serves it, whether it is declared, and when its
        servers' heartbeats lapse. One snapshot (docs/models.md)."""
        return self._run(self._models())

    def queue_stats(self) -> list[QueueStats]:
        """Every known queue: length, running, waiting, bound, policy and when its oldest
        waiting request entered (one snapshot)."""
        return self._run(self._queue_stats())

    def fleet_status(self) -> dict[str, Any]:
        """The fleet at a glance as plain data: workers, queues (with their lag and their ends
        per status), routed streams, models, dead letters, KV pools. What ``tokenfleet status
        --json`` prints and the console shows (``core.fleet_status`` lists the fields)."""
        return self._run(fleet_status(self))

    def tenant_stats(self) -> list[dict[str, Any]]:
        """Per (model, tenant): weight, own bound, waiting, running, admitted, served tokens
        and virtual time (docs/fairness.md; ``fleet_status()``'s ``tenants``)."""
        return self._run(tenant_stats(self))

    def queue_config(
        self, priority: str | Priority = "normal", model: str | None = None
    ) -> QueueConfig:
        """The stored bound and policy of a queue (the defaults if none is stored)."""
        return self._run(self._queue_config(priority, model))

    def set_queue_config(
        self,
        priority: str | Priority = "normal",
        model: str | None = None,
        *,
        max_waiting: int | None = None,
        policy: str | None = None,
    ) -> QueueConfig:
        """Store a queue's bound and/or policy (validated); every producer obeys it at once."""
        return self._run(self._set_queue_config(priority, model, max_waiting, policy))
