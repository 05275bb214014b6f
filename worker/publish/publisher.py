"""Publishing one engine step: every new token, every finish and the cancel check in one round trip.

One ``APPEND_TOKENS`` call takes every request with new tokens: for each, it pushes the encoded
token events onto its token list and publishes them on its channel (list first, so a late
subscriber misses nothing), then updates ``num_tokens``. For each finished request, ``FINISH``
writes the final record, publishes the terminal event and acks+deletes its entry, atomically.
Both carry this worker's name: a request another worker has taken over is reported ``lost`` and
nothing is written for it.
The same pipeline asks ``SMISMEMBER`` which running requests have a cancellation pending.

``send`` writes the round trip and returns at once (a :class:`PendingPublish`); its ``result()``
reads the replies later. The service's loop sends a step's publish the moment the step ends, on
its own thread (no hand-off to another thread: clients get the tokens as soon as Redis runs the
pipeline), and reads the replies after the next step, by when they have long arrived.

The publisher holds no request state and changes nothing it is given: it takes the events to
append (each batch tagged with whatever its caller wants back, the service's ``Job``), the
finishes (terminal event, entry, whole text) and the ids to check, and its result says what took
effect; the caller applies that to its own state.

Redis outages: a round trip whose connection fails (written or not, executed or not: the worker
cannot tell) is *run again* by ``result()`` on a fresh connection, until it gets its replies (the
worker's loop calls it again once Redis answers; see ``service/outage.py``). Running it again is
safe because every part of it is idempotent for the same worker: ``APPEND_TOKENS`` writes a
request's events only if its list ends at their first index, and answers ``ok`` without writing
when the list already ends with exactly these events (an earlier try ran); any other length is
``corrupt`` (the worker ends the request error / corrupt_state); ``FINISH`` answers ``already``
for a request it ended before; the cancel check only reads. A KV-pool step is not run again (the
pool link forgets it and plans the next one from the engine's state).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalEvent, TokenEvent
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args
from tokenfleet.shared.scripts.worker import APPEND_TOKENS, append_tokens_keys_args
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.pipelined import ScriptPipeline, dedicated_connection
from tokenfleet.worker.pool.link import PoolCall

_OK = (b"ok", "ok")  # a per-request reply's code, nested in APPEND_TOKENS's (not decoded)
_CORRUPT = (b"corrupt", "corrupt")
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)  # the connection, not the command

T = TypeVar("T")  # the caller's tag of a batch of token events, handed back when it took effect


@dataclass(slots=True)
class Finish:
    """A request to finish: its terminal event (``num_tokens`` already set) and what ``FINISH``
    writes besides."""

    event: TerminalEvent
    priority: Priority  # the level of the stream its entry is in
    entry_id: str  # its stream entry, acked and deleted when the finish takes effect
    text: str  # its whole output text, tokens appended in the same round trip included
    stream: str = ""  # the stream its entry is in ("": its level's shared stream)
    tenant: str = ""  # the tenant whose queue admitted it ("": none; docs/fairness.md)
    prompt_tokens: int = 0  # its prompt's tokens (what it is counted as served with its output)


@dataclass(slots=True)
class StepResult(Generic[T]):
    """What the round trip reported back."""

    appended: list[tuple[T, Sequence[TokenEvent]]] = field(default_factory=list)  # now in lists
    lost: set[str] = field(default_factory=set)  # ids another worker holds now: drop locally
    # id -> cause, for requests whose state is poisoned (record gone, token list not where this
    # worker left it): nothing was written; the caller ends them error / corrupt_state
    corrupt: dict[str, str] = field(default_factory=dict)
    cancel_requested: list[str] = field(default_factory=list)  # running ids to abort
    finished: list[Finish] = field(default_factory=list)  # finishes that took effect
    # what did not take effect for the lost and corrupt ids: their events and finishes, by id
    # (the outbox hands them to the repair: service/repair.py)
    refused: dict[str, tuple[T, Sequence[TokenEvent]]] = field(default_factory=dict)
    refused_finishes: dict[str, Finish] = field(default_factory=dict)
    pool_reply: Any = None  # the KV-pool step's reply (PoolLink.after_execute); None without one


class PendingPublish(Generic[T]):
    """A publish written to Redis whose replies have not been read yet.

    Invariant: ``result()`` reads the replies once; later calls return the same
    :class:`StepResult` (or raise ``RuntimeError`` if reading them failed).
    """

    def __init__(
        self,
        pipe: ScriptPipeline | None,
        tokens: Sequence[tuple[T, Sequence[TokenEvent]]],
        finishes: Sequence[Finish],
        check_cancel: Sequence[str],
        with_pool: bool,
        publisher: Publisher | None = None,
    ) -> None:
        self._pipe = pipe
        self._tokens = tokens
        self._finishes = finishes
        self._check_cancel = check_cancel
        self._with_pool = with_pool
        self._publisher = publisher  # runs it again after a lost connection (module doc)
        self._result: StepResult[T] | None = None if pipe is not None else StepResult()
        self.attempts = 1  # round trips sent for it (more after a lost connection)

    @property
    def received(self) -> bool:
        """Whether the replies have been read (by ``result()``, or by the next ``send``)."""
        return self._result is not None

    def result(self) -> StepResult[T]:
        """Read the replies (waiting for them if need be) and say what took effect. If the
        connection failed, send the same round trip again first (module doc); a Redis error
        leaves it to be run again by the next call."""
        if self._result is None:
            pipe, self._pipe = self._pipe, None
            if pipe is None:
                if self._publisher is None:
                    raise RuntimeError("this publish failed before its replies were read")
                self._with_pool = False  # the pool link forgot that call (Outbox)
                self.attempts += 1
                pipe = self._publisher.build(self._tokens, self._finishes, self._check_cancel, None)
                pipe.send()
            self._result = self._read(pipe.receive())
        return self._result

    def lost_connection(self) -> None:
        """Its round trip could not be written: :meth:`result` sends it again."""
        self._pipe = None

    def _read(self, replies: list[Any]) -> StepResult[T]:
        result: StepResult[T] = StepResult(pool_reply=replies[-1] if self._with_pool else None)
        i = 0
        if self._tokens:  # one APPEND_TOKENS reply: "ok", then one reply per request
            per_request = replies[0][1:]
            i = 1
            appended = result.appended
            for batch, reply in zip(self._tokens, per_request, strict=True):
                if reply[0] in _OK:  # (or appended by an earlier try of this round trip)
                    appended.append(batch)
                elif reply[0] in _CORRUPT:
                    cause = reply[1]
                    text = cause.decode("utf-8", "replace") if isinstance(cause, bytes) else cause
                    result.corrupt[batch[1][0].request_id] = str(text)
                    result.refused[batch[1][0].request_id] = batch
                else:
                    result.lost.add(batch[1][0].request_id)
                    result.refused[batch[1][0].request_id] = batch
        for fin in self._finishes:
            code = replies[i][0]
            i += 1
            rid = fin.event.request_id
            if code != "lost" and rid not in result.lost and rid not in result.corrupt:
                result.finished.append(fin)
            else:
                result.lost.add(rid)
                result.refused_finishes[rid] = fin
        if self._check_cancel:
            flags = replies[i]
            result.cancel_requested = [
                rid for rid, flag in zip(self._check_cancel, flags, strict=True) if flag
            ]
        return result


class Publisher:
    """Builds and runs the per-step pipeline for one worker. Holds no request state.

    Invariant: its round trips run on one connection of its own (no pool checkout per step), at
    most one in flight: :meth:`send` first reads the replies of the one still in flight (its
    ``result()`` keeps them for whoever asks later).
    """

    def __init__(
        self, client: redis.Redis, settings: Settings, *, model_name: str, worker_name: str
    ) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.model_name = model_name
        self.worker_name = worker_name
        self._conn: Any = None
        self._in_flight: PendingPublish[Any] | None = None

    def close(self) -> None:
        """Drop the connection (after the last result was read)."""
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None

    def publish(
        self,
        tokens: Sequence[tuple[T, Sequence[TokenEvent]]],
        finishes: Sequence[Finish],
        check_cancel: Sequence[str] = (),
        pool_call: PoolCall | None = None,
    ) -> StepResult[T]:
        """:meth:`send`, then wait for its result."""
        return self.send(tokens, finishes, check_cancel, pool_call).result()

    def send(
        self,
        tokens: Sequence[tuple[T, Sequence[TokenEvent]]],
        finishes: Sequence[Finish],
        check_cancel: Sequence[str] = (),
        pool_call: PoolCall | None = None,
    ) -> PendingPublish[T]:
        """Write one pipelined round trip: tokens, then finishes, then the cancel check.

        ``tokens`` pairs a tag (the caller's, handed back in ``StepResult.appended``) with one
        request's new events, whose indices are consecutive (the script refuses them unless the
        list ends where they start). A request's publishes must be sent and read in step order,
        one at a time: the caller applies a result before it sends the request's next events,
        and a finish carries the whole text, this round trip's tokens included.
        """
        if not tokens and not finishes and not check_cancel and pool_call is None:
            return PendingPublish(None, (), (), (), False)
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            previous.result()  # its replies come first on the connection
        pipe = self.build(tokens, finishes, check_cancel, pool_call)
        pending = PendingPublish(
            pipe, tokens, finishes, check_cancel, pool_call is not None, publisher=self
        )
        self._in_flight = pending
        try:
            pipe.send()
        except REDIS_DOWN:  # result() sends it again, and raises if Redis is still away
            pending.lost_connection()
        return pending

    def build(
        self,
        tokens: Sequence[tuple[T, Sequence[TokenEvent]]],
        finishes: Sequence[Finish],
        check_cancel: Sequence[str],
        pool_call: PoolCall | None,
    ) -> ScriptPipeline:
        """The pipeline of :meth:`send`, on this publisher's connection, not sent yet."""
        if self._conn is None:
            self._conn = dedicated_connection(self.client)
        now = time.time()
        ttl = self.settings.record_ttl_s
        pipe = ScriptPipeline(self.client, self._conn)
        if tokens:
            k, a = append_tokens_keys_args(
                self.keys,
                self.worker_name,
                now,
                ttl,
                [
                    (events[0].request_id, events[0].index, [e.encode() for e in events])
                    for _, events in tokens
                ],
            )
            pipe.script(APPEND_TOKENS, k, a)
        for fin in finishes:
            fk, fa = finish_keys_args(
                self.keys,
                fin.event,
                model=self.model_name,
                priority=fin.priority,
                now=now,
                ttl_s=ttl,
                stream_id=fin.entry_id,
                extra_fields={"text": fin.text},
                owner=self.worker_name,
                stream=fin.stream or None,
                tenant=fin.tenant,
                prompt_tokens=fin.prompt_tokens,
            )
            pipe.script(FINISH, fk, fa)
        if check_cancel:
            pipe.command("SMISMEMBER", self.keys.cancel_set, *check_cancel)
        if pool_call is not None:
            pool_call.queue(pipe)  # last: its reply is replies[-1]
        return pipe
