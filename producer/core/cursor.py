"""Merge catch-up reads and live channel messages into one gap-free, duplicate-free sequence.

A reader subscribes first, then reads the durable record and the token list from the index it
has ("sync"), then follows the channel. The worker RPUSHes each token event before publishing it,
so the list read after subscribing plus the messages after it cover everything; duplicates are
dropped by index. A gap (a message beyond the next index, or a terminal event announcing more
tokens than seen) asks for another sync instead of guessing.

Pure logic, no I/O: ``HandleCore`` (both handle faces) drives one ``EventCursor`` per handle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenfleet.shared.errors import ProtocolError, UnknownRequest
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import (
    Event,
    TerminalEvent,
    TerminalStatus,
    TokenEvent,
    decode_event,
)


def terminal_from_record(record: RequestRecord, num_tokens: int) -> TerminalEvent:
    """Rebuild the terminal event from a terminal record (for readers that missed it)."""
    return TerminalEvent(
        request_id=record.request_id,
        status=TerminalStatus(record.status.value),
        num_tokens=max(num_tokens, record.num_tokens),
        finish_reason=record.finish_reason,
        code=record.code,
        message=record.message,
        usage=dict(record.usage),
        timings=dict(record.timings),
    )


class EventCursor:
    """Position in one request's event sequence.

    Invariants: emitted token events have indices ``start, start + 1, ...`` with no gap and no
    repeat; at most one terminal event is emitted, and nothing after it. ``needs_sync`` is True
    when the next events must come from the durable record and list (start, gap, reconnect).
    """

    def __init__(self, request_id: str, next_index: int = 0, *, needs_sync: bool = True) -> None:
        self.request_id = request_id
        self.next_index = next_index
        self.needs_sync = needs_sync
        self.finished = False

    def on_message(self, data: bytes | str) -> list[Event]:
        """Events released by one channel message (possibly none)."""
        if self.finished:
            return []
        try:
            event = decode_event(data)
        except ProtocolError:
            self.needs_sync = True  # the durable list and record are authoritative
            return []
        if event.request_id != self.request_id:
            return []
        if isinstance(event, TokenEvent):
            if event.index < self.next_index:
                return []
            if event.index > self.next_index:
                self.needs_sync = True
                return []
            self.next_index += 1
            return [event]
        if event.num_tokens > self.next_index:
            self.needs_sync = True  # tokens are missing; the record is terminal already
            return []
        self.finished = True
        return [event]

    def on_sync(
        self,
        raw_record: Mapping[bytes | str, bytes | str],
        token_list: Sequence[bytes | str],
        start: int,
    ) -> list[Event]:
        """Events released by a sync: ``token_list`` holds the list from index ``start`` on,
        read *after* ``raw_record`` (so a terminal record means the list is complete).

        Raises:
            UnknownRequest: the record does not exist (never submitted, or its TTL lapsed).
            ProtocolError: a stored token event is malformed or out of place.
        """
        self.needs_sync = False
        if self.finished:
            return []
        record = RequestRecord.from_hash(self.request_id, raw_record)
        if record is None:
            raise UnknownRequest(
                f"no request {self.request_id} (never submitted, or its record expired)"
            )
        out: list[Event] = []
        for offset, data in enumerate(token_list):
            index = start + offset
            if index < self.next_index:
                continue
            event = decode_event(data)
            if not isinstance(event, TokenEvent) or event.index != index:
                raise ProtocolError(f"token list of {self.request_id} is corrupt at {index}")
            out.append(event)
            self.next_index += 1
        if record.status.is_terminal:
            out.append(terminal_from_record(record, self.next_index))
            self.finished = True
        return out
