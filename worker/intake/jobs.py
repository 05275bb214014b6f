"""What the intake hands over: stream entries as read, jobs (requests this worker runs) and the
counts of entries that ended without running."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import check_request_id
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import GenerationRequest, TokenEvent

# The error code of a request whose Redis state is poisoned (record or token list inconsistent
# with the request or with each other): the worker ends it ``error`` with this code and a cause.
CORRUPT_STATE = "corrupt_state"


@dataclass(slots=True)
class Entry:
    """One stream entry as read (or claimed): where it lives and its raw fields."""

    stream: str
    priority: Priority
    entry_id: str
    fields: dict[str, bytes]  # id, d, dl, h, t, n (raw; any may be missing)
    route: str = ""  # how it came: "stolen_by:W" / "overflow:W" (START: the record's taken)

    @property
    def key(self) -> tuple[str, str]:
        """(stream, entry id): entry ids are unique per stream only, and the streams of two
        priorities can hold the same id."""
        return (self.stream, self.entry_id)

    @property
    def tenant(self) -> str:
        """The tenant whose queue admitted it (field ``t``, docs/fairness.md); "" for an entry
        that went to the shared stream directly (the default tenant, no fair admission)."""
        return as_str(self.fields.get("t")) or ""

    @property
    def prompt_tokens(self) -> int:
        """Its prompt tokens as the producer counted them (field ``n``; 0 when absent)."""
        value = as_str(self.fields.get("n")) or ""
        return int(value) if value.isdigit() else 0

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
    request's token list; ``text_parts`` holds their texts in index order and ``events`` the
    events themselves, encoded as they are in the list (what the worker puts back after a Redis
    rollback: ``service/repair.py``). The publisher never changes a job: its owner applies each
    publish's result with :func:`record_published`.
    """

    entry: Entry
    request: GenerationRequest
    attempts: int
    resume_token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    num_published: int = 0
    started_at: float = field(default_factory=time.time)
    events: list[bytes] = field(default_factory=list)  # encoded, index order (repair.py)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass(slots=True)
class StartReport:
    """Counts of what ``Starter.start`` did with the entries it was given, for metrics."""

    expired: list[Priority] = field(default_factory=list)
    cancelled: list[Priority] = field(default_factory=list)
    poisoned: list[Priority] = field(default_factory=list)
    dead_lettered: list[Priority] = field(default_factory=list)
    corrupt: list[Priority] = field(default_factory=list)  # ended error / corrupt_state


def record_published(appended: Iterable[tuple[Job, Sequence[TokenEvent]]]) -> None:
    """Advance each job by its events that a publish appended to its token list (the events
    start at ``num_published``: the script refuses any others)."""
    for job, events in appended:
        job.num_published = events[-1].index + 1
        job.text_parts.extend(e.text for e in events)
        job.events.extend(e.encode() for e in events)
