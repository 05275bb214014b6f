"""Ending entries that never ran: a terminal event for their request, or a dead letter.

An entry this worker read but did not start (its request was cancelled or expired before it
started, outlived too many workers, or cannot be decoded) still reaches exactly one terminal
state: ``finish_unstarted`` runs the ``FINISH`` script for it (record, terminal event, ack+delete
of the entry, atomically), and ``dead_letter`` copies an entry that cannot run to the dead-letter
stream before ending it.
"""

from __future__ import annotations

import logging
import time

import redis

from tokenfleet.shared import dead_letters
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.jobs import Entry

log = logging.getLogger(__name__)


class UnstartedOutcomes:
    """Ends entries of one served model that this worker read but never started."""

    def __init__(
        self, client: redis.Redis, settings: Settings, *, model_name: str, worker_name: str
    ) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.model_name = model_name
        self.worker_name = worker_name

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
            stream=entry.stream,
        )
        registry.call(self.client, FINISH, k, a)

    def dead_letter(self, entry: Entry, reason: str, request_id: str | None) -> None:
        """Copy ``entry`` to the dead-letter stream once, error its request if it has a readable
        id whose record is absent or belongs to this entry, and ack+delete the entry. A record
        of this entry's own is ended ``error`` through ``tf_finish``, which makes the copy (with
        the reason) in the same atomic step; otherwise the copy is written here."""
        log.warning("dead-lettering entry %s of %s: %s", entry.entry_id, entry.stream, reason)
        owner_entry, status = None, None
        if request_id is not None:
            held = self.client.hmget(self.keys.record(request_id), ["stream_id", "status"])
            owner_entry, status = (as_str(v) for v in held)
        live = status in (None, "queued", "running")  # (None: no record, or no status field)
        mine = request_id is not None and owner_entry in ("", entry.entry_id) and live
        if not mine:
            self._copy(entry, reason, request_id)
        if request_id is not None and (mine or owner_entry is None):  # its error end
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

    def _copy(self, entry: Entry, reason: str, request_id: str | None) -> None:
        """Write ``entry`` to the dead-letter stream (``shared.dead_letters``' fields)."""
        payload = entry.fields.get("d") or b""
        self.client.xadd(
            self.keys.dead_letter,
            {
                "stream": entry.stream,
                "entry_id": entry.entry_id,
                "id": request_id or "",
                "reason": reason,
                "worker": self.worker_name,
                "d": payload[: dead_letters.PAYLOAD_BYTES],
                "size": str(len(payload)),
            },
            maxlen=dead_letters.MAXLEN,
            approximate=True,
        )
