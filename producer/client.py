"""``Client``: the sync producer API a web app or a cron job uses (``AsyncClient`` mirrors it).

Connections: one command connection pool (the redis client's) plus one shared pub/sub
connection with one reader thread, however many handles stream at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import redis

from tokenfleet.producer import ops
from tokenfleet.producer.handle import Handle
from tokenfleet.producer.request import Prepared, prepare, prepare_many
from tokenfleet.producer.subscriber import Subscriber, pubsub_connection_factory
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

CANCELLED_MESSAGE = "cancelled by the client before it started"


class Client:
    """Submit generation requests and get tokens back.

    Args (keyword-only after ``redis_client``):
        redis_client: a ``redis.Redis``; its pool carries commands, and one extra connection
            built like it carries pub/sub.
        settings: prefix, record TTL and limits (default: ``Settings.from_env()``).
        recheck_s: how long a handle lets its channel stay quiet before re-reading the record.
        subscribe_timeout_s: how long a handle's first read waits for Redis to confirm its
            subscription (``submit`` does not wait) before raising ``redis.ConnectionError``.
    """

    def __init__(
        self,
        redis_client: redis.Redis,
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
        self._subscriber = Subscriber(pubsub_connection_factory(redis_client))
        self._owns_redis = False

    @classmethod
    def from_url(cls, url: str | None = None, **kwargs: Any) -> Client:
        """A client with its own connection pool; ``url`` defaults to the settings' one."""
        settings = kwargs.pop("settings", None) or Settings.from_env()
        settings = settings.with_url(url)
        client = cls(redis.Redis.from_url(settings.redis_url), settings=settings, **kwargs)
        client._owns_redis = True
        return client

    def close(self) -> None:
        """Stop the subscriber (and close the pool if ``from_url`` created it)."""
        self._subscriber.close()
        if self._owns_redis:
            self._redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submitting -----------------------------------------------------------------------------
    def submit(self, prompt: Any = None, *, timeout: float | None = None, **params: Any) -> Handle:
        """Enqueue one request and return its handle (parameters: README, "Submitting work").

        On a full queue: ``drop_newest`` raises ``Overloaded``; ``drop_oldest`` evicts the
        oldest waiting request; ``block`` waits for room up to ``timeout`` seconds (None: no
        limit), then raises ``Overloaded``. Invalid input raises ``InvalidRequest`` before
        anything touches Redis.
        """
        return self._submit(prompt, params, timeout=timeout, try_only=False)

    def try_submit(self, prompt: Any = None, **params: Any) -> Handle:
        """Like ``submit`` but never waits and never evicts: a full queue raises ``Overloaded``
        at once, whatever its policy (for cron callers that should skip a firing)."""
        params.pop("timeout", None)
        return self._submit(prompt, params, timeout=0.0, try_only=True)

    def _submit(
        self, prompt: Any, params: dict[str, Any], *, timeout: float | None, try_only: bool
    ) -> Handle:
        prepared = prepare(self.settings, now=time.time(), prompt=prompt, **params)
        if self._subscriber.closed:  # before the enqueue: a refused submit leaves no request
            raise redis.ConnectionError("the client is closed")
        until = None if timeout is None else time.monotonic() + timeout
        delay, growth, ceiling = ops.BLOCK_POLL
        while True:
            code, value = self._enqueue(prepared, try_only)
            if code in ("new", "exists"):
                # SUBSCRIBE only now, unconfirmed: the request reaches Redis sooner, and the
                # handle's first read waits for the confirmation and then reads the record and
                # token list, so what was published before it is not lost (docs/protocol.md)
                channel = self._keys.channel(prepared.request_id)
                try:
                    sub = self._subscriber.subscribe(
                        channel, self.subscribe_timeout_s, confirm=False
                    )
                except redis.ConnectionError:  # closed meanwhile: the request exists anyway
                    sub = None  # the handle subscribes on its first read (and says why not)
                return Handle(
                    self,
                    prepared.request_id,
                    subscription=sub,
                    deadline=prepared.deadline if code == "new" else None,
                )
            if code != "full" or (until is not None and time.monotonic() + delay > until):
                raise ops.refusal(code, value)
            time.sleep(delay)
            delay = min(delay * growth, ceiling)

    def submit_many(
        self, requests: Sequence[str | Mapping[str, Any]]
    ) -> list[Handle | TokenfleetError]:
        """Enqueue many requests in one pipeline (bulk and background work).

        Each element is a prompt string or a mapping of ``submit`` keyword arguments. All are
        validated first (``InvalidRequest`` names the index; nothing is enqueued then). Returns,
        in order, a ``Handle`` per accepted (or already existing) request and an ``Overloaded``
        instance per refused one: a full queue refuses at once here, even with policy ``block``.
        Handles subscribe lazily, when first streamed or waited on.
        """
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
            registry.queue(self._redis, pipe, ENQUEUE, k, a)
        replies = pipe.execute()
        results: dict[int, Handle | TokenfleetError] = {}
        for ((_, _), indices), reply in zip(plan, replies, strict=True):
            pairs = ops.enqueue_pairs(registry.check_reply(ENQUEUE, reply))
            for i, (code, value) in zip(indices, pairs, strict=True):
                p = prepared[i]
                if code in ("new", "exists"):
                    results[i] = Handle(self, p.request_id, deadline=p.deadline)
                else:
                    results[i] = ops.refusal(code, value)
        return [results[i] for i in range(len(prepared))]

    def _enqueue(self, prepared: Prepared, try_only: bool) -> tuple[str, str]:
        k, a = enqueue_keys_args(
            self._keys,
            prepared.model,
            prepared.priority,
            [ops.enqueue_item(prepared)],
            now=time.time(),
            ttl_s=self.settings.record_ttl_s,
            try_only=try_only,
        )
        return ops.enqueue_pairs(registry.call(self._redis, ENQUEUE, k, a))[0]

    # -- following requests ---------------------------------------------------------------------
    def handle(self, request_id: str) -> Handle:
        """A handle on an existing request (e.g. one submitted by another process)."""
        return Handle(self, request_id)

    def stream(self, request_id: str, from_index: int = 0) -> Iterator[Event]:
        """Events of an existing request from ``from_index`` on (reconnecting readers)."""
        with self.handle(request_id) as handle:
            yield from handle.stream(from_index)

    def status(self, request_id: str) -> RequestRecord:
        """The durable record; a queued request past its deadline is finished ``expired``
        first. Raises ``UnknownRequest`` if there is no record."""
        while True:
            record = RequestRecord.from_hash(
                request_id, self._redis.hgetall(self._keys.record(request_id))
            )
            if record is None:
                raise UnknownRequest(
                    f"no request {request_id} (never submitted, or its record expired)"
                )
            if not ops.is_overdue(record):
                return record
            self._expire_overdue(record)  # then read it again: now expired

    def cancel(self, request_id: str) -> bool:
        """Cancel a request: a queued one ends ``cancelled`` now, a running one is stopped by
        its worker at its next step. True if cancelled or asked for; False if it had already
        ended. Raises ``UnknownRequest`` if there is no record."""
        record = self.status(request_id)
        k, a = self._withdraw_args(record, TerminalStatus.CANCELLED, CANCELLED_MESSAGE)
        code = registry.call(self._redis, CANCEL, k, a)[0]
        return code in ("ok", "requested")

    def _expire_overdue(self, record: RequestRecord) -> None:
        k, a = self._withdraw_args(record, TerminalStatus.EXPIRED, EXPIRED_MESSAGE)
        with contextlib.suppress(UnknownRequest):
            registry.call(self._redis, EXPIRE_OVERDUE, k, a)

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
    def queue_stats(self) -> list[QueueStats]:
        """Every known queue: length, running, waiting, bound and policy (one snapshot)."""
        queues = ops.sorted_queues(self._redis.smembers(self._keys.queues))
        if not queues:
            return []
        reply = registry.call(
            self._redis, QUEUE_STATS, ops.stats_keys(self._keys, queues), [CONSUMER_GROUP]
        )
        return ops.stats_rows(queues, reply)

    def queue_config(
        self, priority: str | Priority = "normal", model: str | None = None
    ) -> QueueConfig:
        """The stored bound and policy of a queue (the defaults if none is stored)."""
        p = Priority.parse(priority)
        raw = self._redis.hgetall(self._keys.queue_config(model or DEFAULT_MODEL, p))
        return QueueConfig.from_hash(raw)

    def set_queue_config(
        self,
        priority: str | Priority = "normal",
        model: str | None = None,
        *,
        max_waiting: int | None = None,
        policy: str | None = None,
    ) -> QueueConfig:
        """Store a queue's bound and/or policy (validated); every producer obeys it at once."""
        p = Priority.parse(priority)
        m = model or DEFAULT_MODEL
        config = ops.merged_config(self.queue_config(p, m), max_waiting, policy)
        pipe = self._redis.pipeline(transaction=True)
        for field, value in config.to_hash().items():
            pipe.hset(self._keys.queue_config(m, p), field, value)
        pipe.sadd(self._keys.queues, self._keys.queue_member(m, p))
        pipe.execute()
        return config
