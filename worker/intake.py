"""Intake: read entries from the priority streams, decode them, and start them in Redis.

``Intake.pull(budget)`` reads at most ``budget`` entries with ``XREADGROUP`` (one consumer group
per queue, this worker's name as the consumer), most urgent stream first, with one
anti-starvation rule: a level skipped (because more urgent levels used the budget) for
``starvation_pulls`` consecutive pulls is read first on the next pull. ``Intake.start(entries)``
decodes each entry and runs the ``START`` script on all of them in one pipeline; what comes back
is a list of :class:`Job` (requests now running on this worker, with any tokens already published
by a previous worker) plus the terminal outcomes (expired, cancelled, poisoned, dead-lettered),
which it finishes itself.

Invariant: every entry given to ``start`` is, on return, either a ``Job`` the caller owns (record
``running`` with this worker's name) or acked and deleted with its request in a terminal state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenfleet.shared.errors import InvalidRequest, ProtocolError
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys, check_request_id
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import (
    GenerationRequest,
    TerminalEvent,
    TerminalStatus,
    TokenEvent,
    decode_event,
)
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args
from tokenfleet.shared.scripts.worker import PULL, START
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.pipelined import ScriptPipeline

log = logging.getLogger(__name__)

DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_PAYLOAD_BYTES = 4_096


@dataclass(slots=True)
class Entry:
    """One stream entry as read (or claimed): where it lives and its raw fields."""

    stream: str
    priority: Priority
    entry_id: str
    fields: dict[str, bytes]  # id, d, dl, h (raw; any may be missing in a malformed entry)

    @property
    def key(self) -> tuple[str, str]:
        """(stream, entry id): entry ids are unique per stream only, and the streams of two
        priorities can hold the same id."""
        return (self.stream, self.entry_id)

    @property
    def raw_id(self) -> str | None:
        """The entry's ``id`` field if it is a valid request id, else None."""
        value = as_str(self.fields.get("id"))
        try:
            return check_request_id(value) if value is not None else None
        except InvalidRequest:
            return None


@dataclass(slots=True)
class Job:
    """A request this worker runs: its entry, decoded request and streaming progress.

    Invariant: ``num_published`` token events (indices ``0 .. num_published - 1``) are in the
    request's token list; ``text_parts`` holds their texts in index order.
    """

    entry: Entry
    request: GenerationRequest
    attempts: int
    resume_token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    num_published: int = 0
    started_at: float = field(default_factory=time.time)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass(slots=True)
class StartReport:
    """Counts of what ``Intake.start`` did with the entries it was given, for metrics."""

    expired: list[Priority] = field(default_factory=list)
    cancelled: list[Priority] = field(default_factory=list)
    poisoned: list[Priority] = field(default_factory=list)
    dead_lettered: list[Priority] = field(default_factory=list)


