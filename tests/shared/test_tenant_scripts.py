"""Fair admission between tenants, at the script level (docs/fairness.md): the enqueue script's
tenant queues and the worker's ``PULL`` admitting from them by virtual time, against a real
Redis. Real workers and the fairness figures: tests/worker/test_fairness.py."""

from __future__ import annotations

from typing import Any

import redis
from tenant_helpers import MODEL, NORMAL, enqueue, streams

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.cancel import CANCEL
from tokenfleet.shared.scripts.enqueue import ENQUEUE, EnqueueItem, enqueue_keys_args
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args
from tokenfleet.worker.intake.streams import PriorityStreams


def pulled_tenants(s: PriorityStreams, budget: int) -> list[str]:
    return [e.tenant for e in s.pull(budget)]


def vt(r: redis.Redis, keys: Keys, tenant: str) -> float:
    return float(r.hget(keys.tenant_book(MODEL), f"vt|{tenant}") or 0)


def test_the_default_tenant_alone_writes_no_tenant_key(r: redis.Redis, keys: Keys) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "default", ["a", "b"])
    assert r.xlen(keys.stream(MODEL, NORMAL)) == 2
    assert not r.exists(keys.tenants_active(MODEL, NORMAL), keys.tenant_book(MODEL))
    assert r.hget(keys.record("a"), "tenant") is None
    assert [e.tenant for e in s.pull(5)] == ["", ""]


def test_a_tenant_waits_in_its_queue_and_one_is_admitted_to_wake_a_worker(
    r: redis.Redis, keys: Keys
) -> None:
    streams(r, keys)
    enqueue(r, keys, "acme", ["a1", "a2", "a3"])
    shared: Any = r.xrange(keys.stream(MODEL, NORMAL))
    assert [as_str(f[b"id"]) for _, f in shared] == ["a1"]  # admitted: shared had nothing
    assert as_str(shared[0][1][b"t"]) == "acme"
    assert r.xlen(keys.tenant_queue(MODEL, NORMAL, "acme")) == 2
    assert as_str(r.hget(keys.record("a1"), "stream_id")) == as_str(shared[0][0])
    assert as_str(r.hget(keys.record("a2"), "tenant")) == "acme"
    assert vt(r, keys, "acme") == 10.0  # a1's prompt, charged at admission


def test_equal_weights_alternate_and_a_flood_does_not_delay_a_newcomer(
    r: redis.Redis, keys: Keys
) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "heavy", [f"h{i}" for i in range(50)])
    assert pulled_tenants(s, 4) == ["heavy"] * 4  # alone: it takes everything (work-conserving)
    enqueue(r, keys, "light", ["l0", "l1", "l2"])
    got = [pulled_tenants(s, 1)[0] for _ in range(3)]
    # ahead of light's first: the entry already admitted (to wake a worker), and one more when
    # the two tie (lifted to heavy's time, a tie goes by name); never the rest of the flood
    assert got[2] == "light" and got[:2] == ["heavy", "heavy"]
    rest = pulled_tenants(s, 6)
    assert rest.count("light") == 2 and rest.count("heavy") == 4  # light's last two, shared
    assert r.xlen(keys.tenant_queue(MODEL, NORMAL, "light")) == 0


def test_weights_set_the_shares(r: redis.Redis, keys: Keys) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "one", [f"o{i}" for i in range(40)], weight=1)
    enqueue(r, keys, "three", [f"t{i}" for i in range(40)], weight=3)
    got = pulled_tenants(s, 40)
    # 1:3 up to the one admission decided ahead (the wake-up entry) and ties
    assert abs(got.count("one") - 10) <= 1 and got.count("one") + got.count("three") == 40


def test_a_returning_tenant_is_lifted_to_the_least_active_time(r: redis.Redis, keys: Keys) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "busy", [f"b{i}" for i in range(30)])
    pulled_tenants(s, 20)  # busy is served alone: its virtual time grows, idle's stays 0
    enqueue(r, keys, "idle", ["i0", "i1", "i2", "i3", "i4", "i5"])
    assert vt(r, keys, "idle") >= vt(r, keys, "busy") - 10.0  # lifted: no banked credit
    got = pulled_tenants(s, 8)
    assert got.count("idle") <= 5  # no burst: it shares from where busy stands


def test_a_request_cancelled_while_waiting_is_skipped_uncharged(r: redis.Redis, keys: Keys) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "acme", ["a1", "a2", "a3"])
    event = TerminalEvent("a2", TerminalStatus.CANCELLED, message="x")
    k = [
        keys.record("a2"),
        keys.tokens("a2"),
        keys.channel("a2"),
        keys.stream(MODEL, NORMAL),
        keys.cancel_set,
        keys.tally,
    ]
    a: list[Any] = ["a2", event.encode(), "2.0", "600", CONSUMER_GROUP, "cancelled", "PUBLISH"]
    assert registry.call(r, CANCEL, k, a) == ["ok"]
    assert [as_str(e.fields["id"]) for e in s.pull(5)] == ["a1", "a3"]
    assert vt(r, keys, "acme") == 20.0  # a1 and a3 only
    assert not r.exists(keys.tenants_active(MODEL, NORMAL))  # its queue is empty: inactive


