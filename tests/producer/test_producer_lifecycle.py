"""Idempotent ids, deadlines (and where waiting requests expire), cancel, status, handles."""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import redis
from producer_helpers import FakeWorker
from waiting import wait_for

from tokenfleet.producer import Client, Overloaded, RequestFailed, UnknownRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalStatus, TokenEvent
from tokenfleet.shared.settings import Settings

STREAM = ("default", Priority.NORMAL)


def test_client_supplied_id_is_idempotent(client: Client, r: redis.Redis, keys: Keys) -> None:
    first = client.submit("hello", request_id="order-42")
    again = client.submit("hello", request_id="order-42")  # the same request (issue 15: a
    assert again.request_id == first.request_id == "order-42"  # different one is refused)
    [from_many] = client.submit_many([{"prompt": "hello", "request_id": "order-42"}])
    assert not isinstance(from_many, Exception) and from_many.request_id == "order-42"
    assert r.xlen(keys.stream(*STREAM)) == 1


def test_resubmitting_a_finished_id_returns_its_result(client: Client, worker: FakeWorker) -> None:
    client.submit("hello", request_id="job-1")
    worker.serve(["ok"])
    assert client.submit("hello", request_id="job-1").result(timeout=10).text == "ok"


def test_generated_ids_are_unique(client: Client) -> None:
    handles = client.submit_many(["x"] * 300)
    ids = {h.request_id for h in handles if not isinstance(h, Exception)}
    assert len(ids) == 300


def test_submit_many_reports_refusals_in_order(client: Client) -> None:
    client.set_queue_config("batch", max_waiting=2, policy="block")
    out = client.submit_many([{"prompt": str(i), "priority": "batch"} for i in range(4)] + ["n"])
    assert [type(x).__name__ for x in out] == [
        "Handle",
        "Handle",
        "Overloaded",
        "Overloaded",
        "Handle",
    ]


def _past(deadline: float) -> None:
    """Until the wall clock is past ``deadline`` (a request's, in epoch seconds)."""
    wait_for(lambda: time.time() > deadline, "the deadline to pass", poll_s=0.01)


def test_waiting_request_expires_for_a_waiting_caller(client: Client) -> None:
    handle = client.submit("late", deadline_s=0.3)
    with pytest.raises(RequestFailed) as failed:
        handle.result(timeout=20)  # no worker: the handle itself expires it at the deadline
    assert failed.value.status == "expired"
    record = client.status(handle.request_id)
    assert record.status.value == "expired" and record.code == "expired"


def test_status_expires_an_overdue_request(client: Client, r: redis.Redis, keys: Keys) -> None:
    rid = client.submit("late", deadline_s=0.05).request_id
    gc.collect()
    _past(float(r.hget(keys.record(rid), "deadline") or 0))
    assert client.status(rid).status.value == "expired"
    assert r.xlen(keys.stream(*STREAM)) == 0  # its entry is gone


def test_full_queue_reclaims_expired_waiting_requests(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    client.set_queue_config("normal", max_waiting=2, policy="drop_newest")
    stale = client.submit("stale", deadline_s=0.05)
    fresh = client.submit("fresh")
    _past(float(r.hget(keys.record(stale.request_id), "deadline") or 0))
    newest = client.submit("newest")  # the full queue expires the stale one to make room
    assert r.hget(keys.record(stale.request_id), "status") == b"expired"
    with pytest.raises(RequestFailed, match="expired"):
        stale.result(timeout=10)
    assert client.status(fresh.request_id).status.value == "queued"
    assert client.status(newest.request_id).status.value == "queued"
    with pytest.raises(Overloaded):
        client.submit("one more")


def test_deadline_does_not_touch_started_requests(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("x", deadline_s=0.2)
    rid = worker.take()
    _past(client.status(rid).deadline or 0)  # past the deadline while running: must not expire
    assert client.status(rid).status.value == "running"
    worker.emit(rid, 0, ["y"])
    worker.finish(rid, num_tokens=1)
    assert handle.result(timeout=10).text == "y"


def test_cancel_queued_running_finished_unknown(
    client: Client, worker: FakeWorker, r: redis.Redis, keys: Keys
) -> None:
    queued = client.submit("q")
    assert queued.cancel() is True
    with pytest.raises(RequestFailed) as failed:
        queued.result(timeout=10)
    assert failed.value.code == "cancelled"
    assert r.xlen(keys.stream(*STREAM)) == 0

    running = client.submit("r")
    rid = worker.take()
    assert client.cancel(rid) is True
    assert r.sismember(keys.cancel_set, rid)
    worker.finish(rid, TerminalStatus.CANCELLED, num_tokens=0)
    with pytest.raises(RequestFailed, match="cancelled"):
        running.result(timeout=10)
    assert client.cancel(rid) is False  # already over
    with pytest.raises(UnknownRequest):
        client.cancel("never-submitted")
    with pytest.raises(UnknownRequest):
        client.status("never-submitted")
    with pytest.raises(UnknownRequest):
        client.handle("never-submitted").result(timeout=5)


def test_error_terminal_carries_its_code(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("x")
    rid = worker.take()
    worker.finish(rid, TerminalStatus.ERROR, num_tokens=0)
    with pytest.raises(RequestFailed) as failed:
        handle.result(timeout=10)
    assert (failed.value.status, failed.value.code) == ("error", "worker_lost")


def test_handles_release_their_subscription(client: Client) -> None:
    with client.submit("a") as handle:
        assert client._subscriber.num_channels == 1
    assert client._subscriber.num_channels == 0
    handle = client.submit("b")
    assert client._subscriber.num_channels == 1
    del handle
    gc.collect()
    assert client._subscriber.num_channels == 0


def test_a_closed_client_refuses_before_enqueueing(r: redis.Redis, settings: Settings) -> None:
    client = Client(r, settings=settings)
    client.close()
    with pytest.raises(redis.ConnectionError, match="closed"):
        client.submit("hi")
    assert r.dbsize() == 0  # the caller got an error, so no request may exist either


def test_record_fields_and_ttl(client: Client, r: redis.Redis, keys: Keys) -> None:
    handle = client.submit("x", deadline_s=60, metadata={"user": 7})
    record = client.status(handle.request_id)
    assert record.status.value == "queued" and record.num_tokens == 0
    assert record.enqueued_at is not None and record.deadline is not None
    assert record.deadline - record.enqueued_at == pytest.approx(60, abs=1)
    ttl = r.ttl(keys.record(handle.request_id))
    assert 0 < ttl <= client.settings.record_ttl_s


@pytest.mark.parametrize(
    "options", [{"decode_responses": True}, {"protocol": 3}], ids=["decoded", "resp3"]
)
def test_works_with_any_redis_client(
    redis_url: str, settings: Settings, worker: FakeWorker, options: dict[str, Any]
) -> None:
    conn = redis.Redis.from_url(redis_url, **options)
    with Client(conn, settings=settings) as client:
        client.set_queue_config("normal", max_waiting=1)
        handle = client.submit("x", request_id="any-client")
        with pytest.raises(Overloaded):
            client.submit("y")
        worker.serve(["o", "k"])
        assert [e.index for e in handle.stream() if isinstance(e, TokenEvent)] == [0, 1]
        assert client.handle("any-client").result(timeout=10).text == "ok"
        assert client.status("any-client").status.value == "done"
        assert [q.waiting for q in client.queue_stats()] == [0]
    conn.close()
