"""The queue's tenant backlog (``Keys.tenant_backlog``, docs/fairness.md "KEDA"), against a real
Redis: at every step the shared stream's lag (``XINFO GROUPS``, what KEDA's redis-streams scaler
reads) plus the backlog list's length (what its ``redis`` list trigger reads) is exactly the
number of requests really waiting: records still ``queued`` whose entry no worker has read.
Floods, admission, a tenant's own bound, cancel, deadline expiry (by a client, at admission, by a
full queue's reclaim), drop-oldest eviction and a handback all keep it; the list goes once no
tenant waits. With real workers and a worker killed mid-run: tests/worker/test_fairness.py."""

from __future__ import annotations

from typing import Any

import redis
from keda_figure import keda_and_waiting
from tenant_helpers import MODEL, NORMAL, enqueue, next_millisecond, streams

from tokenfleet.producer.client import Client
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.worker import HANDBACK
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.jobs import Entry


class Scenario:
    """One queue driven through the scripts; :meth:`step` records KEDA's figure and what really
    waits after each step."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self.streams = streams(r, keys)
        self.ids: list[str] = []
        self.figures: list[tuple[str, int, int]] = []

    def submit(self, tenant: str, n: int, **kwargs: Any) -> list[Any]:
        new = [f"{tenant}{len(self.ids) + i}" for i in range(n)]
        self.ids.extend(new)
        return enqueue(self.r, self.keys, tenant, new, **kwargs)

    def step(self, what: str) -> int:
        keda, waiting = keda_and_waiting(self.r, self.keys, MODEL, NORMAL, self.ids)
        self.figures.append((what, keda, waiting))
        return waiting

    def status(self, rid: str) -> str:
        return as_str(self.r.hget(self.keys.record(rid), "status")) or ""

    def check(self) -> None:
        """Every step agreed, and once nothing waits the tenant keys are gone."""
        self.streams.pull(50)
        assert self.step("a worker read the rest") == 0
        assert not self.r.exists(self.keys.tenants_active(MODEL, NORMAL))
        assert not self.r.exists(self.keys.tenant_backlog(MODEL, NORMAL))  # the list goes too
        assert [(w, k) for w, k, n in self.figures if k != n] == [], self.figures


def handback(r: redis.Redis, keys: Keys, e: Entry) -> None:
    rid = as_str(e.fields["id"]) or ""
    r.hset(keys.record(rid), mapping={"status": "running", "worker": "w1"})  # (as START does)
    k = [keys.record(rid), e.stream, keys.stream(MODEL, NORMAL)]
    a: list[str | bytes | int] = [rid, "w1", e.entry_id, CONSUMER_GROUP, b"{}", e.tenant]
    a.append(e.prompt_tokens)
    assert registry.call(r, HANDBACK, k, a)[0] == "ok"


def test_lag_plus_backlog_is_what_waits_through_floods_cancel_expiry_and_handback(
    r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    q = Scenario(r, keys)
    q.submit("default", 10)
    q.step("the default tenant alone: its requests in the shared stream")
    r.hset(keys.tenant_book(MODEL), "max|acme", 8)
    q.submit("acme", 6)
    q.step("a first other tenant: the default backlog moved to its tenant queue")
    q.submit("globex", 5)
    q.step("a third tenant")
    assert b"overloaded" in q.submit("acme", 5)  # acme's own bound refused some
    q.step("acme's own bound refused the rest")
    pulled = q.streams.pull(4)
    q.step("a worker read 4 (admitted from the tenant queues)")
    with Client(r, settings=settings) as client:
        globex = [
            rid
            for rid in q.ids
            if as_str(r.hget(keys.record(rid), "tenant_queued")) == "1" and rid.startswith("globex")
        ]
        assert client.cancel(globex[0]) and client.cancel(globex[1])
        q.step("two cancelled while in a tenant queue")
        q.submit("initech", 2, deadline=2.0)  # due at 2.0: overdue for any real clock
        waiting = q.step("two with a deadline wait")
        (row,) = [x for x in client.fleet_status()["queues"] if x["priority"] == "normal"]
        backlog = keys.tenant_backlog(MODEL, NORMAL)
        assert (row["tenant_backlog"], row["lag"] + row["tenant_backlog_length"]) == (
            backlog,
            waiting,
        )  # what status --json prints: KEDA's two figures
        assert client.status(q.ids[-1]).status.value == "expired"
        q.step("a client expired one in its tenant queue")
    q.streams.pull(30)  # admission meets the other overdue one: expired there
    assert q.status(q.ids[-2]) == "expired"
    q.step("a worker read everything else; the overdue one expired at admission")
    for e in pulled[:2]:  # a handback puts two back, undelivered
        handback(r, keys, e)
    q.step("two handed back")
    assert max(n for _w, _k, n in q.figures) >= 20  # (the checks ran with work waiting)
    q.check()


def test_lag_plus_backlog_is_what_waits_through_eviction_and_reclaim(
    r: redis.Redis, keys: Keys
) -> None:
    q = Scenario(r, keys)
    # drop-oldest evicting from a tenant queue: zeta's requests (a tenant served much already)
    # wait longest, while the shared stream holds a newer one of young's (less served)
    q.submit("young", 1)  # admitted: the wake-up entry
    r.hset(keys.tenant_book(MODEL), "vt|zeta", 1000)
    q.submit("zeta", 2)
    r.xreadgroup(CONSUMER_GROUP, "w1", {keys.stream(MODEL, NORMAL): ">"}, count=1)
    next_millisecond(r)
    q.submit("young", 1)  # admitted (least virtual time), newer than zeta's
    r.hset(keys.queue_config(MODEL, NORMAL), mapping={"max_waiting": 3, "policy": "drop_oldest"})
    q.step("zeta's two wait in its tenant queue, young's one in the shared stream")
    q.submit("young", 1)
    assert q.status(q.ids[-4]) == "dropped"  # zeta's first
    q.step("a drop-oldest queue evicted from a tenant queue")
    r.hset(keys.queue_config(MODEL, NORMAL), "max_waiting", 4)
    q.submit("zeta", 1, deadline=2.0)
    q.step("the queue is full, one overdue in a tenant queue")
    q.submit("young", 1, now=3.0)
    assert q.status(q.ids[-2]) == "expired"  # reclaimed
    q.step("a full queue reclaimed the overdue one from its tenant queue")
    q.check()
