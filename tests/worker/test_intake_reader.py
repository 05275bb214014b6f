"""Starting entries and pulling the next ones in one round trip, and the reader thread that
relies on it, against the real server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from worker_helpers import enqueue, make_intake, make_request, record, wait_for

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.scripts.worker import START
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake import Intake, Job
from tokenfleet.worker.reader import IntakeReader

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
    entries = intake.pull(1)
    enqueue(r, keys, make_request("b1", priority=Priority.BATCH))
    enqueue(r, keys, make_request("n2"))
    enqueue(r, keys, make_request("c1", priority=Priority.CRITICAL))
    r.script_load(START.source)  # else NOSCRIPT adds the loading round trips
    taken = _count_checkouts(r)
    jobs, report, pulled = intake.start_and_pull(entries, intake.early_jobs(entries), 2)
    assert taken[0] == 1
    assert [j.request_id for j in jobs] == ["n1"] and report.dead_lettered == []
    assert [e.raw_id for e in pulled] == ["c1", "n2"]  # most urgent first, within the budget
    n1, c1 = record(r, keys, "n1"), record(r, keys, "c1")
    assert n1 is not None and n1.status == "running"
    assert c1 is not None and c1.status == "queued"  # read, not started: the caller starts it
    jobs, _, pulled = intake.start_and_pull(pulled, (), 0)
    assert [j.request_id for j in jobs] == ["c1", "n2"] and pulled == []
    assert r.xpending(keys.stream("default", Priority.BATCH), CONSUMER_GROUP)["pending"] == 0


def test_start_and_pull_keeps_the_starts_when_a_stream_vanished(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = make_intake(r, settings, priorities=[Priority.NORMAL, Priority.BATCH])
    enqueue(r, keys, make_request("n1"))
    entries = intake.pull(1)
    r.delete(keys.stream("default", Priority.BATCH))  # its PULL now fails with NOGROUP
    jobs, _, pulled = intake.start_and_pull(entries, (), 5)
    assert [j.request_id for j in jobs] == ["n1"] and pulled == []
    assert r.xinfo_groups(keys.stream("default", Priority.BATCH))  # recreated
    enqueue(r, keys, make_request("b1", priority=Priority.BATCH))
    assert [e.raw_id for e in intake.pull(5)] == ["b1"]


def test_start_and_pull_pulls_even_when_every_entry_was_dead_lettered(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = make_intake(r, settings)
    r.xadd(NORMAL, {"id": "bad", "d": b"not json"})
    entries = intake.pull(1)
    enqueue(r, keys, make_request("n1"))
    jobs, report, pulled = intake.start_and_pull(entries, (), 3)
    assert jobs == [] and report.dead_lettered == [Priority.NORMAL]
    assert [e.raw_id for e in pulled] == ["n1"]


class Spy:
    """Counts calls of some of an ``Intake``'s methods (the reader calls them by attribute)."""

    def __init__(self, intake: Intake, names: tuple[str, ...]) -> None:
        self.calls: dict[str, int] = dict.fromkeys(names, 0)
        for name in names:
            setattr(intake, name, self._wrap(name, getattr(intake, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


@pytest.fixture
def reader_and_spy(r: redis.Redis, settings: Settings) -> Iterator[tuple[IntakeReader, Spy]]:
    intake = make_intake(r, settings)
    spy = Spy(intake, ("pull", "wait", "start_and_pull"))
    reader = IntakeReader(intake, block_ms=5_000, busy_block_ms=5_000).start()
    try:
        yield reader, spy
    finally:
        reader.stop()


def test_a_lone_arrival_costs_the_wait_and_one_start_round_trip(
    reader_and_spy: tuple[IntakeReader, Spy], r: redis.Redis, keys: Keys
) -> None:
    reader, spy = reader_and_spy
    reader.grant(10, idle=True)
    wait_for(lambda: spy.calls["wait"] == 1, "the reader to block in its first wait")
    assert spy.calls["pull"] == 1  # the first read pulls: what waits from before is taken
    for i in range(3):
        enqueue(r, keys, make_request(f"g{i}"))
        got: list[Job] = []
        while not got:
            got = reader.take(10.0).jobs
        assert [j.request_id for j in got] == [f"g{i}"]
        reader.grant(9 - i, idle=False)
    wait_for(lambda: spy.calls["wait"] == 4, "the reader to block again")
    # each arrival: the wait's reply, then START with the follow-up pull; no pull of its own
    assert spy.calls == {"pull": 1, "wait": 4, "start_and_pull": 3}


def test_a_burst_is_read_by_the_wait_and_the_start_round_trips_within_the_allowance(
    reader_and_spy: tuple[IntakeReader, Spy], r: redis.Redis, keys: Keys
) -> None:
    reader, spy = reader_and_spy
    reader.grant(4, idle=True)
    wait_for(lambda: spy.calls["wait"] == 1, "the reader to block in its first wait")
    for i in range(5):
        r.hset(keys.record(f"b{i}"), mapping={"status": "queued", "stream_id": f"{i + 1}-0"})
    pipe = r.pipeline(transaction=True)  # five arrivals at once: the wait wakes on the first
    for i in range(5):
        entry: dict[Any, Any] = {"id": f"b{i}", "d": make_request(f"b{i}").encode(), "dl": ""}
        pipe.xadd(NORMAL, entry, id=f"{i + 1}-0")
    pipe.execute()
    got: list[str] = []
    while len(got) < 4:
        got += [j.request_id for j in reader.take(10.0).jobs]
    assert got == ["b0", "b1", "b2", "b3"]
    assert r.xpending(NORMAL, CONSUMER_GROUP)["pending"] == 4  # b4 waits for room, in Redis
    reader.grant(1, idle=False)
    while len(got) < 5:
        got += [j.request_id for j in reader.take(10.0).jobs]
    assert got[4] == "b4"
