"""Reading the intake's streams against the real server, in process: priority order,
anti-starvation, budgets."""

from __future__ import annotations

import redis
from worker_helpers import make_intake

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.streams import PriorityStreams


def _intake(r: redis.Redis, settings: Settings, starvation_pulls: int = 3) -> PriorityStreams:
    intake = make_intake(r, settings, priorities=list(Priority), starvation_pulls=starvation_pulls)
    streams: PriorityStreams = intake.streams
    return streams


def _fill(r: redis.Redis, keys: Keys, priority: Priority, n: int) -> None:
    for i in range(n):
        r.xadd(keys.stream("default", priority), {"id": f"{priority.label}-{i}", "d": b"{}"})


def test_groups_are_created_once_and_queues_registered(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    _intake(r, settings)
    _intake(r, settings)  # BUSYGROUP is fine
    for p in Priority:
        groups = r.xinfo_groups(keys.stream("default", p))
        assert [g["name"] for g in groups] == [CONSUMER_GROUP.encode()]
    assert r.smembers(keys.queues) == {f"default|{p.label}".encode() for p in Priority}


def test_pull_takes_the_most_urgent_first_within_the_budget(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = _intake(r, settings)
    _fill(r, keys, Priority.BATCH, 3)
    _fill(r, keys, Priority.NORMAL, 2)
    _fill(r, keys, Priority.CRITICAL, 1)
    got = intake.pull(4)
    assert [e.priority for e in got] == [
        Priority.CRITICAL,
        Priority.NORMAL,
        Priority.NORMAL,
        Priority.BATCH,
    ]
    assert intake.pull(0) == []
    # what was not pulled stays in Redis, undelivered, for other workers
    pending = r.xpending(keys.stream("default", Priority.BATCH), CONSUMER_GROUP)["pending"]
    assert pending == 1 and r.xlen(keys.stream("default", Priority.BATCH)) == 3


def test_a_waiting_lower_level_is_served_at_least_every_n_pulls(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = _intake(r, settings, starvation_pulls=3)
    _fill(r, keys, Priority.CRITICAL, 20)
    _fill(r, keys, Priority.BATCH, 2)
    served = [intake.pull(1)[0].priority for _ in range(8)]
    # pulls 1-3 skip batch; pull 4 reads it first; then 3 more skips; pull 8 again
    assert served == [Priority.CRITICAL] * 3 + [Priority.BATCH] + [Priority.CRITICAL] * 3 + [
        Priority.BATCH
    ]


def test_a_deleted_stream_is_recreated_instead_of_crashing(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = _intake(r, settings)
    r.flushall()
    assert intake.pull(5) == []  # NOGROUP: groups recreated
    _fill(r, keys, Priority.NORMAL, 1)
    assert len(intake.pull(5)) == 1


def test_a_vanished_stream_does_not_lose_what_the_pull_read(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = _intake(r, settings)
    _fill(r, keys, Priority.CRITICAL, 1)
    r.delete(keys.stream("default", Priority.NORMAL))  # read after critical, in the same PULL
    got = intake.pull(5)
    assert [e.raw_id for e in got] == ["critical-0"]  # read, so returned: it is ours now
    assert r.xinfo_groups(keys.stream("default", Priority.NORMAL))  # recreated


def test_a_capped_level_is_read_up_to_its_cap_and_left_out_of_blocking_reads(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = _intake(r, settings, starvation_pulls=2)
    _fill(r, keys, Priority.BATCH, 3)
    _fill(r, keys, Priority.NORMAL, 1)
    intake.caps[Priority.BATCH] = 1
    got = intake.pull(10)
    assert [e.priority for e in got] == [Priority.NORMAL, Priority.BATCH]
    assert intake.caps[Priority.BATCH] == 0  # lowered by what was read
    for _ in range(3):  # held back at 0: nothing read, and not counted as starved
        assert intake.pull(10) == []
    assert intake.order()[0] is Priority.CRITICAL
    read = intake.send_read(10, block_ms=50)  # blocking: the capped level is left out
    assert not read.narrowed()
    intake.caps[Priority.BATCH] = 5
    assert read.narrowed()  # the reader cancels such a read and reads again
    assert read.receive() == []  # (the batch entries waiting did not answer it)
    assert intake.send_read(10, block_ms=5000).receive()[0].priority is Priority.BATCH
