"""Cancel and deadline expiry of a request that waits in a tenant queue (docs/fairness.md),
against a real Redis: it leaves its tenant queue at once (the queue's and the tenant's own bound
are freed then, not at admission), it is never admitted nor charged, and it reaches exactly one
terminal state, on its channel and in its record. Admission itself never admits a request whose
deadline has passed: it ends it ``expired`` (the worker's ``PULL`` and the enqueue script's
wake-up admission alike)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import orjson
import redis
from tenant_helpers import MODEL, NORMAL, enqueue, streams

from tokenfleet.producer.client import Client
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import RequestStatus
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.streams import PriorityStreams

MARKER = b"end-of-test-events"


def pulled(s: PriorityStreams, budget: int) -> list[str]:
    return [as_str(e.fields["id"]) or "" for e in s.pull(budget)]


def vt(r: redis.Redis, keys: Keys, tenant: str) -> float:
    return float(r.hget(keys.tenant_book(MODEL), f"vt|{tenant}") or 0)


def admitted(r: redis.Redis, keys: Keys, tenant: str) -> int:
    return int(r.hget(keys.tenant_book(MODEL), f"admitted|{tenant}") or 0)


def status(r: redis.Redis, keys: Keys, rid: str) -> str:
    return as_str(r.hget(keys.record(rid), "status")) or ""


@contextmanager
def terminal_events(r: redis.Redis, keys: Keys, rid: str) -> Iterator[Callable[[], list[str]]]:
    """Listen on ``rid``'s channel; the callable returns the types of the events published on it
    since (up to a marker this test publishes last: Redis delivers one channel's messages in the
    order it ran the commands, so everything before the marker is everything published)."""
    sub = r.pubsub()
    sub.subscribe(keys.channel(rid))
    while sub.get_message(timeout=10.0) is None:  # the subscribe confirmation
        pass

    def events() -> list[str]:
        r.publish(keys.channel(rid), MARKER)
        types: list[str] = []
        while True:
            msg = sub.get_message(timeout=10.0)
            assert msg is not None, "the marker never came back"
            if msg["type"] != "message":
                continue
            if msg["data"] == MARKER:
                return types
            types.append(orjson.loads(msg["data"])["type"])

    try:
        yield events
    finally:
        sub.close()


def test_cancel_takes_a_request_out_of_its_tenant_queue_at_once(
    r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    s = streams(r, keys)
    r.hset(keys.tenant_book(MODEL), "max|acme", 2)
    enqueue(r, keys, "acme", ["a1", "a2"])  # a1 admitted (the wake-up entry), a2 waits
    enqueue(r, keys, "acme", ["a3"])
    queue = keys.tenant_queue(MODEL, NORMAL, "acme")
    assert r.xlen(queue) == 2
    assert enqueue(r, keys, "acme", ["a4"])[2] == b"overloaded"  # its own bound
    assert as_str(r.hget(keys.record("a3"), "tenant_queued")) == "1"
    with terminal_events(r, keys, "a3") as events, Client(r, settings=settings) as client:
        assert client.cancel("a3")
        assert r.xlen(queue) == 1  # out of its tenant queue now, not at admission
        assert enqueue(r, keys, "acme", ["a4"]) == ["ok"]  # the bound is free again
        assert pulled(s, 5) == ["a1", "a2", "a4"]
        assert not client.cancel("a3")  # already ended: nothing more
        assert events() == ["cancelled"]
    assert status(r, keys, "a3") == "cancelled"
    assert vt(r, keys, "acme") == 30.0 and admitted(r, keys, "acme") == 3  # a1, a2, a4: not a3
    assert not r.exists(keys.tenants_active(MODEL, NORMAL))


def test_a_cancelled_default_request_moved_to_its_tenant_queue_leaves_it(
    r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    streams(r, keys)
    enqueue(r, keys, "default", ["d1", "d2"])  # the shared stream: no tenant yet
    enqueue(r, keys, "other", ["o1"])  # d1, d2 move to the default tenant's queue
    queue = keys.tenant_queue(MODEL, NORMAL, "default")
    waiting = r.xlen(queue)
    assert waiting >= 1
    rid = next(
        rid for rid in ("d1", "d2") if as_str(r.hget(keys.record(rid), "tenant_queued")) == "1"
    )
    with Client(r, settings=settings) as client:
        assert client.cancel(rid)
    assert r.xlen(queue) == waiting - 1
    assert status(r, keys, rid) == "cancelled"


def test_an_overdue_request_leaves_its_tenant_queue_when_a_client_looks(
    r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "acme", ["a1"])  # admitted: the wake-up entry
    enqueue(r, keys, "acme", ["a2"], deadline=2.0)  # waits; overdue for any real clock
    queue = keys.tenant_queue(MODEL, NORMAL, "acme")
    assert r.xlen(queue) == 1
    with terminal_events(r, keys, "a2") as events, Client(r, settings=settings) as client:
        assert client.status("a2").status is RequestStatus.EXPIRED
        assert r.xlen(queue) == 0
        assert pulled(s, 5) == ["a1"]
        assert events() == ["expired"]
    assert vt(r, keys, "acme") == 10.0 and admitted(r, keys, "acme") == 1


def test_admission_ends_an_overdue_request_instead_of_admitting_it(
    r: redis.Redis, keys: Keys
) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "acme", ["a1"])
    enqueue(r, keys, "acme", ["a2"], deadline=2.0)
    enqueue(r, keys, "acme", ["a3"])
    with terminal_events(r, keys, "a2") as events:
        assert pulled(s, 5) == ["a1", "a3"]  # the worker's PULL met a2 past its deadline
        assert pulled(s, 5) == []
        assert events() == ["expired"]
    assert status(r, keys, "a2") == "expired"
    assert vt(r, keys, "acme") == 20.0 and admitted(r, keys, "acme") == 2
    ended = {as_str(k): as_str(v) for k, v in r.hgetall(keys.tally).items()}
    assert ended[f"{MODEL}|normal|expired"] == "1"


def test_the_enqueue_wake_up_admission_ends_an_overdue_head(r: redis.Redis, keys: Keys) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "acme", ["a1"])  # admitted: the wake-up entry
    enqueue(r, keys, "slow", ["y1"], now=1.0, deadline=2.0)  # waits behind a1
    r.xreadgroup(CONSUMER_GROUP, "w1", {keys.stream(MODEL, NORMAL): ">"}, count=1)  # a1 read
    with terminal_events(r, keys, "y1") as events:
        # nothing undelivered: the call admits one, least virtual time first (slow's y1, due)
        assert enqueue(r, keys, "acme", ["x2"], now=3.0) == ["ok"]
        assert events() == ["expired"]
    assert status(r, keys, "y1") == "expired"
    assert vt(r, keys, "slow") == 0.0 and admitted(r, keys, "slow") == 0
    assert pulled(s, 5) == ["x2"]  # admitted in y1's stead
