"""Events and statuses: round trips, malformed events refused, which statuses are terminal."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tokenfleet.shared.errors import ProtocolError
from tokenfleet.shared.schema import (
    SCHEMA_VERSION,
    RequestStatus,
    TerminalEvent,
    TerminalStatus,
    TokenEvent,
    decode_event,
)


def test_events_round_trip() -> None:
    tok = TokenEvent("r1", 3, 42, "é")
    assert decode_event(tok.encode()) == tok
    term = TerminalEvent(
        "r1", TerminalStatus.DONE, num_tokens=4, finish_reason="stop", usage={"prompt_tokens": 2}
    )
    back = decode_event(term.encode())
    assert back == term and isinstance(back, TerminalEvent) and back.code == "done"
    err = TerminalEvent("r1", TerminalStatus.ERROR, code="worker_lost", message="gone")
    assert decode_event(err.encode()) == err


@pytest.mark.parametrize(
    ("event", "fragment"),
    [
        ({"v": 2, "type": "token", "id": "r"}, "version"),
        ({"v": SCHEMA_VERSION, "type": "token"}, "no request id"),
        ({"v": SCHEMA_VERSION, "type": "token", "id": "r", "index": -1}, "malformed token"),
        ({"v": SCHEMA_VERSION, "type": "weird", "id": "r"}, "unknown event type"),
        ({"v": SCHEMA_VERSION, "type": "done", "id": "r", "code": 5}, "code must be a string"),
    ],
)
def test_bad_events_are_refused(event: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        decode_event(orjson.dumps(event))


def test_request_status_terminality() -> None:
    assert not RequestStatus.QUEUED.is_terminal and not RequestStatus.RUNNING.is_terminal
    assert {s for s in RequestStatus if s.is_terminal} == {
        RequestStatus(t.value) for t in TerminalStatus
    }