class Intake:
    """Reads and starts entries for one served model on behalf of one worker.

    Invariant: ``_skipped[p]`` counts consecutive pulls in which level ``p`` was not read; it is
    reset whenever ``p`` is read, and a level with ``_skipped[p] >= starvation_pulls`` is read
    before all others.
    """

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        *,
        model_name: str,
        priorities: Sequence[Priority],
        worker_name: str,
        poison_limit: int,
        starvation_pulls: int,
    ) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.model_name = model_name
        self.priorities = tuple(sorted(priorities))
        self.worker_name = worker_name
        self.poison_limit = poison_limit
        self.starvation_pulls = starvation_pulls
        self.streams = {p: self.keys.stream(model_name, p) for p in self.priorities}
        self._by_stream = {s: p for p, s in self.streams.items()}
        self._skipped = dict.fromkeys(self.priorities, 0)

    # -- reading ------------------------------------------------------------------------------
    def ensure_groups(self) -> None:
        """Create each stream's consumer group at id 0 (MKSTREAM); an existing group is fine."""
        for stream in self.streams.values():
            try:
                self.client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        pipe = self.client.pipeline(transaction=False)
        for p in self.priorities:
            pipe.sadd(self.keys.queues, Keys.queue_member(self.model_name, p))
        pipe.execute()

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
        if block_ms is None:
            order = self.order()
            keys, args = self._pull_keys_args(order, budget)
            pipe.script(PULL, keys, args, raise_errors=False)  # NOGROUP: see parse_pull
        else:
            streams = list(self.streams.values())
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
        return PendingRead(self, pipe, order)

    def parse_pull(self, order: Sequence[Priority], reply: Any) -> list[Entry]:
        """Entries of a ``PULL`` reply; updates the anti-starvation counts. A reply that is a
        NOGROUP error (a stream deleted under us) recreates the groups and yields nothing."""
        if self.lost_groups(reply):
            return []
        values = registry.check_reply(PULL, reply)
        levels_read = int(values[1])
        for i, p in enumerate(order):
            if i < levels_read:
                self._skipped[p] = 0
            else:
                self._skipped[p] += 1
        if int(values[2]):  # a stream or group was gone: recreate them
            self.ensure_groups()
        return self.entries(values[3:])

    def _pull_keys_args(
        self, order: Sequence[Priority], budget: int
    ) -> tuple[list[str], list[Any]]:
        return [self.streams[p] for p in order], [CONSUMER_GROUP, self.worker_name, budget]

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
        for stream_raw, messages in items:
            stream = as_str(stream_raw) or ""
            for entry_id, fields in messages:
                out.append(self.make_entry(stream, entry_id, fields))
        return out

    def make_entry(self, stream: str, entry_id: Any, fields: Any) -> Entry:
        """An :class:`Entry` from one stream message (``fields`` None for a deleted one)."""
        if isinstance(fields, list):  # a script's reply: flat field, value pairs
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        raw = {as_str(k) or "": v for k, v in (fields or {}).items()}
        return Entry(stream, self._by_stream[stream], as_str(entry_id) or "", raw)

    # -- starting -----------------------------------------------------------------------------
    def early_jobs(self, entries: Iterable[Entry]) -> list[Job]:
        """Jobs for the entries that may run before ``start`` has answered (see ``reader``).

        Only new requests qualify: an entry that decodes and was not handed back (``h`` field),
        so its request has no tokens to resume from. Their ``attempts`` is 0 (unknown yet).
        Pure: nothing is read or written in Redis, nothing is dead-lettered here.
        """
        out: list[Job] = []
        for entry in entries:
            if entry.fields.get("h"):
                continue
            try:
                out.append(Job(entry=entry, request=self.decode(entry), attempts=0))
            except ProtocolError:
                continue  # start() dead-letters it
        return out

    def start(
        self, entries: Iterable[Entry], early: Sequence[Job] = ()
    ) -> tuple[list[Job], StartReport]:
        """Decode and start ``entries`` (see the module docstring for the invariant); the
        ``early_jobs`` of these entries, if given, spare decoding them twice."""
        jobs, report, _ = self.start_and_pull(entries, early, 0)
        return jobs, report

    def start_and_pull(
        self, entries: Iterable[Entry], early: Sequence[Job], budget: int
    ) -> tuple[list[Job], StartReport, list[Entry]]:
        """:meth:`start`, plus :meth:`pull` of up to ``budget`` new entries in the same round
        trip. Returns the jobs, the report and the entries pulled, which the caller must start
        in turn."""
        return self.send_start(entries, early, budget).receive()

    def send_start(
        self,
        entries: Iterable[Entry],
        early: Sequence[Job] = (),
        budget: int = 0,
        *,
        connection: Any = None,
    ) -> PendingStart:
        """Send :meth:`start_and_pull`'s round trip without waiting for it (entries that do not
        decode are dead-lettered now, synchronously). ``connection``: see ``ScriptPipeline``."""
        report = StartReport()
        known = {job.entry.key: job.request for job in early}
        decoded: list[tuple[Entry, GenerationRequest]] = []
        for entry in entries:
            try:
                req = known.get(entry.key)
                decoded.append((entry, req if req is not None else self.decode(entry)))
            except ProtocolError as exc:
                self.dead_letter(entry, str(exc), exc.request_id)
                report.dead_lettered.append(entry.priority)
        now = time.time()
        pipe = ScriptPipeline(self.client, connection)
        for entry, req in decoded:
            rid = req.request_id
            pipe.script(
                START,
                [self.keys.record(rid), entry.stream, self.keys.cancel_set, self.keys.tokens(rid)],
                [
                    rid,
                    self.worker_name,
                    repr(now),
                    entry.entry_id,
                    CONSUMER_GROUP,
                    self.poison_limit,
                    "" if req.deadline is None else repr(req.deadline),
                ],
            )
        order = self.order() if budget > 0 else []
        if order:
            keys, args = self._pull_keys_args(order, budget)
            pipe.script(PULL, keys, args, raise_errors=False)  # NOGROUP: see parse_pull
        pipe.send()
        early_ids = [job.request_id for job in early]
        return PendingStart(self, pipe, decoded, early_ids, order, report, budget if order else 0)

    def started(
        self,
        decoded: Sequence[tuple[Entry, GenerationRequest]],
        replies: Sequence[Any],
        report: StartReport,
    ) -> list[Job]:
        """Apply ``START``'s replies: jobs for the entries it started; the others finished
        (or dead-lettered) here and counted in ``report``."""
        jobs: list[Job] = []
        for (entry, req), reply in zip(decoded, replies, strict=True):
            values = reply
            code = values[0]
            if code == "ok":
                jobs.append(self._job(entry, req, values))
            elif code == "missing":
                self.dead_letter(entry, "no durable record exists for this request", None)
                self.finish_unstarted(
                    entry,
                    req.request_id,
                    TerminalStatus.ERROR,
                    "no_record",
                    "the request has no durable record (its TTL lapsed, or it "
                    "was not enqueued through the enqueue script)",
                )
                report.dead_lettered.append(entry.priority)
            elif code == "foreign":
                self.dead_letter(entry, f"request id belongs to entry {as_str(values[1])}", None)
                report.dead_lettered.append(entry.priority)
            elif code == "cancelled":
                self.finish_unstarted(
                    entry,
                    req.request_id,
                    TerminalStatus.CANCELLED,
                    None,
                    "cancelled before it started",
                )
                report.cancelled.append(entry.priority)
            elif code == "expired":
                self.finish_unstarted(
                    entry,
                    req.request_id,
                    TerminalStatus.EXPIRED,
                    None,
                    f"its deadline {req.deadline} passed before a worker could start it",
                )
                report.expired.append(entry.priority)
            elif code == "poison":
                self.finish_unstarted(
                    entry,
                    req.request_id,
                    TerminalStatus.ERROR,
                    "worker_lost",
                    f"the request was taken by {as_str(values[1])} workers "
                    "that all died while running it; it is not retried again "
                    f"(poison limit {self.poison_limit})",
                )
                report.poisoned.append(entry.priority)
            # "terminal": the script already acked and deleted the entry
        return jobs

    def decode(self, entry: Entry) -> GenerationRequest:
        """Decode and validate an entry's payload; ``ProtocolError`` names the fault."""
        rid = entry.raw_id
        payload = entry.fields.get("d")
        if payload is None:
            raise ProtocolError("entry has no 'd' field", request_id=rid)
        try:
            req = GenerationRequest.decode(payload, self.settings.max_payload_bytes)
        except ProtocolError as exc:
            if exc.request_id is None and rid is not None:  # payload unreadable: use the field
                raise ProtocolError(str(exc), request_id=rid) from None
            raise
        if rid is not None and req.request_id != rid:
            raise ProtocolError(
                f"entry id field {rid!r} differs from the payload's id {req.request_id!r}",
                request_id=None,
            )
        try:
            req.sampling.check_limit(self.settings.max_tokens_limit)
        except InvalidRequest as exc:
            raise ProtocolError(str(exc), request_id=req.request_id) from None
        return req

    def _job(self, entry: Entry, req: GenerationRequest, values: list[Any]) -> Job:
        job = Job(entry=entry, request=req, attempts=int(values[1]))
        for i, raw in enumerate(values[3:]):
            event = decode_event(raw)
            if not isinstance(event, TokenEvent) or event.index != i:
                raise ProtocolError(f"token list of {req.request_id} is corrupt at index {i}")
            job.resume_token_ids.append(event.token_id)
            job.text_parts.append(event.text)
        job.num_published = len(job.resume_token_ids)
        return job

    # -- terminal outcomes --------------------------------------------------------------------
    def finish_unstarted(
        self,
        entry: Entry,
        request_id: str,
        status: TerminalStatus,
        code: str | None,
        message: str,
    ) -> None:
        """Finish a request this worker did not start (no ownership check)."""
        event = TerminalEvent(request_id, status, code=code, message=message)
        k, a = finish_keys_args(
            self.keys,
            event,
            model=self.model_name,
            priority=entry.priority,
            now=time.time(),
            ttl_s=self.settings.record_ttl_s,
            stream_id=entry.entry_id,
        )
        registry.call(self.client, FINISH, k, a)

    def dead_letter(self, entry: Entry, reason: str, request_id: str | None) -> None:
        """Copy ``entry`` to the dead-letter stream, error its request if it has a readable id
        whose record is absent or belongs to this entry, and ack+delete the entry."""
        payload = entry.fields.get("d") or b""
        log.warning("dead-lettering entry %s of %s: %s", entry.entry_id, entry.stream, reason)
        self.client.xadd(
            self.keys.dead_letter,
            {
                "stream": entry.stream,
                "entry_id": entry.entry_id,
                "id": request_id or "",
                "reason": reason,
                "worker": self.worker_name,
                "d": payload[:DEAD_LETTER_PAYLOAD_BYTES],
                "size": str(len(payload)),
            },
            maxlen=DEAD_LETTER_MAXLEN,
            approximate=True,
        )
        if request_id is not None:
            owner_entry = as_str(self.client.hget(self.keys.record(request_id), "stream_id"))
            if owner_entry in (None, "", entry.entry_id):
                self.finish_unstarted(
                    entry,
                    request_id,
                    TerminalStatus.ERROR,
                    "invalid_request",
                    f"the request could not be decoded: {reason}",
                )
                return
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(entry.stream, CONSUMER_GROUP, entry.entry_id)
        pipe.xdel(entry.stream, entry.entry_id)
        pipe.execute()