def test_a_tenant_bound_and_the_queue_bound_count_tenant_queues(r: redis.Redis, keys: Keys) -> None:
    streams(r, keys)
    r.hset(keys.queue_config(MODEL, NORMAL), mapping={"max_waiting": 5, "policy": "drop_newest"})
    r.hset(keys.tenant_book(MODEL), "max|small", 2)
    reply = enqueue(r, keys, "small", ["s1", "s2", "s3", "s4"])
    # s1, s2 wait in its queue (then s1 is admitted to wake a worker); s3, s4 are past its bound
    assert [reply[1], reply[2], reply[4], reply[5]] == [3, b"overloaded", 4, b"overloaded"]
    assert "its own bound" in str(as_str(reply[3])) and "small" in str(as_str(reply[3]))
    assert r.xlen(keys.tenant_queue(MODEL, NORMAL, "small")) == 1
    reply = enqueue(r, keys, "big", ["b1", "b2", "b3", "b4"])
    # waiting: s1 (shared) + s2 (small's queue) + b1..b3 = the queue's bound of 5
    assert reply[:3] == ["ok", 4, b"overloaded"] and "is full" in str(as_str(reply[3]))


def test_the_first_other_tenant_moves_the_default_backlog_to_its_queue(
    r: redis.Redis, keys: Keys
) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "default", [f"d{i}" for i in range(20)])
    assert r.xlen(keys.stream(MODEL, NORMAL)) == 20
    enqueue(r, keys, "other", ["o1"])
    assert r.xlen(keys.tenant_queue(MODEL, NORMAL, "default")) >= 19
    got = pulled_tenants(s, 4)
    assert "other" in got  # not behind 20 default requests
    rec = r.hgetall(keys.record("d19"))
    assert as_str(rec[b"tenant"]) == "default"


def test_finish_counts_served_tokens_once_and_charges_the_output(
    r: redis.Redis, keys: Keys
) -> None:
    s = streams(r, keys)
    enqueue(r, keys, "acme", ["a1", "a2"])
    (entry,) = s.pull(1)
    r.hset(keys.record("a1"), mapping={"status": "running", "worker": "w1"})
    before = vt(r, keys, "acme")
    event = TerminalEvent("a1", TerminalStatus.DONE, finish_reason="length", num_tokens=7)
    k, a = finish_keys_args(
        keys,
        event,
        model=MODEL,
        priority=NORMAL,
        now=3.0,
        ttl_s=60,
        stream_id=entry.entry_id,
        owner="w1",
        tenant=entry.tenant,
        prompt_tokens=entry.prompt_tokens,
    )
    assert registry.call(r, FINISH, k, a) == ["ok"]
    assert registry.call(r, FINISH, k, a)[0] == "already"  # a second end counts nothing
    book = keys.tenant_book(MODEL)
    assert int(r.hget(book, "served|acme") or 0) == 17  # 10 prompt + 7 output, once
    assert vt(r, keys, "acme") == before + 7


def next_millisecond(r: redis.Redis) -> None:
    """Return once Redis's clock has passed the millisecond it reads now: ids of entries added
    after it are later than those added before in every stream (each stream numbers the entries
    of one millisecond on its own, so two streams' ids of the same millisecond do not compare)."""
    sec, us = r.time()
    start = sec * 1000 + us // 1000
    while True:
        sec, us = r.time()
        if sec * 1000 + us // 1000 > start:
            return


def test_drop_oldest_evicts_the_oldest_wherever_it_waits(r: redis.Redis, keys: Keys) -> None:
    streams(r, keys)
    r.hset(keys.queue_config(MODEL, NORMAL), mapping={"max_waiting": 3, "policy": "drop_oldest"})
    enqueue(r, keys, "early", ["e1", "e2"])  # e1 admitted (wake-up), e2 in early's queue
    next_millisecond(r)
    enqueue(r, keys, "late", ["x1"])
    assert enqueue(r, keys, "late", ["x2"]) == ["ok"]  # full: the oldest (e1, shared) goes
    assert as_str(r.hget(keys.record("e1"), "status")) == "dropped"
    assert enqueue(r, keys, "late", ["x3"]) == ["ok"]  # then e2, from early's tenant queue
    assert as_str(r.hget(keys.record("e2"), "status")) == "dropped"
    assert r.xlen(keys.tenant_queue(MODEL, NORMAL, "early")) == 0


