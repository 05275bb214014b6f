"""Handles across Redis outages (docs/redis-modes.md, "Redis outages"): a restart is ridden out
from the durable record, a stall too; a request Redis lost is submitted again by the handle that
submitted it (same id and parameters, once per loss), and ends the read with ``RequestLost`` with
``resubmit_lost`` off or on a handle that did not submit it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis
from producer_helpers import FakeWorker
from waiting import wait_for

from tokenfleet.producer import AsyncClient, Client
from tokenfleet.producer.core.outage import CEILING_S, FIRST_S, OutageClock
from tokenfleet.shared.errors import RedisUnavailable, RequestLost
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import Event, TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer


def _lose(r: redis.Redis, keys: Keys, rid: str) -> None:
    """What a Redis restarted from an older snapshot shows: the record and the entry gone."""
    stream = keys.stream("default", Priority.NORMAL)
    sid: Any = r.hget(keys.record(rid), "stream_id")
    r.delete(keys.record(rid), keys.tokens(rid))
    r.xdel(stream, sid)


def test_a_lost_request_is_submitted_again_by_its_handle_and_read_on(
    client: Client, r: redis.Redis, keys: Keys, worker: FakeWorker
) -> None:
    """Lost twice (record and entry gone, as after a restart from an older snapshot): each loss
    is submitted again once, same id and payload; the new run's repeated first tokens are
    dropped by index, the reader sees each index once and one end."""
    handle = client.submit("hi", max_tokens=7, temperature=0.0)
    rid = handle.request_id
    stream_key = keys.stream("default", Priority.NORMAL)
    first: Any = r.xrange(stream_key)
    payload = first[0][1][b"d"]
    assert worker.take() == rid
    worker.emit(rid, 0, ["a", "b"])
    events: list[Event] = []
    reader = threading.Thread(target=lambda: events.extend(handle.stream(timeout=60)))
    reader.start()
    wait_for(lambda: len(events) >= 2, "the first two tokens")
    for loss in (1, 2):
        _lose(r, keys, rid)
        wait_for(
            lambda: handle.resubmits == loss and r.exists(keys.record(rid)),  # noqa: B023
            f"resubmit {loss}",
        )
        entries: Any = r.xrange(stream_key)
        assert [(e[1][b"id"], e[1][b"d"]) for e in entries] == [(rid.encode(), payload)]
    assert worker.take() == rid  # the new run: its first tokens repeat, the reader drops them
    worker.emit(rid, 0, ["a", "b", "c"])
    worker.finish(rid, num_tokens=3, text="abc")
    reader.join(60)
    assert [e.index for e in events if isinstance(e, TokenEvent)] == [0, 1, 2]
    ends = [e for e in events if isinstance(e, TerminalEvent)]
    assert len(ends) == 1 and ends[0].status == "done" and events[-1] is ends[0]


def test_with_resubmit_lost_off_a_record_that_vanishes_raises_request_lost(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    with Client(r, settings=settings, recheck_s=1.0, resubmit_lost=False) as client:
        handle = client.submit("hi")
        _lose(r, keys, handle.request_id)
        with pytest.raises(RequestLost, match="gone from Redis"):
            handle.result(timeout=30)
        assert handle.resubmits == 0 and not r.exists(keys.record(handle.request_id))


def test_a_handle_that_did_not_submit_cannot_resubmit(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    rid = client.submit("hi").request_id
    other = client.handle(rid)
    with pytest.raises(TimeoutError):
        other.result(timeout=0.5)  # (it has seen the record)
    _lose(r, keys, rid)
    with pytest.raises(RequestLost):
        other.result(timeout=30)
    assert other.resubmits == 0


def test_an_async_handle_submits_a_lost_request_again(
    settings: Settings, r: redis.Redis, keys: Keys
) -> None:
    async def main() -> None:
        conn = redis.asyncio.Redis.from_url(settings.redis_url)
        client = AsyncClient(conn, settings=settings, recheck_s=1.0)
        try:
            handle = await client.submit("hi")
            _lose(r, keys, handle.request_id)
            with pytest.raises(TimeoutError):
                await handle.result(timeout=2.5)  # re-read, submitted again, waits for a worker
            assert handle.resubmits == 1 and r.exists(keys.record(handle.request_id))
        finally:
            await client.aclose()
            await conn.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("outage", ["restart", "stall"])
def test_a_stream_rides_out_a_redis_outage(outage: str) -> None:
    """Tokens published before and after a restart (AOF: the data survives) or a stall longer
    than the socket timeout arrive once each, in order; the handle never raises."""
    with RedisServer(unix_socket=False, appendonly=True) as server:
        settings = Settings(redis_url=server.url, key_prefix="tpo", redis_socket_timeout_s=1)
        keys = Keys("tpo")
        with Client.from_url(settings=settings, recheck_s=0.5) as client:
            handle = client.submit("hi")
            worker_conn = redis.Redis.from_url(server.url)
            FakeWorker(worker_conn, keys).take()
            rid = handle.request_id
            FakeWorker(worker_conn, keys).emit(rid, 0, ["a", "b"])
            events = handle.stream()
            got = [next(events), next(events)]
            rest: list[Event] = []
            reader = threading.Thread(target=lambda: rest.extend(events))
            reader.start()  # waiting for the next event while Redis goes away
            if outage == "restart":
                server.restart()
            else:
                server.pause()
                reader.join(3.0)  # the stall: 3 socket timeouts (the reader keeps waiting)
                server.resume()
            worker_conn.close()
            fresh = FakeWorker(redis.Redis.from_url(server.url), keys)
            fresh.emit(rid, 2, ["c", "d"])
            fresh.finish(rid, num_tokens=4, text="abcd")
            reader.join(60)
            assert not reader.is_alive()
            got += rest
            tokens = [e for e in got if isinstance(e, TokenEvent)]
            assert [e.index for e in tokens] == [0, 1, 2, 3]
            assert "".join(e.text for e in tokens) == "abcd"
            assert isinstance(got[-1], TerminalEvent) and got[-1].status == "done"
            fresh.r.close()


def test_the_outage_clock_backs_off_with_jitter_within_both_bounds() -> None:
    now = [0.0]
    clock = OutageClock(10, clock=lambda: now[0])
    waits = []
    while True:
        try:
            wait = clock.next_wait(redis.ConnectionError("x"), until=None)
        except RedisUnavailable:
            break
        assert wait is not None
        waits.append(wait)
        now[0] += wait
    bounds = [min(CEILING_S, FIRST_S * 2**i) for i in range(len(waits))]
    assert all(b / 2 <= w <= b for w, b in zip(waits, bounds, strict=True))
    assert sum(waits) >= 10
    short = OutageClock(0, clock=lambda: 5.0)
    assert short.next_wait(redis.ConnectionError("x"), until=5.0) is None  # caller's timeout
    assert short.next_wait(redis.ConnectionError("x"), until=5.01) == pytest.approx(0.01)