class PendingRead:
    """A read sent by :meth:`Intake.send_read`, its reply not read yet."""

    def __init__(self, intake: Intake, pipe: ScriptPipeline, order: list[Priority] | None) -> None:
        self._intake = intake
        self._pipe = pipe
        self._order = order
        self.blocking = order is None  # an XREADGROUP ... BLOCK, not a PULL

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the reply has arrived (waiting up to ``timeout_s`` for it)."""
        return self._pipe.ready(timeout_s)

    def receive(self) -> list[Entry]:
        """The entries read (waits for the reply if need be); they are now this worker's."""
        (reply,) = self._pipe.receive()
        if self._order is not None:
            return self._intake.parse_pull(self._order, reply)
        return [] if self._intake.lost_groups(reply) else self._intake.entries(reply)


class PendingStart:
    """A ``START`` round trip sent by :meth:`Intake.send_start`, its replies not read yet."""

    def __init__(
        self,
        intake: Intake,
        pipe: ScriptPipeline,
        decoded: list[tuple[Entry, GenerationRequest]],
        early_ids: list[str],
        order: list[Priority],
        report: StartReport,
        pull_budget: int,
    ) -> None:
        self._intake = intake
        self._pipe = pipe
        self._decoded = decoded
        self._order = order
        self._report = report
        self.pull_budget = pull_budget  # entries the round trip pulls at most
        self.early_ids = early_ids  # of the entries it starts, those handed over early
        self.num_held = len(decoded) - len(early_ids)  # the others: they will need engine room

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the replies have arrived (waiting up to ``timeout_s`` for them)."""
        return self._pipe.ready(timeout_s)

    def receive(self) -> tuple[list[Job], StartReport, list[Entry]]:
        """(jobs started, report, entries pulled); waits for the replies if need be."""
        replies = self._pipe.receive()
        pulled = self._intake.parse_pull(self._order, replies.pop()) if self._order else []
        jobs = self._intake.started(self._decoded, replies, self._report)
        return jobs, self._report, pulled
