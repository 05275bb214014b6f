"""Pure pieces: the event cursor and the subscription table (no Redis)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tokenfleet.producer.core.cursor import EventCursor
from tokenfleet.producer.core.subscriptions import RESYNC, SubscriptionTable
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent


def _tok(i: int) -> bytes:
    return TokenEvent("r1", i, i, str(i)).encode()


def test_cursor_drops_duplicates_and_asks_to_sync_on_gaps() -> None:
    c = EventCursor("r1", 0, needs_sync=False)
    assert c.on_message(_tok(0)) == [TokenEvent("r1", 0, 0, "0")]
    assert c.on_message(_tok(0)) == []
    assert c.on_message(_tok(2)) == [] and c.needs_sync
    running: Any = {b"status": b"running"}
    events: list[Any] = c.on_sync(running, [_tok(1), _tok(2)], 1)
    assert [e.index for e in events] == [1, 2]
    early = TerminalEvent("r1", TerminalStatus.DONE, num_tokens=4).encode()
    assert c.on_message(early) == [] and c.needs_sync  # announces a token not seen yet
    done: Any = {b"status": b"done", b"num_tokens": b"4", b"finish_reason": b"stop"}
    events = c.on_sync(done, [_tok(3)], 3)
    assert isinstance(events[-1], TerminalEvent) and events[-1].num_tokens == 4
    assert c.on_message(_tok(4)) == [] and c.finished


def test_cursor_ignores_garbage_and_other_requests() -> None:
    c = EventCursor("r1", 0, needs_sync=False)
    assert c.on_message(b"not json") == [] and c.needs_sync
    c.needs_sync = False
    assert c.on_message(TokenEvent("other", 0, 1, "x").encode()) == []


def test_table_matches_confirmations_in_order_and_resyncs_after_reconnect() -> None:
    table = SubscriptionTable()
    got: list[object] = []
    a, b = threading.Event(), threading.Event()
    assert table.add("ch", 1, got.append, a) is True
    assert table.add("ch", 2, got.append, b) is False  # rides on the SUBSCRIBE in flight
    assert not a.is_set()
    table.dispatch([b"subscribe", b"ch", 1])
    assert a.is_set() and b.is_set()
    c = threading.Event()
    assert table.add("ch", 3, got.append, c) is False and c.is_set()  # already confirmed
    table.dispatch([b"message", b"ch", b"data"])
    assert got == [b"data"] * 3
    assert table.remove("ch", 1) is False and table.remove("ch", 2) is False
    d = threading.Event()
    table.add("other", 4, got.append, d)
    assert sorted(table.reset_for_reconnect()) == ["ch", "other"]
    got.clear()
    table.confirmed("ch")
    table.confirmed("other")
    assert d.is_set() and got == [RESYNC, RESYNC]
    assert table.remove("ch", 3) is True  # the last mailbox: UNSUBSCRIBE


def test_bulk_fast_path_encodes_exactly_like_submit() -> None:
    from tokenfleet.producer.core.request import prepare, prepare_many
    from tokenfleet.shared.settings import Settings

    settings = Settings()
    params: dict[str, Any] = {
        "max_tokens": 9,
        "temperature": 0.5,
        "stop": ["\n", "END"],
        "priority": "batch",
        "deadline_s": 30,
        "seed": 3,
    }
    specs = [{"prompt": p, "request_id": f"id-{i}", **params} for i, p in enumerate("abç")]
    bulk = prepare_many(settings, specs, now=100.0)
    single = [prepare(settings, now=100.0, **spec) for spec in specs]
    assert bulk == single
    with pytest.raises(InvalidRequest, match=r"requests\[1\]: prompt is empty"):
        prepare_many(settings, [specs[0], {**specs[1], "prompt": ""}], now=1.0)
