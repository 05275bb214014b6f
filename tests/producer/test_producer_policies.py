"""Each overflow policy at its bound, on the real server."""

from __future__ import annotations

import threading

import pytest
import redis
from waiting import wait_for

from tokenfleet.producer import Client, Overloaded, RequestFailed
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.queue_config import OverflowPolicy, QueueConfig

STREAM_PRIORITY = Priority.NORMAL


def _waiting(client: Client) -> int:
    (row,) = [q for q in client.queue_stats() if q.priority == "normal"]
    return row.waiting


def _fill(client: Client, n: int) -> list[str]:
    return [client.submit("fill", max_tokens=4).request_id for _ in range(n)]


def test_default_config_when_none_is_stored(client: Client) -> None:
    assert client.queue_config("normal") == QueueConfig(10_000, OverflowPolicy.DROP_NEWEST)
    client.submit("x")
    (row,) = client.queue_stats()
    assert (row.waiting, row.max_waiting, row.policy, row.configured) == (
        1,
        10_000,
        OverflowPolicy.DROP_NEWEST,
        False,
    )


def test_drop_newest_refuses_and_stores_nothing(client: Client, r: redis.Redis, keys: Keys) -> None:
    client.set_queue_config("normal", max_waiting=3, policy="drop_newest")
    handles = [client.submit("fill") for _ in range(3)]
    ids = [h.request_id for h in handles]
    before = r.xlen(keys.stream("default", STREAM_PRIORITY))
    with pytest.raises(Overloaded, match="full"):
        client.submit("one too many", request_id="refused-1")
    assert not r.exists(keys.record("refused-1"))
    assert r.xlen(keys.stream("default", STREAM_PRIORITY)) == before
    assert [client.status(i).status.value for i in ids] == ["queued"] * 3
    assert client._subscriber.num_channels == 3  # the refused call released its own


def test_drop_oldest_evicts_the_oldest_waiting_request(client: Client, r: redis.Redis) -> None:
    client.set_queue_config("normal", max_waiting=2, policy="drop_oldest")
    first = client.submit("a")
    second = client.submit("b")
    third = client.submit("c")
    assert _waiting(client) == 2
    with pytest.raises(RequestFailed) as failed:
        first.result(timeout=10)
    assert (failed.value.status, failed.value.code) == ("dropped", "dropped")
    events = list(client.handle(first.request_id).stream())
    assert [e.to_dict()["type"] for e in events] == ["dropped"]  # exactly one terminal event
    assert client.status(second.request_id).status.value == "queued"
    assert client.status(third.request_id).status.value == "queued"


def test_running_requests_do_not_count(client: Client, r: redis.Redis, keys: Keys) -> None:
    client.set_queue_config("normal", max_waiting=2, policy="drop_newest")
    _fill(client, 2)
    stream = keys.stream("default", STREAM_PRIORITY)
    r.xreadgroup(CONSUMER_GROUP, "w1", {stream: ">"}, count=2)  # both now delivered (running)
    _fill(client, 2)  # room again: only waiting requests count
    assert r.xlen(stream) == 4
    with pytest.raises(Overloaded):
        client.submit("x")


def test_drop_oldest_never_evicts_a_running_request(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    client.set_queue_config("normal", max_waiting=1, policy="drop_oldest")
    running = client.submit("running")
    stream = keys.stream("default", STREAM_PRIORITY)
    r.xreadgroup(CONSUMER_GROUP, "w1", {stream: ">"}, count=1)
    waiting = client.submit("waiting")
    client.submit("newest")
    assert client.status(running.request_id).status.value == "queued"  # untouched entry
    assert client.status(waiting.request_id).status.value == "dropped"


def test_try_submit_refuses_whatever_the_policy(client: Client) -> None:
    for policy in OverflowPolicy:
        client.set_queue_config("batch", max_waiting=1, policy=policy.value)
        if policy is OverflowPolicy.DROP_NEWEST:
            client.try_submit("x", priority="batch")
        with pytest.raises(Overloaded):
            client.try_submit("y", priority="batch")
    (row,) = [q for q in client.queue_stats() if q.priority == "batch"]
    assert row.waiting == 1  # drop_oldest did not evict for try_submit


def test_block_waits_then_times_out(client: Client) -> None:
    client.set_queue_config("normal", max_waiting=1, policy="block")
    _fill(client, 1)
    with pytest.raises(Overloaded):
        client.submit("x", timeout=0.2)
    with pytest.raises(Overloaded):
        client.try_submit("x")
    assert _waiting(client) == 1


def test_block_submit_proceeds_when_room_appears(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    client.set_queue_config("normal", max_waiting=1, policy="block")
    _fill(client, 1)
    stream = keys.stream("default", STREAM_PRIORITY)
    done: list[str] = []

    def blocked_submit() -> None:
        done.append(client.submit("patient", timeout=30).request_id)

    def enqueue_calls() -> int:
        return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    before = enqueue_calls()
    thread = threading.Thread(target=blocked_submit)
    thread.start()
    wait_for(  # until the submitter has been refused at least once
        lambda: enqueue_calls() >= before + 2, "a refused submit", timeout_s=30, poll_s=0.005
    )
    assert enqueue_calls() >= before + 2 and not done
    r.xreadgroup(CONSUMER_GROUP, "w1", {stream: ">"}, count=1)  # frees the slot
    thread.join(30)
    assert len(done) == 1
    assert client.status(done[0]).status.value == "queued"


def test_queue_config_is_validated(client: Client) -> None:
    from tokenfleet.producer import InvalidRequest

    with pytest.raises(InvalidRequest, match="unknown policy"):
        client.set_queue_config("normal", policy="drop_random")
    with pytest.raises(InvalidRequest, match="max_waiting"):
        client.set_queue_config("normal", max_waiting=-1)
