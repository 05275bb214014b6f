"""Starting entries and pulling the next ones in one round trip, and the reader thread that
relies on it, against the real server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from worker_helpers import enqueue, make_intake, make_request, record, wait_for

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.scripts.worker import START
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake import Intake
from tokenfleet.worker.intake.reader import IntakeReader

NORMAL = "tft:q:default:normal"


def _count_checkouts(r: redis.Redis) -> list[int]:
    """Counts connections taken from ``r``'s pool: one per command or pipeline round trip."""
    pool = r.connection_pool
    taken = [0]
    original = pool.get_connection

    def counting(*args: Any, **kwargs: Any) -> Any:
        taken[0] += 1
        return original(*args, **kwargs)

    pool.get_connection = counting  # type: ignore[method-assign]
    return taken


def test_start_and_pull_starts_and_reads_the_next_most_urgent_in_one_round_trip(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = make_intake(r, settings, priorities=list(Priority))
    enqueue(r, keys, make_request("n1"))
    entries = intake.streams.pull(1)
    enqueue(r, keys, make_request("b1", priority=Priority.BATCH))
    enqueue(r, keys, make_request("n2"))
    enqueue(r, keys, make_request("c1", priority=Priority.CRITICAL))
    r.script_load(START.source)  # else NOSCRIPT adds the loading round trips
    taken = _count_checkouts(r)
    jobs, report, pulled = intake.starter.start_and_pull(
        entries, intake.starter.early_jobs(entries), 2
    )
    assert taken[0] == 1
    assert [j.request_id for j in jobs] == ["n1"] and report.dead_lettered == []
    assert [e.raw_id for e in pulled] == ["c1", "n2"]  # most urgent first, within the budget
    n1, c1 = record(r, keys, "n1"), record(r, keys, "c1")
    assert n1 is not None and n1.status == "running"
    assert c1 is not None and c1.status == "queued"  # read, not started: the caller starts it
    jobs, _, pulled = intake.starter.start_and_pull(pulled, (), 0)
    assert [j.request_id for j in jobs] == ["c1", "n2"] and pulled == []
    assert r.xpending(keys.stream("default", Priority.BATCH), CONSUMER_GROUP)["pending"] == 0


def test_start_and_pull_keeps_the_starts_when_a_stream_vanished(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = make_intake(r, settings, priorities=[Priority.NORMAL, Priority.BATCH])
    enqueue(r, keys, make_request("n1"))
    entries = intake.streams.pull(1)
    r.delete(keys.stream("default", Priority.BATCH))  # the PULL finds its group gone
    jobs, _, pulled = intake.starter.start_and_pull(entries, (), 5)
    assert [j.request_id for j in jobs] == ["n1"] and pulled == []
    assert r.xinfo_groups(keys.stream("default", Priority.BATCH))  # recreated
    enqueue(r, keys, make_request("b1", priority=Priority.BATCH))
    assert [e.raw_id for e in intake.streams.pull(5)] == ["b1"]


def test_start_and_pull_pulls_even_when_every_entry_was_dead_lettered(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = make_intake(r, settings)
    r.xadd(NORMAL, {"id": "bad", "d": b"not json"})
    entries = intake.streams.pull(1)
    enqueue(r, keys, make_request("n1"))
    jobs, report, pulled = intake.starter.start_and_pull(entries, (), 3)
    assert jobs == [] and report.dead_lettered == [Priority.NORMAL]
    assert [e.raw_id for e in pulled] == ["n1"]


class Spy:
    """Records the round trips an ``Intake`` sends (the reader calls them by attribute)."""

    def __init__(self, intake: Intake) -> None:
        self.sent: list[str] = []
        send_read, send_start = intake.streams.send_read, intake.starter.send_start

        def read(budget: int, *, block_ms: int | None = None, connection: Any = None) -> Any:
            self.sent.append("pull" if block_ms is None else "wait")
            return send_read(budget, block_ms=block_ms, connection=connection)

        def start(*args: Any, **kwargs: Any) -> Any:
            self.sent.append("start")
            return send_start(*args, **kwargs)

        intake.streams.send_read = read  # type: ignore[method-assign]
        intake.starter.send_start = start  # type: ignore[method-assign]


@pytest.fixture
def reader_and_spy(r: redis.Redis, settings: Settings) -> Iterator[tuple[IntakeReader, Spy]]:
    intake = make_intake(r, settings)
    spy = Spy(intake)
    reader = IntakeReader(intake, block_ms=60_000)
    try:
        yield reader, spy
    finally:
        reader.stop()
        reader.close()


def _take(reader: IntakeReader, budget: int, n: int) -> list[str]:
    """Poll as an engine with ``budget`` free slots would until ``n`` jobs have started."""
    admitted: set[str] = set()
    got: list[str] = []
    while len(got) < n:
        delivery = reader.poll(budget - len(admitted), 10.0)
        admitted.update(j.request_id for j in delivery.early + delivery.jobs)
        got += [j.request_id for j in delivery.jobs]
    return got


def test_a_lone_arrival_costs_the_wait_and_one_start_round_trip(
    reader_and_spy: tuple[IntakeReader, Spy], r: redis.Redis, keys: Keys
) -> None:
    reader, spy = reader_and_spy
    assert not reader.poll(10, 0.05)  # nothing waits: the pull comes back empty
    assert spy.sent == ["pull", "wait"]  # ... and the next read blocks
    for i in range(3):
        enqueue(r, keys, make_request(f"g{i}"))
        delivery = reader.poll(10, 10.0)  # the wait answers: an early job, START sent
        assert [j.request_id for j in delivery.early] == [f"g{i}"] and delivery.jobs == []
        assert _take(reader, 9, 1) == [f"g{i}"]
    # each arrival: the wait's reply, then START with a follow-up pull; never a pull of its own
    assert spy.sent == ["pull", "wait"] + ["start", "wait"] * 3


def test_a_burst_is_read_by_the_wait_and_the_start_round_trips_within_the_budget(
    reader_and_spy: tuple[IntakeReader, Spy], r: redis.Redis, keys: Keys
) -> None:
    reader, spy = reader_and_spy
    assert not reader.poll(4, 0.05)  # the blocking read is armed
    for i in range(5):
        r.hset(keys.record(f"b{i}"), mapping={"status": "queued", "stream_id": f"{i + 1}-0"})
    pipe = r.pipeline(transaction=True)  # five arrivals at once: the wait wakes on the first
    for i in range(5):
        entry: dict[Any, Any] = {"id": f"b{i}", "d": make_request(f"b{i}").encode(), "dl": ""}
        pipe.xadd(NORMAL, entry, id=f"{i + 1}-0")
    pipe.execute()
    assert _take(reader, 4, 4) == ["b0", "b1", "b2", "b3"]
    assert spy.sent == ["pull", "wait", "start", "start"]  # b1-b3 came with b0's START
    assert r.xpending(NORMAL, CONSUMER_GROUP)["pending"] == 4  # b4 waits for room, in Redis
    assert _take(reader, 1, 1) == ["b4"]


def test_a_full_engine_cancels_the_blocking_read(
    reader_and_spy: tuple[IntakeReader, Spy], r: redis.Redis, keys: Keys
) -> None:
    reader, _ = reader_and_spy
    assert not reader.poll(2, 0.05)  # the blocking read is armed
    assert not reader.poll(0, 0.5)  # no room: CLIENT UNBLOCK, and it came back empty
    assert r.info("clients")["blocked_clients"] == 0
    enqueue(r, keys, make_request("late"))
    assert not reader.poll(0, 0.3)
    assert r.xpending(NORMAL, CONSUMER_GROUP)["pending"] == 0  # left in Redis for others
    assert _take(reader, 1, 1) == ["late"]


def test_stop_cancels_the_blocking_read_and_starts_what_it_read(
    reader_and_spy: tuple[IntakeReader, Spy], r: redis.Redis, keys: Keys
) -> None:
    reader, _ = reader_and_spy
    assert not reader.poll(2, 0.05)  # the blocking read is armed (for a minute)
    enqueue(r, keys, make_request("s1"))
    wait_for(lambda: r.xpending(NORMAL, CONSUMER_GROUP)["pending"] == 1, "the read to take s1")
    left = reader.stop()
    assert [j.request_id for j in left.jobs] == ["s1"]  # read, so started and handed over
    rec = record(r, keys, "s1")
    assert rec is not None and rec.status == "running"
    assert not reader.stop()  # idempotent, and no read is armed any more
    assert r.info("clients")["blocked_clients"] == 0


def test_a_flush_under_the_blocking_read_recreates_the_groups(
    reader_and_spy: tuple[IntakeReader, Spy], r: redis.Redis, keys: Keys
) -> None:
    reader, _ = reader_and_spy
    assert not reader.poll(2, 0.05)  # the blocking read is armed
    r.flushall()  # it is answered with an UNBLOCKED error: the stream key is gone
    assert not reader.poll(2, 0.5)
    assert r.xinfo_groups(NORMAL)  # recreated, and a new blocking read is armed
    enqueue(r, keys, make_request("after"))
    assert _take(reader, 2, 1) == ["after"]
