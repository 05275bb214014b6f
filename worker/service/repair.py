"""Putting back what a Redis rollback took: the worker knows every token it published.

Redis replication is asynchronous: a failover (Sentinel, Cluster) loses what the old primary
took after its replica was promoted, and a Redis restarted from an older snapshot or AOF loses
what came after it. Without a repair, a request in the middle of its run finds its token list
shorter than the worker left it (``APPEND_TOKENS`` answers ``corrupt``), its record gone or
``queued`` again (``lost``), and a request it ended finds its end undone.

The worker generated every token of the requests it runs, and it keeps, for each request it ended
within ``repair_window_s`` (``FinishedLedger``), its events and its end. So after every reconnect
(``service/outage.py``'s restore, before any publish is sent again) and whenever a publish
answers ``lost`` or ``corrupt`` (a Cluster failover can come without a lost connection),
:class:`Repairer` checks each such request against Redis in one round trip (record fields and
list length) and runs ``REPAIR`` (shared/scripts/worker_repair.lua: atomic, idempotent) for those
that need it: the missing tail of the token list is appended again with the same indices and
texts and published (live subscribers fill their gap; readers drop indices they have), a record
gone or rolled back is written again (running under this worker, its entry re-added if gone), an
end that was lost is written and published again, and an entry that reappeared or a producer's
resubmission is acked and deleted. A request another worker took over and carried as far or
further is left to it (``yield``: dropped here, as a ``lost`` publish always was); only a list
holding events this worker did not publish ends the request ``error`` / ``corrupt_state``, naming
why (``divergent``). Each outcome is logged and counted (``tokenfleet:request_repairs``,
``tokenfleet:repaired_tokens``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson
import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.scripts.worker import REPAIR, RepairCall, repair_keys_args
from tokenfleet.worker.intake.jobs import Job
from tokenfleet.worker.pipelined import ScriptPipeline
from tokenfleet.worker.publish.publisher import Finish
from tokenfleet.worker.service.metrics import WorkerMetrics

log = logging.getLogger(__name__)

RETRIES = 3  # rounds of read-then-repair when a list changed between the two
FINISHED_MAX = 100_000  # finished requests kept at most, whatever the window (a memory bound)


@dataclass(slots=True)
class Target:
    """One request to check: its job (events ``0 .. len(events) - 1`` published by this worker)
    and, once it ended here, its finish."""

    job: Job
    events: Sequence[bytes]
    finish: Finish | None = None
    refused: bool = False  # a publish of it was refused: compare in the script, whatever the
    # length (a list as long as this worker's can still hold another's event)

    @property
    def request_id(self) -> str:
        return self.job.request_id


@dataclass(slots=True)
class Outcome:
    """What a check found and did. ``kind``: ``intact`` (nothing to do), ``repaired``, ``yield``
    (another worker has it, or it ended otherwise: drop it here) or ``divergent`` (``why``)."""

    kind: str
    why: str = ""
    pushed: int = 0  # token events appended (and published) again
    rewrote: bool = False  # the record was written again
    ended: bool = False  # the end was written (and published) again
    dropped: int = 0  # stream entries acked and deleted (reappeared, or resubmitted)
    new_entry: str = ""  # a running request's entry, re-added: its job takes this id


class FinishedLedger:
    """The requests this worker ended within the last ``window_s`` seconds, with their events
    and ends: what it can write again if a rollback undoes them.

    Invariant: entries are in the order they ended, none older than ``window_s`` after
    :meth:`expire`, at most ``FINISHED_MAX`` of them; ``window_s`` 0 keeps nothing.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._ended: OrderedDict[str, tuple[float, Target]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ended)

    def add(self, job: Job, finish: Finish) -> None:
        """``job`` ended with ``finish`` (took effect in Redis)."""
        if self.window_s <= 0:
            return
        rid = job.request_id
        self._ended.pop(rid, None)
        job.text_parts = []  # (the finish holds the whole text; the events are what is kept)
        self._ended[rid] = (self.clock(), Target(job, job.events, finish))
        while len(self._ended) > FINISHED_MAX:
            self._ended.popitem(last=False)

    def expire(self) -> None:
        """Forget what ended more than ``window_s`` ago."""
        horizon = self.clock() - self.window_s
        while self._ended:
            at, _ = next(iter(self._ended.values()))
            if at >= horizon:
                break
            self._ended.popitem(last=False)

    def targets(self) -> list[Target]:
        """Every request kept, oldest end first (after :meth:`expire`)."""
        self.expire()
        return [target for _, target in self._ended.values()]

    def forget(self, request_id: str) -> None:
        self._ended.pop(request_id, None)


