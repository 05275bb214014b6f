"""Reading the priority streams: consumer groups, the read order, ``PULL`` and blocking reads.

``PriorityStreams.pull(budget)`` reads at most ``budget`` entries with the ``PULL`` script
(``XREADGROUP``, one consumer group per queue, this worker's name as the consumer), most urgent
stream first, with one anti-starvation rule: a level skipped (because more urgent levels used the
budget) for ``starvation_pulls`` consecutive pulls is read first on the next pull. A blocking
read (``XREADGROUP COUNT 1 BLOCK``) on every stream answers at the first arrival. ``caps`` limits
what the next reads take from a level (the worker keeps its last free slots for levels more
urgent than ``batch``: ``Feeder.read_budget``); a level capped at 0 is left out of blocking reads
too. Replies are parsed into :class:`Entry` objects; a stream or group deleted under the worker
(NOGROUP, or the UNBLOCKED a blocked read gets) recreates the groups instead of failing.

Routing (docs/routing.md): each level has two streams, this worker's routed one
(``Keys.routed``) and the shared one; every read takes the routed one first, and the two share
the level's cap (``PULL``'s level groups). Entries of other workers' routed streams come in
only through stealing (``tokenfleet.worker.intake.stealer``), which notes their streams here
(:meth:`PriorityStreams.note_stream`) so that they parse like any other.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.enqueue import expiry_args
from tokenfleet.shared.scripts.worker import PULL
from tokenfleet.worker.intake.jobs import Entry
from tokenfleet.worker.pipelined import ScriptPipeline


class PriorityStreams:
    """Reads entries of one served model's priority streams on behalf of one worker.

    Invariants: ``_skipped[p]`` counts consecutive pulls in which level ``p`` was not read; it is
    reset whenever ``p`` is read, left as it is while ``p`` is capped at 0 (held back on purpose,
    not starved), and a level with ``_skipped[p] >= starvation_pulls`` is read before all others.
    ``caps[p]``, where set, is lowered by every entry of level ``p`` read, never below 0.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        model_name: str,
        priorities: Sequence[Priority],
        worker_name: str,
        starvation_pulls: int,
        record_ttl_s: int = 86_400,
    ) -> None:
        self.client = client
        self.keys = keys
        self.model_name = model_name
        self.priorities = tuple(sorted(priorities))
        self.worker_name = worker_name
        self.starvation_pulls = starvation_pulls
        self.stream_of = {p: keys.stream(model_name, p) for p in self.priorities}
        self.routed_of = {p: keys.routed(model_name, p, worker_name) for p in self.priorities}
        self.priority_of = {s: p for p, s in self.stream_of.items()}
        self.priority_of.update({s: p for p, s in self.routed_of.items()})
        # fair admission between tenants (docs/fairness.md): what PULL admits from
        self.tenant_queue_of = {p: keys.tenant_queue(model_name, p, "") for p in self.priorities}
        self.active_of = {p: keys.tenants_active(model_name, p) for p in self.priorities}
        self.backlog_of = {p: keys.tenant_backlog(model_name, p) for p in self.priorities}
        self.book = keys.tenant_book(model_name)
        # a routed stream's name before its worker's (what PULL's admission routes into)
        self._routed_before = {p: keys.routed(model_name, p, "") for p in self.priorities}
        before, _, after = keys.record("\0").partition("\0")
        self.record_template = (before, after)
        # what PULL needs to end a request it meets past its deadline at admission
        self.record_ttl_s = record_ttl_s
        self._expiry_args = expiry_args(keys)
        self._skipped = dict.fromkeys(self.priorities, 0)
        self.caps: dict[Priority, int] = {}  # level -> entries the next reads may take at most

    def ensure_groups(self) -> None:
        """Create each stream's consumer group at id 0 (MKSTREAM), routed ones included; an
        existing group is fine."""
        for stream in [*self.stream_of.values(), *self.routed_of.values()]:
            try:
                self.client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        pipe = self.client.pipeline(transaction=False)
        for p in self.priorities:
            pipe.sadd(self.keys.queues, Keys.queue_member(self.model_name, p))
        pipe.execute()

    def own(self, p: Priority) -> tuple[str, str]:
        """The streams this worker reads for level ``p``: its routed one, then the shared one."""
        return (self.routed_of[p], self.stream_of[p])

    def note_stream(self, stream: str, p: Priority) -> None:
        """Entries of ``stream`` (another worker's routed stream of level ``p``) may be parsed."""
        self.priority_of[stream] = p

    def order(self) -> list[Priority]:
        """The order of the next pull: starved levels (most skipped first), then by urgency."""
        starved = [p for p in self.priorities if self._skipped[p] >= self.starvation_pulls]
        starved.sort(key=lambda p: (-self._skipped[p], p))
        return starved + [p for p in self.priorities if p not in starved]

    def pull(self, budget: int) -> list[Entry]:
        """Read up to ``budget`` new entries without blocking, in :meth:`order` (one round
        trip: the ``PULL`` script)."""
        return self.send_read(budget).receive() if budget > 0 else []

    def send_read(
        self, budget: int, *, block_ms: int | None = None, connection: Any = None
    ) -> PendingRead:
        """Send a read without waiting for it: the ``PULL`` script for up to ``budget`` entries
        (``block_ms`` None), else ``XREADGROUP COUNT 1 BLOCK block_ms`` on every stream, which
        answers at the first arrival with one entry per stream that has one. ``connection``:
        see ``ScriptPipeline``."""
        pipe = ScriptPipeline(self.client, connection)
        order: list[Priority] | None = None
        left_out: frozenset[Priority] = frozenset()
        if block_ms is None:
            order = self.queue_pull(pipe, budget)
        else:
            left_out = frozenset(p for p in self.priorities if self.caps.get(p) == 0)
            if left_out == frozenset(self.priorities):  # (caps never close every level)
                left_out = frozenset()
            streams = [s for p in self.priorities if p not in left_out for s in self.own(p)]
            pipe.command(
                "XREADGROUP",
                "GROUP",
                CONSUMER_GROUP,
                self.worker_name,
                "COUNT",
                1,
                "BLOCK",
                block_ms,
                "STREAMS",
                *streams,
                *([">"] * len(streams)),
                raise_errors=False,
            )
        pipe.send()
        return PendingRead(self, pipe, order, left_out)

    def queue_pull(self, pipe: ScriptPipeline, budget: int) -> list[Priority]:
        """Queue the ``PULL`` script for up to ``budget`` entries, in :meth:`order`, into
        ``pipe``; returns that order, which :meth:`parse_pull` needs (empty, and nothing queued,
        when no level is served)."""
        order = self.order()
        if order:
            keys = [s for p in order for s in self.own(p)]
            caps = [self.caps.get(p, -1) for p in order for _ in (0, 1)]
            levels = [p.label for p in order for _ in (0, 1)]
            args: list[str | bytes | int] = [
                CONSUMER_GROUP,
                self.worker_name,
                budget,
                len(keys),
                *caps,
                *levels,
                *self.record_template,
            ]
            for p in order:  # (routed: no tenant queues; shared: its tenant queues' name)
                args += ["", self.tenant_queue_of[p]]
            keys += [k for p in order for k in (self.active_of[p], self.backlog_of[p])]
            keys += [self.book, self.keys.cancel_set, self.keys.tally]
            keys += [self.keys.routers(self.model_name), self.keys.route_load(self.model_name)]
            args += self.expiry_args()
            for p in order:  # (shared: where its admitted requests may be routed)
                args += ["", self._routed_before[p]]
            pipe.script(PULL, keys, args, raise_errors=False)  # NOGROUP: see parse_pull
        return order

    def expiry_args(self) -> list[str | int | bytes]:
        """What ``PULL`` (and an overflow worker's ``OVERFLOW``) needs to end a request it meets
        past its deadline at admission: now, the record TTL, the publish command, then
        ``enqueue.expiry_args``."""
        return [repr(time.time()), self.record_ttl_s, self.keys.publish_command, *self._expiry_args]

    def parse_pull(self, order: Sequence[Priority], reply: Any) -> list[Entry]:
        """Entries of a ``PULL`` reply; updates the anti-starvation counts. A reply that is a
        NOGROUP error (a stream deleted under us) recreates the groups and yields nothing."""
        if self.lost_groups(reply):
            return []
        values = registry.check_reply(PULL, reply)
        streams_read = int(values[1])  # two streams per level: routed, shared
        for i, p in enumerate(order):
            if self.caps.get(p) == 0:
                continue  # held back, not starved
            if 2 * i < streams_read:
                self._skipped[p] = 0
            else:
                self._skipped[p] += 1
        if int(values[2]):  # a stream or group was gone: recreate them
            self.ensure_groups()
        return self.entries(values[3:])

    def lost_groups(self, reply: Any) -> bool:
        """True if ``reply`` says a stream or its group is gone (NOGROUP; or UNBLOCKED, what
        a blocked XREADGROUP gets when its stream is deleted, e.g. by FLUSHALL): the groups
        are recreated. Any other error reply is raised."""
        if not isinstance(reply, Exception):
            return False
        message = str(reply)
        if "NOGROUP" not in message and not message.startswith("UNBLOCKED"):
            raise reply
        self.ensure_groups()
        return True

    def entries(self, reply: Any) -> list[Entry]:
        """Parse an XREADGROUP or ``PULL`` reply (a list of ``[stream, messages]``) into entries."""
        if not reply:
            return []
        items = reply.items() if isinstance(reply, dict) else reply
        out: list[Entry] = []
        caps = self.caps
        for stream_raw, messages in items:
            stream = as_str(stream_raw) or ""
            for entry_id, fields in messages:
                entry = self.make_entry(stream, entry_id, fields)
                if entry.priority in caps:
                    caps[entry.priority] = max(0, caps[entry.priority] - 1)
                out.append(entry)
        return out

    def make_entry(self, stream: str, entry_id: Any, fields: Any) -> Entry:
        """An :class:`Entry` from one stream message (``fields`` None for a deleted one)."""
        if isinstance(fields, list):  # a script's reply: flat field, value pairs
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        raw = {as_str(k) or "": v for k, v in (fields or {}).items()}
        return Entry(stream, self.priority_of[stream], as_str(entry_id) or "", raw)


class PendingRead:
    """A read sent by :meth:`PriorityStreams.send_read`, its reply not read yet."""

    def __init__(
        self,
        streams: PriorityStreams,
        pipe: ScriptPipeline,
        order: list[Priority] | None,
        left_out: frozenset[Priority] = frozenset(),
    ) -> None:
        self._streams = streams
        self._pipe = pipe
        self._order = order
        self._left_out = left_out  # levels a blocking read does not watch (capped at 0 then)
        self.blocking = order is None  # an XREADGROUP ... BLOCK, not a PULL
        self.kind = "block" if order is None else "pull"  # (blocking is cleared on unblock)

    def narrowed(self) -> bool:
        """A blocking read that leaves out a level the caps now let be read."""
        caps = self._streams.caps
        return any(caps.get(p) != 0 for p in self._left_out)

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the reply has arrived (waiting up to ``timeout_s`` for it)."""
        return self._pipe.ready(timeout_s)

    def receive(self) -> list[Entry]:
        """The entries read (waits for the reply if need be); they are now this worker's."""
        (reply,) = self._pipe.receive()
        if self._order is not None:
            return self._streams.parse_pull(self._order, reply)
        return [] if self._streams.lost_groups(reply) else self._streams.entries(reply)
