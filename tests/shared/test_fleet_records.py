"""What the scripts now keep for people to look at (the console, ``tokenfleet status``), against
the real server: each queue's ends per status (``Keys.tally``), the newest requests
(``Keys.recent``), a copy of every request that ends ``error`` in the dead-letter stream, and
when the oldest waiting request of a queue entered it."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from tokenfleet.producer import Client
from tokenfleet.shared import dead_letters
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import GenerationRequest, TerminalEvent, TerminalStatus
from tokenfleet.shared.scripts import enqueue, registry
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.tally import queue_ends

NORMAL = Priority.NORMAL


def _take(r: redis.Redis, keys: Keys, n: int = 1) -> list[tuple[str, str]]:
    """Deliver ``n`` entries of the normal queue to a pretend worker: (entry id, request id)."""
    reply: Any = r.xreadgroup(CONSUMER_GROUP, "w1", {keys.stream("default", NORMAL): ">"}, count=n)
    return [(e.decode(), f[b"id"].decode()) for e, f in reply[0][1]]


def _dead(r: redis.Redis, keys: Keys) -> list[dead_letters.DeadLetter]:
    entries: Any = r.xrange(keys.dead_letter)
    return dead_letters.parse_entries(entries)


def _finish(
    r: redis.Redis,
    keys: Keys,
    rid: str,
    entry: str,
    status: TerminalStatus,
    now: float,
    code: str | None = None,
) -> str:
    event = TerminalEvent(rid, status, code=code, message=f"{status.value} on purpose")
    k, a = finish_keys_args(
        keys, event, model="default", priority=NORMAL, now=now, ttl_s=60, stream_id=entry
    )
    return str(registry.call(r, FINISH, k, a)[0])


def test_each_end_is_counted_once_per_queue_and_status(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    with Client(r, settings=settings) as client:
        client.set_queue_config("normal", max_waiting=2, policy="drop_oldest")
        ids = [client.submit(f"p{i}", max_tokens=2).request_id for i in range(4)]  # 2 dropped
        late = client.submit("late", max_tokens=2, deadline_s=0.05, priority="batch")
        time.sleep(0.1)
        assert client.status(late.request_id).status.value == "expired"  # expire_overdue
        (entry, rid), (_, rid2) = _take(r, keys, 2)
        assert {rid, rid2} == set(ids[2:])
        now = time.time()
        assert _finish(r, keys, rid, entry, TerminalStatus.DONE, now) == "ok"
        assert _finish(r, keys, rid, entry, TerminalStatus.DONE, now) == "already"  # not twice
        assert client.cancel(rid2)  # still queued (no worker started it): cancel.lua ends it
    ends = queue_ends(r.hgetall(keys.tally), time.time())
    normal, batch = ends[("default", "normal")], ends[("default", "batch")]
    assert {s: v["total"] for s, v in normal.items() if v["total"]} == {
        "dropped": 2,
        "done": 1,
        "cancelled": 1,
    }
    assert {s: v["total"] for s, v in batch.items() if v["total"]} == {"expired": 1}
    assert normal["dropped"]["per_min"] >= 1.0  # counted in the current minute's slot


def test_per_minute_is_the_sliding_estimate_of_the_last_60_s(r: redis.Redis, keys: Keys) -> None:
    """Ends stamped at minute M-1 and M: read at M + 15 s, the previous minute still counts
    three quarters; read at M + 60 s + 30 s, only the (now previous) minute M counts, half."""
    r.hset(keys.record("x"), mapping={"status": "running", "model": "m", "priority": "normal"})
    base = 60.0 * 29_000_000
    for i, at in enumerate([base - 30, base - 20, base + 5, base + 6]):  # 2 in M-1, 2 in M
        r.hset(
            keys.record(f"r{i}"), mapping={"status": "running", "model": "m", "priority": "normal"}
        )
        event = TerminalEvent(f"r{i}", TerminalStatus.DROPPED, message="x")
        k, a = finish_keys_args(keys, event, model="m", priority=NORMAL, now=at, ttl_s=60)
        registry.call(r, FINISH, k, a)
    raw = r.hgetall(keys.tally)
    assert queue_ends(raw, base + 15)[("m", "normal")]["dropped"] == {"total": 4, "per_min": 3.5}
    assert queue_ends(raw, base + 90)[("m", "normal")]["dropped"]["per_min"] == 1.0
    assert queue_ends(raw, base + 200)[("m", "normal")]["dropped"]["per_min"] == 0.0
    assert len(raw) == 3  # one total and two minute slots, however many ends


def test_an_error_end_keeps_its_request_in_the_dead_letters_once(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    with Client(r, settings=settings) as client:
        handle = client.submit("a prompt worth keeping", max_tokens=3, request_id="keep-me")
        done = client.submit("fine", max_tokens=3)
    [(entry, rid), (entry2, _)] = _take(r, keys, 2)
    assert rid == handle.request_id
    now = time.time()
    assert _finish(r, keys, rid, entry, TerminalStatus.ERROR, now, code="engine_error") == "ok"
    assert _finish(r, keys, rid, entry, TerminalStatus.ERROR, now, code="engine_error") == "already"
    assert _finish(r, keys, done.request_id, entry2, TerminalStatus.DONE, now) == "ok"
    [letter] = _dead(r, keys)
    assert (letter.request_id, letter.entry_id, letter.cut) == ("keep-me", entry, False)
    assert letter.reason == "engine_error: error on purpose"
    request = letter.request(settings.max_payload_bytes)
    assert isinstance(request, GenerationRequest) and request.prompt == "a prompt worth keeping"


def test_a_payload_over_the_kept_size_is_kept_cut_and_cannot_be_requeued(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    with Client(r, settings=settings) as client:
        client.submit("x" * (dead_letters.PAYLOAD_BYTES + 10), max_tokens=1)
    [(entry, rid)] = _take(r, keys)
    _finish(r, keys, rid, entry, TerminalStatus.ERROR, time.time(), code="worker_lost")
    [letter] = _dead(r, keys)
    assert letter.cut and len(letter.payload) == dead_letters.PAYLOAD_BYTES
    assert letter.size > dead_letters.PAYLOAD_BYTES
    with pytest.raises(InvalidRequest, match="cannot be requeued"):
        letter.request(settings.max_payload_bytes)


def test_the_recent_list_holds_the_newest_ids_first_and_stays_bounded(
    r: redis.Redis, settings: Settings, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(enqueue, "RECENT_REQUESTS", 5)
    with Client(r, settings=settings) as client:
        first = [client.submit(f"p{i}", max_tokens=1).request_id for i in range(3)]
        many = client.submit_many([{"prompt": f"q{i}", "max_tokens": 1} for i in range(4)])
        again = client.submit("p0", max_tokens=1, request_id="chosen")
        client.submit("p0", max_tokens=1, request_id="chosen")  # the same request: not listed
    newest = [again.request_id, *[h.request_id for h in reversed(many)]]  # type: ignore[union-attr]
    listed: Any = r.lrange(keys.recent, 0, -1)
    assert [x.decode() for x in listed] == newest
    assert first[0].encode() not in listed


def test_queue_stats_say_when_the_oldest_waiting_request_entered(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    with Client(r, settings=settings) as client:
        assert client.queue_stats() == []
        before = time.time()
        a = client.submit("a", max_tokens=1)
        time.sleep(0.02)
        client.submit("b", max_tokens=1)
        [q] = client.queue_stats()
        oldest = q.oldest_waiting_at
        assert oldest is not None and before - 0.01 <= oldest <= time.time()
        stream_id = as_str(r.hget(keys.record(a.request_id), "stream_id")) or ""
        assert stream_id.startswith(str(int(oldest * 1000)))
        _take(r, keys)  # a is running now: b is the oldest waiting
        [q] = client.queue_stats()
        assert q.oldest_waiting_at is not None and q.oldest_waiting_at > oldest
        _take(r, keys)
        [q] = client.queue_stats()
        assert (q.waiting, q.oldest_waiting_at, q.oldest_waiting_s(time.time())) == (0, None, 0.0)
