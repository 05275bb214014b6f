"""Starting entries: decode them and run the ``START`` script on all of them in one pipeline.

``Starter.start(entries)`` decodes each entry and runs ``START`` on all of them in one pipeline;
what comes back is a list of :class:`Job` (requests now running on this worker, with any tokens
already published by a previous worker) plus the terminal outcomes (expired, cancelled,
poisoned, dead-lettered), which it finishes itself (``UnstartedOutcomes``). ``send_start`` writes
that round trip without waiting, optionally with a ``PULL`` of the next entries riding along, and
``early_jobs`` decodes the new requests that may go into the engine before ``START`` answers.

Invariant: every entry given to ``start`` is, on return, either a ``Job`` the caller owns (record
``running`` with this worker's name) or acked and deleted with its request in a terminal state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from tokenfleet.shared.errors import InvalidRequest, ProtocolError
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.prefix_chain import model_session_hash, session_of
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import GenerationRequest, TerminalStatus, TokenEvent, decode_event
from tokenfleet.shared.scripts.worker import START
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.jobs import CORRUPT_STATE, Entry, Job, StartReport
from tokenfleet.worker.intake.outcomes import UnstartedOutcomes
from tokenfleet.worker.intake.streams import PriorityStreams
from tokenfleet.worker.pipelined import ScriptPipeline

log = logging.getLogger(__name__)


class Starter:
    """Decodes and starts entries for one served model on behalf of one worker (see the module
    docstring for the invariant)."""

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        streams: PriorityStreams,
        outcomes: UnstartedOutcomes,
        *,
        poison_limit: int,
    ) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.streams = streams
        self.outcomes = outcomes
        self.worker_name = streams.worker_name
        self.poison_limit = poison_limit

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
        """:meth:`start`, plus ``PriorityStreams.pull`` of up to ``budget`` new entries in the
        same round trip. Returns the jobs, the report and the entries pulled, which the caller
        must start in turn."""
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
                self.outcomes.dead_letter(entry, str(exc), exc.request_id)
                report.dead_lettered.append(entry.priority)
        now = time.time()
        pipe = ScriptPipeline(self.client, connection)
        for entry, req in decoded:
            rid = req.request_id
            repin = self.session_to_repin(entry, req)
            pipe.script(
                START,
                [
                    self.keys.record(rid),
                    entry.stream,
                    self.keys.cancel_set,
                    self.keys.tokens(rid),
                    self.keys.drained,
                    *repin,
                ],
                [
                    rid,
                    self.worker_name,
                    repr(now),
                    entry.entry_id,
                    CONSUMER_GROUP,
                    self.poison_limit,
                    "" if req.deadline is None else repr(req.deadline),
                    req.model,
                    req.priority.label,
                    Keys.queue_member(req.model, req.priority),
                    entry.route,
                    *([self.settings.session_ttl_s] if repin else []),
                ],
            )
        order = self.streams.queue_pull(pipe, budget) if budget > 0 else []
        pipe.send()
        early_ids = [job.request_id for job in early]
        return PendingStart(self, pipe, decoded, early_ids, order, report, budget if order else 0)

    def session_to_repin(self, entry: Entry, req: GenerationRequest) -> list[str]:
        """The session key ``START`` pins to this worker (``[]``: none): a stolen turn's
        history is here now, so its session's next turn should come here too. The key is
        derived as the producer derived it (``enqueue_keys_args``): from the request's
        ``metadata`` (``session`` or ``user``) and its model."""
        if not entry.route.startswith("stolen_by:"):
            return []
        session = session_of(req.metadata)
        if session is None:
            return []
        return [self.keys.session(model_session_hash(req.model, session))]

    def started(
        self,
        decoded: Sequence[tuple[Entry, GenerationRequest]],
        replies: Sequence[Any],
        report: StartReport,
    ) -> list[Job]:
        """Apply ``START``'s replies: jobs for the entries it started; the others finished
        (or dead-lettered) here and counted in ``report``."""
        outcomes = self.outcomes
        jobs: list[Job] = []
        for (entry, req), reply in zip(decoded, replies, strict=True):
            values = reply
            code = values[0]
            if code == "ok":
                try:
                    jobs.append(self._job(entry, req, values))
                except (
                    ProtocolError
                ) as exc:  # a token event that does not decode or is out of place
                    self._end_corrupt(entry, req.request_id, str(exc), report)
            elif code == "corrupt":
                self._end_corrupt(entry, req.request_id, as_str(values[1]) or "", report)
            elif code == "missing":
                outcomes.dead_letter(entry, "no durable record exists for this request", None)
                outcomes.finish_unstarted(
                    entry,
                    req.request_id,
                    TerminalStatus.ERROR,
                    "no_record",
                    "the request has no durable record (its TTL lapsed, or it "
                    "was not enqueued through the enqueue script)",
                )
                report.dead_lettered.append(entry.priority)
            elif code == "foreign":
                outcomes.dead_letter(
                    entry, f"request id belongs to entry {as_str(values[1])}", None
                )
                report.dead_lettered.append(entry.priority)
            elif code == "cancelled":
                outcomes.finish_unstarted(
                    entry,
                    req.request_id,
                    TerminalStatus.CANCELLED,
                    None,
                    "cancelled before it started",
                )
                report.cancelled.append(entry.priority)
            elif code == "expired":
                outcomes.finish_unstarted(
                    entry,
                    req.request_id,
                    TerminalStatus.EXPIRED,
                    None,
                    f"its deadline {req.deadline} passed before a worker could start it",
                )
                report.expired.append(entry.priority)
            elif code == "poison":
                outcomes.finish_unstarted(
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

    def _end_corrupt(self, entry: Entry, rid: str, cause: str, report: StartReport) -> None:
        """End a request whose record or token list is poisoned: ``error`` / ``corrupt_state``
        naming the cause; its entry is acked and deleted (no ownership check: ``START`` either
        refused it or made it this worker's)."""
        log.warning(
            "worker %s: %s has inconsistent state (%s); ending it", self.worker_name, rid, cause
        )
        self.outcomes.finish_unstarted(
            entry,
            rid,
            TerminalStatus.ERROR,
            CORRUPT_STATE,
            f"inconsistent request state: {cause}",
        )
        report.corrupt.append(entry.priority)

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
            try:
                event = decode_event(raw)
            except ProtocolError as exc:
                raise ProtocolError(f"its token list's event {i} does not decode: {exc}") from None
            if not isinstance(event, TokenEvent) or event.index != i:
                raise ProtocolError(f"its token list holds no token event {i} at index {i}")
            job.resume_token_ids.append(event.token_id)
            job.text_parts.append(event.text)
            job.events.append(raw if isinstance(raw, bytes) else str(raw).encode())
        job.num_published = len(job.resume_token_ids)
        return job


class PendingStart:
    """A ``START`` round trip sent by :meth:`Starter.send_start`, its replies not read yet."""

    def __init__(
        self,
        starter: Starter,
        pipe: ScriptPipeline,
        decoded: list[tuple[Entry, GenerationRequest]],
        early_ids: list[str],
        order: list[Priority],
        report: StartReport,
        pull_budget: int,
    ) -> None:
        self._starter = starter
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
        starter = self._starter
        pulled = starter.streams.parse_pull(self._order, replies.pop()) if self._order else []
        jobs = starter.started(self._decoded, replies, self._report)
        return jobs, self._report, pulled
