"""``BatchStore``: create (validating every line), read, list and cancel batches.

Creating a batch validates every input line at once (``lines``): an invalid line is recorded
in the batch's ledger as ``err`` and written to its error file with the reason — through the
same ledger script the runner uses, so it counts as failed exactly once — and the valid lines
are what the runner submits. A batch with no valid line (or over ``max_lines``) ends ``failed``
with ``errors``; otherwise it becomes ``in_progress``. ``completion_window`` is ``<N>h`` or
``<N>m`` (OpenAI accepts only ``24h``).

A batch joins the active set the runners watch when it is created, still ``validating``, with
its lease held by the validating gateway (renewed as validation goes on): if that gateway dies
mid-validation the lease lapses and a runner validates the batch again (``validate``; the ledger
keeps every invalid line's record single) and drives it, so no batch stays ``validating``.
Status changes out of ``validating`` happen only while it still is (a cancel meanwhile wins).
"""

from __future__ import annotations

import asyncio
import builtins
import os
import re
import time
from typing import Any

import orjson
import redis.asyncio

from tokenfleet.producer.gateway.batches import lines as L
from tokenfleet.producer.gateway.batches.files import FileStore, new_file_id
from tokenfleet.producer.gateway.batches.objects import BatchObject, LeaseLost, NotFound, RedisHash
from tokenfleet.producer.gateway.batches.scripts import CANCEL, LEASE, RECORD
from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.shared.errors import UnknownRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.scripts.registry import acall, aqueue
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.tenants import DEFAULT_TENANT

_WINDOW = re.compile(r"^([1-9][0-9]{0,4})([hm])$")
DEFAULT_MAX_LINES = 200_000
_MAX_LISTED_ERRORS = 100  # a failed batch's ``errors`` lists at most this many lines
_YIELD_EVERY = 500  # validation hands the event loop back every this many lines


def window_seconds(window: str) -> int:
    """Seconds of a ``<N>h`` / ``<N>m`` completion window (``ApiError`` 400 otherwise)."""
    m = _WINDOW.match(window) if isinstance(window, str) else None
    if m is None:
        raise ApiError(
            400,
            f"completion_window must be '<N>h' or '<N>m' (e.g. '24h'), got {window!r}",
            param="completion_window",
        )
    return int(m.group(1)) * (3600 if m.group(2) == "h" else 60)


def new_batch_id() -> str:
    """A fresh ``batch_<hex>`` id."""
    return "batch_" + os.urandom(12).hex()


