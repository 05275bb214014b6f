"""The dead-letter stream (``Keys.dead_letter``): entries no worker could run, and the requests
that ended ``error``, each with its reason, kept so that a person can look at them and requeue
or discard them (``tokenfleet console``).

Two writers, one shape: a worker copies an entry it cannot decode or whose record is missing
(``worker.intake.outcomes``), and ``tf_finish`` copies the stream entry of every request that
ends ``error`` in the same atomic step (so a retried finish never copies twice). Every entry
holds these fields (values are strings):

    stream     the queue stream the entry was in
    entry_id   its id there
    id         the request id ("" when none could be read)
    reason     why: "CODE: message" for a failed request, a decoding error for the others
    worker     the worker that ran or read it ("" when none started it)
    d          the request's payload, cut to ``PAYLOAD_BYTES``
    size       the payload's full length in bytes

Bounds: the stream keeps about ``MAXLEN`` entries (``XADD MAXLEN ~``); a payload longer than
``PAYLOAD_BYTES`` is kept cut, shown as cut, and cannot be requeued.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.errors import InvalidRequest, ProtocolError
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import GenerationRequest

MAXLEN = 10_000
PAYLOAD_BYTES = 16_384  # a prompt of this size still requeues; 10,000 such cost ~160 MiB at most


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One entry of the dead-letter stream (fields: the module docstring)."""

    entry: str  # its id in the dead-letter stream
    stream: str
    entry_id: str
    request_id: str
    reason: str
    worker: str
    payload: bytes
    size: int

    @classmethod
    def from_entry(cls, entry_id: Any, fields: Mapping[Any, Any]) -> DeadLetter:
        """Parse one ``XRANGE`` entry (bytes or str keys and values)."""
        f = {as_str(k): v for k, v in fields.items()}
        raw = f.get("d") or b""
        payload = raw.encode() if isinstance(raw, str) else bytes(raw)
        try:
            size = int(as_str(f.get("size")) or len(payload))
        except ValueError:
            size = len(payload)
        return cls(
            entry=as_str(entry_id) or "",
            stream=as_str(f.get("stream")) or "",
            entry_id=as_str(f.get("entry_id")) or "",
            request_id=as_str(f.get("id")) or "",
            reason=as_str(f.get("reason")) or "",
            worker=as_str(f.get("worker")) or "",
            payload=payload,
            size=size,
        )

    @property
    def cut(self) -> bool:
        """Whether the payload was kept cut (it cannot be requeued then)."""
        return self.size > len(self.payload)

    def request(self, max_bytes: int) -> GenerationRequest:
        """The request to run again, decoded and validated as a worker would (``InvalidRequest``
        when it was kept cut or does not decode: nothing can run it)."""
        if self.cut:
            raise InvalidRequest(
                f"dead letter {self.entry} kept only {len(self.payload)} of the request's "
                f"{self.size} bytes: it cannot be requeued"
            )
        try:
            return GenerationRequest.decode(self.payload, max_bytes)
        except ProtocolError as exc:
            raise InvalidRequest(f"dead letter {self.entry} cannot be requeued: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the payload as text, cut marked)."""
        return {
            "entry": self.entry,
            "stream": self.stream,
            "entry_id": self.entry_id,
            "request_id": self.request_id,
            "reason": self.reason,
            "worker": self.worker,
            "size": self.size,
            "cut": self.cut,
        }


def parse_entries(entries: Sequence[Any]) -> list[DeadLetter]:
    """``XRANGE``/``XREVRANGE`` reply -> dead letters, in the reply's order."""
    return [DeadLetter.from_entry(entry_id, fields) for entry_id, fields in entries]