class Repairer:
    """Checks requests against Redis and puts back what a rollback took (module docstring).

    Holds no request state: it is given targets and says, per request id, what it found and
    did; the caller applies that to its jobs. Its round trips run on ``client``'s pool.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        worker_name: str,
        ttl_s: int,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.worker_name = worker_name
        self.ttl_s = ttl_s
        self.metrics = metrics
        self.checks = 0  # requests checked so far (tests and the benchmark read these)
        self.repaired = 0
        self.tokens_pushed = 0

    def check(self, targets: Sequence[Target]) -> dict[str, Outcome]:
        """Check each target, repairing where needed; one round trip to read, one to repair
        (more only when a list changed in between). Redis errors propagate (an outage)."""
        outcomes: dict[str, Outcome] = {}
        pending = list(targets)
        for _ in range(RETRIES):
            if not pending:
                break
            states = self._read(pending)
            calls: list[tuple[Target, RepairCall]] = []
            for target, state in zip(pending, states, strict=True):
                call = self._call_for(target, state)
                if call is None:
                    outcomes[target.request_id] = Outcome("intact")
                else:
                    calls.append((target, call))
            pending = []
            if not calls:
                break
            pipe = ScriptPipeline(self.client)
            now = time.time()
            for _, call in calls:
                pipe.script(
                    REPAIR, *repair_keys_args(self.keys, self.worker_name, now, self.ttl_s, call)
                )
            for (target, _), reply in zip(calls, pipe.execute(), strict=True):
                outcome = _outcome(reply)
                if outcome is None:
                    pending.append(target)  # "retry": read it again
                else:
                    outcomes[target.request_id] = outcome
        for target in pending:  # (a list that keeps changing under us: leave it be)
            outcomes[target.request_id] = Outcome("yield", "its token list kept changing")
        self._report(targets, outcomes)
        return outcomes

    # -- internals ------------------------------------------------------------------------------
    def _read(self, targets: Sequence[Target]) -> list[tuple[list[str | None], int]]:
        pipe = ScriptPipeline(self.client)
        keys = self.keys
        for target in targets:
            rid = target.request_id
            pipe.command("HMGET", keys.record(rid), "status", "worker", "stream_id", "routed_to")
            pipe.command("LLEN", keys.tokens(rid))
        replies = pipe.execute()
        return [
            ([as_str(v) for v in replies[2 * i]], int(replies[2 * i + 1]))
            for i in range(len(targets))
        ]

    def _call_for(self, target: Target, state: tuple[list[str | None], int]) -> RepairCall | None:
        """The ``REPAIR`` call ``target`` needs, or None when Redis holds all of it."""
        (status, holder, stream_id, routed_to), length = state
        job, fin, n = target.job, target.finish, len(target.events)
        entry = job.entry
        if (
            not target.refused
            and length >= n
            and (
                (fin is not None and status == fin.event.status.value)
                or (
                    fin is None
                    and (status, holder, stream_id) == ("running", self.worker_name, entry.entry_id)
                )
            )
        ):
            return None
        req = job.request
        stream = entry.stream or self.keys.stream(req.model, entry.priority)
        other_stream = other_entry = ""
        if stream_id and stream_id != entry.entry_id:
            other_entry = stream_id
            other_stream = (
                self.keys.routed(req.model, entry.priority, routed_to)
                if routed_to
                else self.keys.stream(req.model, entry.priority)
            )
        record_fields = {
            "model": req.model,
            "priority": entry.priority.label,
            "stream_id": entry.entry_id,
            "enqueued_at": repr(req.enqueued_at),
            "started_at": repr(job.started_at),
            "ran_on": self.worker_name,
            "attempts": str(job.attempts),
        }
        payload = entry.fields.get("d") or req.encode()
        call = RepairCall(
            request_id=job.request_id,
            stream=stream,
            entry_id=entry.entry_id,
            attempts=job.attempts,
            events=target.events,
            from_index=max(0, min(length, n) - 1),
            record_fields=record_fields,
            entry_fields={"id": job.request_id, "d": payload, "dl": "", "h": "1"},
            other_stream=other_stream,
            other_entry=other_entry,
        )
        if fin is not None:
            ev = fin.event
            call.status = ev.status.value
            call.event = ev.encode()
            call.end_fields = {
                "finish_reason": ev.finish_reason or "",
                "code": ev.code or "",
                "message": ev.message or "",
                "usage": orjson.dumps(ev.usage).decode(),
                "timings": orjson.dumps(ev.timings).decode(),
                "text": fin.text,
            }
        return call

    def _report(self, targets: Sequence[Target], outcomes: dict[str, Outcome]) -> None:
        for target in targets:
            rid = target.request_id
            out = outcomes[rid]
            self.checks += 1
            if out.kind == "intact":
                continue
            if out.kind == "repaired":
                self.repaired += 1
                self.tokens_pushed += out.pushed
                log.warning(
                    "worker %s: repaired %s after a Redis rollback: %d tokens put back%s%s%s",
                    self.worker_name,
                    rid,
                    out.pushed,
                    ", record rewritten" if out.rewrote else "",
                    ", end written again" if out.ended else "",
                    f", {out.dropped} stale entries dropped" if out.dropped else "",
                )
            else:
                log.warning(
                    "worker %s: %s not repaired (%s): %s", self.worker_name, rid, out.kind, out.why
                )
            if self.metrics is not None:
                self.metrics.observe_repair(out.kind, out.pushed)


def _outcome(reply: list[object]) -> Outcome | None:
    """The script's reply as an :class:`Outcome`; None for ``retry``."""
    code = reply[0]
    if code == "retry":
        return None
    if code in ("yield", "divergent"):
        return Outcome(str(code), str(as_str(reply[1])))  # type: ignore[arg-type]
    pushed, rewrote, ended, dropped, new_entry = reply[1:6]
    outcome = Outcome(
        "repaired",
        pushed=int(pushed),  # type: ignore[call-overload]
        rewrote=bool(int(rewrote)),  # type: ignore[call-overload]
        ended=bool(int(ended)),  # type: ignore[call-overload]
        dropped=int(dropped),  # type: ignore[call-overload]
        new_entry=str(as_str(new_entry) or ""),  # type: ignore[arg-type]
    )
    if not (outcome.pushed or outcome.rewrote or outcome.ended or outcome.dropped):
        outcome.kind = "intact"
    return outcome