class BatchStore:
    """The batches of one fleet (key prefix)."""

    def __init__(
        self,
        redis: redis.asyncio.Redis,
        settings: Settings,
        *,
        max_line_bytes: int = L.DEFAULT_MAX_LINE_BYTES,
        max_lines: int = DEFAULT_MAX_LINES,
        default_max_tokens: int = 256,
        lease_ms: int = 10_000,
    ) -> None:
        self._r = redis
        self.lease_ms = lease_ms  # the validation lease (as the runners' batch lease)
        self._keys = Keys.for_settings(settings)
        self._files = FileStore(redis, settings)
        self.max_line_bytes = max_line_bytes
        self.max_lines = max_lines
        self.default_max_tokens = default_max_tokens

    async def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, Any] | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> BatchObject:
        """Create a batch and validate its lines (see the module docstring); its lines run
        as ``tenant``'s requests (docs/fairness.md)."""
        if endpoint not in L.ENDPOINTS:
            raise ApiError(
                400,
                f"endpoint must be one of {sorted(L.ENDPOINTS)}, got {endpoint!r}",
                param="endpoint",
            )
        window_s = window_seconds(completion_window)
        if metadata is not None and not isinstance(metadata, dict):
            raise ApiError(400, "metadata must be an object", param="metadata")
        file = await self._files.get(input_file_id)
        if file.kind != "input":
            raise ApiError(
                400, f"{input_file_id} is not an uploaded input file", param="input_file_id"
            )
        texts = await self._files.lines(input_file_id)
        now = int(time.time())
        bid = new_batch_id()
        fields: RedisHash = {
            "id": bid,
            "status": "validating",
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "metadata": orjson.dumps(metadata).decode() if metadata is not None else "",
            "created_at": now,
            "expires_at": now + window_s,
            "total": len(texts),
            "completed": 0,
            "failed": 0,
            "next_line": 0,
            "out_id": new_file_id(),  # where the runner writes; exposed once final
            "err_id": new_file_id(),
        }
        if tenant != DEFAULT_TENANT:  # (absent reads as the default tenant)
            fields["tenant"] = tenant
        token = "create-" + os.urandom(12).hex()
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(self._keys.batch(bid), mapping=fields)
        pipe.zadd(self._keys.batches, {bid: time.time()})  # sub-second: a stable order
        pipe.set(self._keys.batch_lease(bid), token, px=self.lease_ms)
        pipe.sadd(self._keys.batches_active, bid)
        await pipe.execute()
        try:
            await self.validate(bid, token, texts)
        except LeaseLost:  # validation outlived its lease: a runner validates it now (same result)
            return await self.get(bid)
        await acall(self._r, LEASE, [self._keys.batch_lease(bid)], [token, 0])  # runners' turn
        return await self.get(bid)

    async def validate(self, bid: str, token: str, texts: list[str] | None = None) -> None:
        """Validate a ``validating`` batch's lines and move it on (``in_progress`` or
        ``failed``), renewing the lease ``token`` holds as it goes; a batch in another status
        is left alone. Safe to run again after a crash (the ledger records each line once).
        ``LeaseLost`` (from ``driver``) when another holder took the lease meanwhile."""
        raw = await self._r.hgetall(self._keys.batch(bid))
        b = BatchObject.from_hash(raw) if raw else None
        if b is None or b.status != "validating":
            return
        if texts is None:
            texts = await self._files.lines(b.input_file_id)
        err_id = as_str(raw.get(b"err_id")) or ""
        errors = await self._validate(bid, b.endpoint, texts, err_id, token)
        valid = len(texts) - len(errors)
        if len(texts) > self.max_lines or valid == 0:
            await self._leave_validating(
                bid,
                {
                    "status": "failed",
                    "failed_at": int(time.time()),
                    "errors": orjson.dumps(errors[:_MAX_LISTED_ERRORS]).decode(),
                },
            )
        else:
            await self._leave_validating(
                bid, {"status": "in_progress", "in_progress_at": int(time.time())}
            )

    async def _leave_validating(self, bid: str, mapping: RedisHash) -> None:
        """Set ``mapping`` on the batch only while it is ``validating`` (WATCH; one key)."""
        key = self._keys.batch(bid)
        async with self._r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    if as_str(await pipe.hget(key, "status")) != "validating":
                        return
                    pipe.multi()
                    pipe.hset(key, mapping=mapping)
                    if mapping["status"] == "failed":  # final: nothing for runners to drive
                        pipe.srem(self._keys.batches_active, bid)
                    await pipe.execute()
                    return
                except redis.WatchError as exc:
                    if isinstance(exc.__context__, redis.ConnectionError):
                        raise exc.__context__ from exc  # redis-py's word for a lost connection
                    continue  # it changed (a cancel?): look again

    async def _validate(
        self, bid: str, endpoint: str, texts: list[str], err_id: str, token: str
    ) -> list[dict[str, Any]]:
        """Record every invalid line (ledger ``err`` + error file); their errors."""
        errors: list[dict[str, Any]] = []
        seen: set[str] = set()
        record_keys = [
            self._keys.batch_done(bid),
            self._keys.batch(bid),
            self._keys.file_lines(""),  # never written: "err" lines go to KEYS[4]
            self._keys.file_lines(err_id),
        ]
        lease = [self._keys.batch_lease(bid)]
        pipe = self._r.pipeline(transaction=False)  # the invalid lines of the last 500, at once
        for i, text in enumerate(texts):
            if i % _YIELD_EVERY == 0:
                await pipe.execute()
                await asyncio.sleep(0)
                if (await acall(self._r, LEASE, lease, [token, self.lease_ms]))[0] != "ok":
                    raise LeaseLost(f"batch {bid}: the validation lease was taken over")
            custom_id = L.custom_id_of(text)
            try:
                if len(texts) > self.max_lines:
                    raise L.LineError(
                        "too_many_lines",
                        f"the file has {len(texts)} lines; the limit is {self.max_lines}",
                    )
                line = L.parse_line(text, endpoint, self.max_line_bytes)
                if line.custom_id in seen:
                    raise L.LineError(
                        "duplicate_custom_id",
                        f"custom_id {line.custom_id!r} is used by an earlier line",
                    )
                seen.add(line.custom_id or "")
                L.submission(endpoint, line.body, self.default_max_tokens)
            except L.LineError as exc:
                errors.append(
                    {"code": exc.code, "message": exc.message, "line": i + 1, "param": None}
                )
                out = L.error_line(bid, i, custom_id, exc.code, exc.message)
                await aqueue(self._r, pipe, RECORD, record_keys, [i, "err", out])
        await pipe.execute()
        return errors

    async def get(self, batch_id: str) -> BatchObject:
        """The batch (``NotFound`` for an unknown id)."""
        raw = await self._r.hgetall(self._keys.batch(batch_id))
        if not raw:
            raise NotFound("batch", batch_id)
        return BatchObject.from_hash(raw)

    async def list(
        self, after: str | None = None, limit: int = 20
    ) -> tuple[builtins.list[BatchObject], bool]:
        """Batches newest first, from the one after ``after``; and whether more follow."""
        if not 1 <= limit <= 100:
            raise ApiError(400, f"limit must be in 1..100, got {limit}", param="limit")
        start = 0
        if after is not None:
            rank = await self._r.zrevrank(self._keys.batches, after)
            if rank is None:
                raise NotFound("batch", after)
            start = int(rank) + 1  # type: ignore[arg-type]  # ZREVRANK without WITHSCORE: an int
        ids: builtins.list[Any] = await self._r.zrevrange(
            self._keys.batches, start, start + limit
        )  # without scores: members only (bytes)
        pipe = self._r.pipeline(transaction=False)  # one round trip for the page
        for i in ids[:limit]:
            pipe.hgetall(self._keys.batch(as_str(i) or ""))
        out = [BatchObject.from_hash(raw) for raw in await pipe.execute() if raw]
        return out, len(ids) > limit

    async def active(self, limit: int = 100) -> builtins.list[BatchObject]:
        """At most ``limit`` of the batches runners drive now (not final yet), by id."""
        ids = sorted(as_str(i) or "" for i in await self._r.smembers(self._keys.batches_active))
        pipe = self._r.pipeline(transaction=False)
        for i in ids[:limit]:
            pipe.hgetall(self._keys.batch(i))
        return [BatchObject.from_hash(raw) for raw in await pipe.execute() if raw]

    async def cancel(self, batch_id: str) -> BatchObject:
        """Ask for cancellation: ``cancelling`` now, ``cancelled`` once the runner has stopped
        its lines (a final batch is answered as it is)."""
        try:
            await acall(self._r, CANCEL, [self._keys.batch(batch_id)], [int(time.time())])
        except UnknownRequest:
            raise NotFound("batch", batch_id) from None
        return await self.get(batch_id)
