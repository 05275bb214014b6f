"""Stealing: an idle worker takes routed work that has waited too long for its target worker.

Routing (docs/routing.md) puts a request in one worker's routed stream; nothing may wait on a
busy worker while another idles. So a worker with room left after its own reads runs the
``STEAL`` script every ``steal_interval_s``: for the other workers' routed streams of its model
(``Keys.routers`` lists every worker that took routed work, live or lapsed: a dead worker's
undelivered entries age and are stolen like a busy one's), the undelivered entries older than
``steal_after_ms`` (stream id time against Redis's ``TIME``) are read under this worker's name in
the same consumer group. A stolen entry is then an ordinary pending entry of this worker:
started, acked, claimed if it dies, handed back (to the shared stream) like any other. Its
``START`` notes the steal in the record's ``taken`` (``route`` and ``routed_to`` keep where it was
routed and why) and pins the request's session, if it has one, to this worker: the turn's
history is here now, so the session's next turn should come here (``Starter.session_to_repin``).

Overflow pool (``--overflow-for``): the ``OVERFLOW`` script over the model's shared streams as
well, with the overflow threshold as the age (counted from the request's enqueue): such a worker
takes only work that has waited that long (``overflow=True``), and reads nothing else. Where
tenants wait (docs/fairness.md), the same call admits requests whose tenant queue's head has
waited that long, the least virtual time first, and takes them.

The bound adapts to the target worker's pace: a worker reads new work at the end of every engine
step, so a routed entry that arrives mid-step waits for that step whatever the target's room. A
stealer therefore waits ``max(steal_after_ms, STEAL_AFTER_STEPS x the target's longest recent
step)``, at most ``STEP_BOUND_CAP x steal_after_ms`` (its heartbeat publishes that step in
``P:rload:MODEL``): on a GPU (steps of tens of ms)
the setting rules; on a CPU whose prefill steps take a second, a turn is not taken from the
worker that holds its history (and re-prefilled cold) only because that worker was mid-step.

Invariant: only entries whose stream id is at least ``steal_after_ms`` old by Redis's clock are
taken, and only undelivered ones (never another worker's pending entry).
"""

from __future__ import annotations

import time

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.worker import OVERFLOW, STEAL
from tokenfleet.worker.intake.jobs import Entry
from tokenfleet.worker.intake.streams import PriorityStreams

TARGETS_TTL_S = 1.0  # how long the list of routed workers is reused before it is read again
STEAL_INTERVAL_S = 0.1  # how often a worker with room looks for aged routed work
STEAL_AFTER_STEPS = 2  # a target with room reads an arrival within one step: two is a miss
STEP_BOUND_CAP = 10  # the step-based bound is at most this many times steal_after_ms


def step_ms_of(load: bytes | str | None) -> int:
    """The longest recent step (ms) in a ``P:rload`` value ``"RUNNING MAX_NUM_SEQS STEP_MS"``
    (0 when absent: a worker of an older version, or none reported)."""
    parts = (as_str(load) or "").split()
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0


def route_kind(entry: Entry, streams: PriorityStreams) -> str:
    """How a started entry came (the ``requests_routed`` metric): ``steal``, ``overflow``,
    ``hit`` (this worker's routed stream) or ``miss`` (the shared stream, or claimed)."""
    kind = entry.route.partition(":")[0]
    if kind in ("stolen_by", "overflow"):
        return "steal" if kind == "stolen_by" else "overflow"
    return "hit" if entry.stream == streams.routed_of[entry.priority] else "miss"


class Stealer:
    """Takes aged routed (or, for an overflow worker, any) entries of one model's queues."""

    def __init__(
        self,
        client: redis.Redis,
        streams: PriorityStreams,
        *,
        steal_after_ms: int,
        overflow: bool = False,
    ) -> None:
        self.client = client
        self.streams = streams
        self.keys = streams.keys
        self.steal_after_ms = max(0, steal_after_ms)
        self.overflow = overflow
        self._workers: list[str] = []
        self._step_ms: dict[str, int] = {}  # worker -> its longest recent step (P:rload)
        self._read_at = -TARGETS_TTL_S
        self.next_at = 0.0  # monotonic time of the next steal round (the feeder's timer)

    def workers(self) -> list[str]:
        """Names in the model's routers set, and their step times (cached for
        ``TARGETS_TTL_S``)."""
        now = time.monotonic()
        if now - self._read_at >= TARGETS_TTL_S:
            model = self.streams.model_name
            pipe = self.client.pipeline(transaction=False)
            pipe.zrange(self.keys.routers(model), 0, -1)
            pipe.hgetall(self.keys.route_load(model))
            members, loads = pipe.execute()
            self._workers = sorted(as_str(m) or "" for m in members)
            self._step_ms = {as_str(w) or "": step_ms_of(v) for w, v in loads.items()}
            self._read_at = now
        return self._workers

    def min_age_ms(self, worker: str | None) -> int:
        """How long an undelivered entry of ``worker``'s routed stream waits before it is
        taken (``worker`` None: a shared stream, for an overflow worker)."""
        if worker is None:
            return self.steal_after_ms
        paced = STEAL_AFTER_STEPS * self._step_ms.get(worker, 0)
        return max(self.steal_after_ms, min(paced, STEP_BOUND_CAP * self.steal_after_ms))

    def targets(self) -> list[tuple[str, Priority, int]]:
        """(stream, level, minimum age in ms) to take from, most urgent level first: other
        workers' routed streams; an overflow worker's also the shared streams, before the
        routed ones."""
        s = self.streams
        me = s.worker_name
        others = [w for w in self.workers() if w and w != me]
        out: list[tuple[str, Priority, int]] = []
        for p in s.priorities:
            if self.overflow:
                out.append((s.stream_of[p], p, self.min_age_ms(None)))
            out += [(self.keys.routed(s.model_name, p, w), p, self.min_age_ms(w)) for w in others]
        return out

    def steal(self, budget: int) -> list[Entry]:
        """Take up to ``budget`` aged entries (one round trip); they are this worker's now."""
        targets = self.targets() if budget > 0 else []
        if not targets:
            return []
        caps = self.streams.caps
        for stream, p, _ in targets:
            self.streams.note_stream(stream, p)
        args: list[str | int | bytes] = [CONSUMER_GROUP, self.streams.worker_name, budget]
        args.append(self.steal_after_ms)
        if self.overflow:
            args.append(len(targets))
        args += [caps.get(p, -1) for _, p, _ in targets]
        args += [p.label for _, p, _ in targets]
        args += [age for _, _, age in targets]
        keys = [s for s, _, _ in targets]
        if self.overflow:  # (tenant queues: admitted when their head waited that long)
            s = self.streams
            shared = [p for stream, p, _ in targets if stream == s.stream_of[p]]
            args += [
                s.tenant_queue_of[p] if stream == s.stream_of[p] else "" for stream, p, _ in targets
            ]
            args += [*s.record_template, *s.expiry_args()]
            keys += [k for p in shared for k in (s.active_of[p], s.backlog_of[p])]
            keys += [s.book, self.keys.cancel_set, self.keys.tally]
        script = OVERFLOW if self.overflow else STEAL
        reply = registry.call(self.client, script, keys, args)
        entries = self.streams.entries(reply[1:])
        note = f"{'overflow' if self.overflow else 'stolen_by'}:{self.streams.worker_name}"
        for entry in entries:
            entry.route = note
        return entries
