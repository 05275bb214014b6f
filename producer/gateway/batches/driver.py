"""``BatchDriver``: one runner's drive of one batch while it holds the batch's lease.

Each line ``i`` runs as the fleet request ``{batch_id}-{i}`` at priority ``batch``. Submitting
is idempotent (the enqueue script answers ``exists`` for the same request), so re-attaching
after a crash is just submitting again: the handle follows the request that already exists.

Order of writes, which is what makes a crash harmless:

1. submit line ``i`` (idempotent), then move ``next_line`` past it (``batch_advance.lua``:
   forward only). A crash between the two resubmits ``i``: the same request.
2. when the request ends, ``batch_record.lua`` writes its output or error line only if the
   ledger has no entry for ``i`` (HSETNX) and counts it: no line is written twice, whichever
   runner (or the cancel / expiry sweep) gets there first.
3. every line has a ledger entry -> ``finalizing`` -> the output / error file objects ->
   ``completed``. Cancel and expiry first cancel the requests in flight, then give every line
   still without an entry an error line (``batch_cancelled`` / ``batch_expired``), then finalize.

On start a driver re-submits every line below ``next_line`` without a ledger entry (what a
runner that died had in flight). A line's request that Redis lost while the driver follows it (a
failover, a restart from an older snapshot) is submitted again by its handle, same id and body
(``resubmit_lost``, on by default). A line whose follow task ended on an error (Redis dropped the
connection under its record) is such a line too: the driver stops on that error, and its runner
re-takes the batch (the lease is still its own) and re-attaches the line the same way.

The window ``W`` (lines of this batch submitted and not yet recorded) starts at 8 and is capped
at the runner's ``window``. Every ``adapt_s`` it doubles when the batch queue has fewer than
``W / 2`` requests waiting (the fleet takes our lines as fast as we feed them) and is under half
its bound; it halves when the queue is over 3/4 of its bound or refuses a line as full. So the
batch queue never holds more than ``W`` of the batch's lines, far below its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis
import redis.asyncio

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.async_handle import AsyncHandle
from tokenfleet.producer.gateway.batches import lines as L
from tokenfleet.producer.gateway.batches.objects import (
    BatchObject,
    FileObject,
    LeaseLost,
    RedisHash,
)
from tokenfleet.producer.gateway.batches.scripts import ADVANCE, LEASE, RECORD
from tokenfleet.producer.gateway.responses import Framing, collect, failure
from tokenfleet.shared.cancellation import cancel_checkpoint, raise_if_cancelling
from tokenfleet.shared.errors import Overloaded, TokenfleetError, UnknownRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.shared.scripts.registry import acall

log = logging.getLogger(__name__)
START_WINDOW = 8
_SWEEP_CHUNK = 500  # lines a cancel / expiry sweep records concurrently


@dataclass(frozen=True, slots=True)
class DriveConfig:
    """What every driver of one runner shares."""

    client: AsyncClient
    redis: redis.asyncio.Redis
    keys: Keys
    token: str  # this runner's lease token
    lease_ms: int
    window: int  # the cap of W
    tick_s: float = 0.2
    adapt_s: float = 0.5
    stop_wait_s: float = 10.0  # how long cancel / expiry waits for cancelled requests to end
    default_max_tokens: int = 256
    # validates a batch left ``validating`` by a gateway that died (BatchStore.validate)
    validate: Callable[[str, str], Awaitable[None]] | None = None


class BatchDriver:
    """Drives one batch to a final status (or until its lease is lost)."""

    def __init__(self, cfg: DriveConfig, batch_id: str) -> None:
        self.cfg = cfg
        self.bid = batch_id
        self.k = cfg.keys
        self.window = min(START_WINDOW, cfg.window)
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.max_in_flight = 0  # the most lines this driver had in flight at once (tests)
        self.refusals = 0  # submits a full batch queue refused (each halved the window)
        self._renewed = 0.0
        self._adapted = 0.0
        self.model = ""  # the model of the lines (W adapts to its batch queue)
        self.failure: BaseException | None = None  # a follow task's error (see ``_forget``)

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Drive until final; return quietly when the lease is lost (another runner goes on)."""
        try:
            await self._drive()
        except LeaseLost:
            log.info("batch %s: lease lost, leaving it to the runner that holds it", self.bid)
        finally:
            for task in self.tasks.values():
                task.cancel()  # the requests go on; whoever drives next re-attaches them
            if self.tasks:
                await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _drive(self) -> None:
        b = await self._read()
        if b.status == "validating" and self.cfg.validate is not None:
            await self.cfg.validate(self.bid, self.cfg.token)  # its creator died validating
            b = await self._read()
        if b.final or not b.id:  # final, or its hash is gone: nothing to drive
            await self.cfg.redis.srem(self.k.batches_active, self.bid)
            return
        self.batch = b
        self.kind = L.ENDPOINTS[b.endpoint]
        self.lines_key = self.k.file_lines(b.input_file_id)
        self.next = b.next_line
        done = await self._ledger()
        for i in range(b.next_line):  # what a runner before us had in flight
            if i not in done:
                await self._start(i, await self.cfg.redis.lindex(self.lines_key, i))
        while True:
            cancel_checkpoint()
            if self.failure is not None:  # stop: the runner re-takes us, re-attaching the line
                raise self.failure
            await self._renew()
            b = await self._read()
            if b.status == "finalizing":  # a runner died while finalizing: finish it
                return await self._finalize("completed")
            if b.status == "cancelling":
                return await self._stop("cancelled", "batch_cancelled", "the batch was cancelled")
            if b.status != "in_progress":
                return
            if time.time() >= b.expires_at:
                return await self._stop(
                    "expired", "batch_expired", "the batch's completion window passed"
                )
            if b.completed + b.failed >= b.total:
                return await self._finalize("completed")
            await self._adapt()
            await self._feed(done)
            if self.tasks:
                await asyncio.wait(
                    self.tasks.values(),
                    timeout=self.cfg.tick_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            else:
                await asyncio.sleep(self.cfg.tick_s)

    async def _read(self) -> BatchObject:
        return BatchObject.from_hash(await self.cfg.redis.hgetall(self.k.batch(self.bid)))

    async def _ledger(self) -> set[int]:
        return {int(i) for i in await self.cfg.redis.hkeys(self.k.batch_done(self.bid))}

    async def _renew(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._renewed < self.cfg.lease_ms / 3000:
            return
        code = (
            await acall(
                self.cfg.redis,
                LEASE,
                [self.k.batch_lease(self.bid)],
                [self.cfg.token, self.cfg.lease_ms],
            )
        )[0]
        if code != "ok":
            raise LeaseLost(self.bid)
        self._renewed = now

    # -- feeding ----------------------------------------------------------------------------------
    async def _adapt(self, refused: bool = False) -> None:
        now = time.monotonic()
        if refused:
            self.window = max(1, self.window // 2)
            return
        if now - self._adapted < self.cfg.adapt_s:
            return
        self._adapted = now
        model = self.model
        waiting, bound = 0, 0
        for q in await self.cfg.client.queue_stats():
            if q.model == model and q.priority == Priority.BATCH.label:
                waiting, bound = q.waiting, q.max_waiting
        if bound and waiting > bound * 3 // 4:
            self.window = max(1, self.window // 2)
        elif 2 * waiting < self.window and (not bound or waiting < bound // 2):  # W=1 grows too
            self.window = min(self.cfg.window, self.window * 2)

    async def _feed(self, done: set[int]) -> None:
        room = self.window - len(self.tasks)
        total = self.batch.total
        while room > 0 and self.next < total:
            texts = await self.cfg.redis.lrange(self.lines_key, self.next, self.next + room - 1)
            if not texts:  # the input file was deleted under the batch
                await self._record(
                    self.next,
                    "err",
                    L.error_line(
                        self.bid,
                        self.next,
                        None,
                        "input_file_missing",
                        "the input file was deleted",
                    ),
                )
                self.next += 1
                continue
            for offset, raw in enumerate(texts):
                i = self.next + offset
                if i in done:  # an invalid line (recorded at creation)
                    continue
                try:
                    await self._start(i, raw)
                except (Overloaded, redis.RedisError) as exc:
                    log.info("batch %s line %d: not submitted now (%s)", self.bid, i, exc)
                    await self._advance(i)
                    self.refusals += isinstance(exc, Overloaded)
                    await self._adapt(refused=isinstance(exc, Overloaded))
                    return
                room -= 1
            await self._advance(self.next + len(texts))

    async def _advance(self, to: int) -> None:
        if to > self.next:
            await acall(self.cfg.redis, ADVANCE, [self.k.batch(self.bid)], [to])
            self.next = to

    async def _start(self, i: int, raw: bytes | str | None) -> None:
        """Submit line ``i`` (again) and follow it. Raises what the submit raises when the
        fleet cannot take it now (a full queue, Redis down: the line is tried again later); a
        refusal for good (``model_not_found``: a model the fleet neither serves nor declares; a
        conflict) is the line's error line."""
        text = as_str(raw) or ""
        try:
            line = L.parse_line(text, self.batch.endpoint, max_bytes=1 << 62)
            sub = L.submission(self.batch.endpoint, line.body, self.cfg.default_max_tokens)
        except L.LineError as exc:  # validated at creation: only a deleted file gets here
            await self._record(i, "err", L.error_line(self.bid, i, None, exc.code, exc.message))
            return
        rid = L.request_id(self.bid, i)
        try:
            handle = await self.cfg.client.try_submit(
                model=sub.model,
                priority=Priority.BATCH,
                request_id=rid,
                tenant=self.batch.tenant,
                **sub.params,
            )
        except (Overloaded, redis.RedisError):
            raise
        except TokenfleetError as exc:  # refused for good (conflict, invalid): an error line
            line_err = L.error_line(self.bid, i, line.custom_id, exc.code, str(exc))
            await self._record(i, "err", line_err)
            return
        self.model = sub.model  # a model the fleet takes: W adapts to its batch queue
        framing = Framing(rid, self.kind, sub.model, int(time.time()), sub.tools)
        task = asyncio.get_running_loop().create_task(
            self._follow(i, line.custom_id, framing, handle)
        )
        self.tasks[i] = task
        self.max_in_flight = max(self.max_in_flight, len(self.tasks))
        task.add_done_callback(functools.partial(self._forget, i))

    def _forget(self, i: int, task: asyncio.Task[None]) -> None:
        self.tasks.pop(i, None)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()  # line i has no ledger entry and nobody follows it

    async def _follow(
        self, i: int, custom_id: str | None, framing: Framing, handle: AsyncHandle
    ) -> None:
        """Wait for the request's end and record it (following again through Redis outages)."""
        rid = framing.request_id
        while True:
            cancel_checkpoint()
            try:
                tokens, terminal = await _collect(handle)
                break
            except redis.RedisError as exc:
                raise_if_cancelling(exc)
                log.warning("batch %s line %d: %s; following it again", self.bid, i, exc)
                await asyncio.sleep(0.5)
                handle.close()  # the same handle reads on (and submits the line again if
                # Redis lost it: Client(resubmit_lost), docs/redis-modes.md)
            except UnknownRequest as exc:  # its record expired before anyone followed it
                line = L.error_line(self.bid, i, custom_id, "request_lost", str(exc))
                await self._record(i, "err", line)
                return
        if terminal.status is TerminalStatus.DONE:
            body = framing.response(tokens, terminal)
            await self._record(i, "ok", L.output_line(self.bid, i, custom_id or "", rid, body))
            return
        err = failure(terminal)
        response = {"status_code": err.status, "request_id": rid, "body": err.body()}
        line = L.error_line(self.bid, i, custom_id, err.code or "error", err.message, response)
        await self._record(i, "err", line)

    async def _record(self, i: int, kind: str, line: str) -> bool:
        b = self.batch
        keys = [
            self.k.batch_done(self.bid),
            self.k.batch(self.bid),
            self.k.file_lines(b.out_id),
            self.k.file_lines(b.err_id),
        ]
        return bool((await acall(self.cfg.redis, RECORD, keys, [i, kind, line]))[1])

    # -- the end ----------------------------------------------------------------------------------
    async def _stop(self, status: str, code: str, message: str) -> None:
        """Cancel what runs, give every line without a result an error line, finalize."""
        for i in list(self.tasks):
            with contextlib.suppress(TokenfleetError, redis.RedisError):
                await self.cfg.client.cancel(L.request_id(self.bid, i))
        until = time.monotonic() + self.cfg.stop_wait_s
        while self.tasks and time.monotonic() < until:  # the cancelled requests end
            cancel_checkpoint()
            await asyncio.wait(self.tasks.values(), timeout=self.cfg.tick_s)
            await self._renew()
        done = await self._ledger()
        missing = [i for i in range(self.batch.total) if i not in done]
        for start in range(0, len(missing), _SWEEP_CHUNK):
            await self._renew()
            chunk = missing[start : start + _SWEEP_CHUNK]
            pipe = self.cfg.redis.pipeline(transaction=False)
            for i in chunk:
                pipe.lindex(self.lines_key, i)
            texts = await pipe.execute()

            async def one(i: int, raw: bytes | None) -> None:
                cid = L.custom_id_of(as_str(raw) or "")
                await self._record(i, "err", L.error_line(self.bid, i, cid, code, message))

            await asyncio.gather(*(one(i, raw) for i, raw in zip(chunk, texts, strict=True)))
        await self._finalize(status)

    async def _finalize(self, status: str) -> None:
        r, k, now = self.cfg.redis, self.k, int(time.time())
        if status == "completed":
            await r.hset(k.batch(self.bid), mapping={"status": "finalizing", "finalizing_at": now})
        raw = await r.hgetall(k.batch(self.bid))
        pipe = r.pipeline(transaction=True)
        fields: RedisHash = {"status": status, f"{status}_at": now}
        for kind, id_field, bytes_field in (
            ("output", "out_id", "output_bytes"),
            ("error", "err_id", "error_bytes"),
        ):
            size = int(raw.get(bytes_field.encode(), b"0"))
            if size:
                fid = as_str(raw[id_field.encode()]) or ""
                obj = FileObject(
                    fid, "batch_output", f"{self.bid}_{kind}.jsonl", size, now, kind, self.bid
                )
                pipe.hset(k.file(fid), mapping=obj.to_hash())
                fields[f"{kind}_file_id"] = fid
        pipe.hset(k.batch(self.bid), mapping=fields)
        pipe.srem(k.batches_active, self.bid)
        await pipe.execute()
        with contextlib.suppress(TokenfleetError):
            await acall(r, LEASE, [k.batch_lease(self.bid)], [self.cfg.token, 0])


async def _collect(handle: AsyncHandle) -> tuple[list[TokenEvent], TerminalEvent]:
    """The request's token events and terminal event (the handle is closed after)."""
    try:
        return await collect(handle)
    except RuntimeError:  # no terminal event: followed again, like a lost connection
        raise redis.ConnectionError(
            f"the events of {handle.request_id} ended without a terminal"
        ) from None
    finally:
        handle.close()