def test_a_full_queue_reclaims_expired_requests_from_tenant_queues(
    r: redis.Redis, keys: Keys
) -> None:
    streams(r, keys)
    r.hset(keys.queue_config(MODEL, NORMAL), mapping={"max_waiting": 2, "policy": "drop_newest"})
    items = [EnqueueItem(f"d{i}", b"{}", 1.5, tenant="late", prompt_tokens=1) for i in range(2)]
    k, a = enqueue_keys_args(keys, MODEL, NORMAL, items, now=1.0, ttl_s=600)
    registry.call(r, ENQUEUE, k, a)  # d0 admitted, d1 waits in its queue; both due at 1.5
    items = [EnqueueItem("n1", b"{}", None, tenant="other", prompt_tokens=1)]
    k, a = enqueue_keys_args(keys, MODEL, NORMAL, items, now=2.0, ttl_s=600)
    assert registry.call(r, ENQUEUE, k, a) == ["ok"]
    assert as_str(r.hget(keys.record("d1"), "status")) == "expired"
    assert r.xlen(keys.tenant_queue(MODEL, NORMAL, "late")) == 0


def test_a_handback_keeps_the_tenant_and_charges_nothing(r: redis.Redis, keys: Keys) -> None:
    from tokenfleet.shared.scripts.worker import HANDBACK

    s = streams(r, keys)
    enqueue(r, keys, "acme", ["a1"])
    (entry,) = s.pull(1)
    r.hset(keys.record("a1"), mapping={"status": "running", "worker": "w1"})
    charged = vt(r, keys, "acme")
    k = [keys.record("a1"), entry.stream, keys.stream(MODEL, NORMAL)]
    a: list[Any] = ["a1", "w1", entry.entry_id, CONSUMER_GROUP, b"{}", entry.tenant]
    a.append(entry.prompt_tokens)
    assert registry.call(r, HANDBACK, k, a)[0] == "ok"
    (again,) = s.pull(1)
    assert (again.tenant, again.prompt_tokens, again.fields.get("h")) == ("acme", 10, b"1")
    assert vt(r, keys, "acme") == charged
    assert int(r.hget(keys.tenant_book(MODEL), "admitted|acme") or 0) == 1


def _redis_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_an_overflow_worker_admits_aged_tenant_heads_fairly_and_takes_them(
    r: redis.Redis, keys: Keys
) -> None:
    """An overflow worker's take (``OVERFLOW``, worker_overflow.lua) also admits, least virtual
    time first and charged as any admission, the tenant-queued requests whose queue's head has
    waited its threshold, and takes them in the same call; younger heads stay where they are."""
    from waiting import wait_for

    from tokenfleet.worker.intake.stealer import Stealer

    after_ms = 300
    s = streams(r, keys, "ov")
    overflow = Stealer(r, s, steal_after_ms=after_ms, overflow=True)
    enqueue(r, keys, "acme", ["a1", "a2", "a3"])  # a1 admitted at once (nothing waited)
    enqueue(r, keys, "beta", ["b1"])
    assert overflow.steal(10) == []  # nothing has waited 300 ms yet
    assert r.xlen(keys.tenant_queue(MODEL, NORMAL, "acme")) == 2
    since = _redis_ms(r)
    wait_for(lambda: _redis_ms(r) - since > after_ms, "Redis's clock to pass the threshold")
    enqueue(r, keys, "young", ["y1"])  # its head has not waited
    before = {t: vt(r, keys, t) for t in ("acme", "beta")}
    taken = overflow.steal(10)
    # a1 (admitted, as old as its enqueue), then by virtual time: acme 10 and beta lifted to 10
    # (a tie: by name), acme 20 against beta 10, then a tie again
    assert [as_str(e.fields["id"]) for e in taken] == ["a1", "a2", "b1", "a3"]
    assert {e.stream for e in taken} == {keys.stream(MODEL, NORMAL)}
    assert all(e.route == "overflow:ov" for e in taken)
    assert (vt(r, keys, "acme"), vt(r, keys, "beta")) == (before["acme"] + 20, before["beta"] + 10)
    assert r.xlen(keys.tenant_queue(MODEL, NORMAL, "young")) == 1
    assert r.xlen(keys.tenant_queue(MODEL, NORMAL, "acme")) == 0
    assert not r.zscore(keys.tenants_active(MODEL, NORMAL), "acme")
    assert as_str(r.hget(keys.record("a3"), "stream_id")) == taken[-1].entry_id
    pending: Any = r.xpending_range(keys.stream(MODEL, NORMAL), CONSUMER_GROUP, "-", "+", 10)
    assert {as_str(p["consumer"]) for p in pending} == {"ov"}
    assert overflow.steal(10) == []  # y1 still young
