"""Handles across Redis outages (docs/redis-modes.md, "Redis outages"): a restart is ridden out
from the durable record, a stall too, and a record Redis lost ends the read with ``RequestLost``."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
from producer_helpers import FakeWorker

from tokenfleet.producer import AsyncClient, Client
from tokenfleet.producer.core.outage import CEILING_S, FIRST_S, OutageClock
from tokenfleet.shared.errors import RedisUnavailable, RequestLost
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.schema import Event, TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer


def test_a_record_that_vanishes_ends_the_read_with_request_lost(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    handle = client.submit("hi")
    r.delete(keys.record(handle.request_id))  # what a Redis restarted without AOF shows
    with pytest.raises(RequestLost, match="gone from Redis"):
        handle.result(timeout=30)


def test_an_async_record_that_vanishes_ends_the_read_with_request_lost(
    settings: Settings, r: redis.Redis, keys: Keys
) -> None:
    async def main() -> None:
        conn = redis.asyncio.Redis.from_url(settings.redis_url)
        client = AsyncClient(conn, settings=settings, recheck_s=1.0)
        try:
            handle = await client.submit("hi")
            r.delete(keys.record(handle.request_id))
            with pytest.raises(RequestLost):
                await handle.result(timeout=30)
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
