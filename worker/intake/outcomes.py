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

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.jobs import Entry

log = logging.getLogger(__name__)

DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_PAYLOAD_BYTES = 4_096


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
