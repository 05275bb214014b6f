"""``AsyncClient`` behaves like ``Client``: same outcomes for the same scenarios."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio
from producer_helpers import FakeWorker
from waiting import wait_for

from tokenfleet.producer import (
    AsyncClient,
    Client,
    IdempotencyConflict,
    InvalidRequest,
    Overloaded,
    RequestFailed,
    UnknownRequest,
)
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.schema import TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings


def run(
    settings: Settings, body: Callable[[AsyncClient], Awaitable[None]], **client_kwargs: Any
) -> None:
    async def main() -> None:
        conn = redis.asyncio.Redis.from_url(settings.redis_url)
        client = AsyncClient(conn, settings=settings, **({"recheck_s": 1.0} | client_kwargs))
        try:
            await body(client)
        finally:
            await client.aclose()
            await conn.aclose()

    asyncio.run(main())


def test_submit_stream_result(settings: Settings, worker: FakeWorker) -> None:
    async def body(client: AsyncClient) -> None:
        handle = await client.submit("hi", max_tokens=8)
        served = asyncio.create_task(asyncio.to_thread(worker.serve, ["a", "b", "c"]))
        events = [e async for e in handle.stream()]
        await served
        assert [e.index for e in events if isinstance(e, TokenEvent)] == [0, 1, 2]
        assert isinstance(events[-1], TerminalEvent)
        result = await handle.result(timeout=10)
        assert (result.text, result.token_ids) == ("abc", [100, 101, 102])
        assert client._subscriber.num_channels == 0
        late = [e async for e in client.stream(handle.request_id, from_index=1)]
        assert late == events[1:]

    run(settings, body)


def test_reconnect_mid_stream(settings: Settings, worker: FakeWorker, r: redis.Redis) -> None:
    async def body(client: AsyncClient) -> None:
        handle = await client.submit("hi")
        rid = await asyncio.to_thread(worker.take)
        events = handle.stream()
        await asyncio.to_thread(worker.emit, rid, 0, ["a", "b"])
        seen = [await anext(events), await anext(events)]
        assert r.client_kill_filter(_type="pubsub") >= 1
        await asyncio.to_thread(worker.emit, rid, 2, ["c", "d"])
        await asyncio.to_thread(worker.finish, rid, num_tokens=4)
        seen += [e async for e in events]
        tokens = [e for e in seen if isinstance(e, TokenEvent)]
        assert [t.index for t in tokens] == [0, 1, 2, 3]
        assert "".join(t.text for t in tokens) == "abcd"
        assert isinstance(seen[-1], TerminalEvent) and len(seen) == 5
        assert client._subscriber.connects >= 2

    run(settings, body)


def test_policies_ids_cancel_deadline(settings: Settings, client: Client) -> None:
    async def body(aclient: AsyncClient) -> None:
        await aclient.set_queue_config("normal", max_waiting=2, policy="drop_oldest")
        first = await aclient.submit("a", request_id="same")
        assert (await aclient.submit("a", request_id="same")).request_id == "same"
        with pytest.raises(IdempotencyConflict, match="request id same is already taken"):
            await aclient.submit("other", request_id="same")
        await aclient.submit("b")
        with pytest.raises(Overloaded):
            await aclient.try_submit("c")
        await aclient.submit("c")  # evicts the oldest
        with pytest.raises(RequestFailed, match="dropped"):
            await first.result(timeout=10)
        stats = await aclient.queue_stats()
        assert stats == client.queue_stats()
        assert [(s.priority, s.waiting) for s in stats] == [("normal", 2)]

        out = await aclient.submit_many(["x", {"prompt": "y", "priority": "batch"}])
        assert [type(h).__name__ for h in out] == ["AsyncHandle", "AsyncHandle"]
        queued = out[1]
        assert not isinstance(queued, Exception)
        assert await queued.cancel() is True
        with pytest.raises(RequestFailed, match="cancelled"):
            await queued.result(timeout=10)
        assert await aclient.cancel(queued.request_id) is False
        with pytest.raises(UnknownRequest):
            await aclient.status("nope")

        late = await aclient.submit("late", priority="critical", deadline_s=0.2)
        with pytest.raises(RequestFailed, match="expired"):
            await late.result(timeout=20)
        assert (await aclient.status(late.request_id)).status.value == "expired"
        with pytest.raises(InvalidRequest, match="top_p"):
            await aclient.submit("x", top_p=0)

    run(settings, body)


def hold_back_subscriber(client: AsyncClient) -> asyncio.Event:
    """Keep the client's pub/sub reader task from connecting until the returned event is set."""
    gate = asyncio.Event()
    reconnect = client._subscriber._reconnect

    async def held_back() -> bool:
        await gate.wait()
        return await reconnect()

    client._subscriber._reconnect = held_back  # type: ignore[method-assign]
    return gate


def test_tokens_published_before_the_subscription_is_confirmed_are_not_lost(
    settings: Settings, worker: FakeWorker
) -> None:
    """See the sync test of the same name: the reader task is held back from connecting."""

    async def body(client: AsyncClient) -> None:
        gate = hold_back_subscriber(client)
        handle = await client.submit("hi")
        assert handle._sub is not None and not handle._sub.confirmation.is_set()
        await asyncio.to_thread(worker.serve, ["a", "b", "c"])
        gate.set()
        sub, waits = handle._sub, []
        get = sub.get

        async def counted_get(timeout: float | None) -> object | None:
            waits.append(timeout)
            return await get(timeout)

        sub.get = counted_get  # type: ignore[method-assign]
        result = await handle.result(timeout=30)
        assert (result.text, result.finish_reason) == ("abc", "stop")
        assert waits == []  # all of it came from the read after the confirmation

    run(settings, body, recheck_s=60.0)


def test_an_unconfirmed_subscription_fails_the_read_not_the_request(
    settings: Settings, worker: FakeWorker
) -> None:
    """See the sync test of the same name."""

    async def body(client: AsyncClient) -> None:
        gate = hold_back_subscriber(client)
        handle = await client.submit("hi")
        with pytest.raises(TimeoutError):
            await handle.result(timeout=0.1)
        with pytest.raises(redis.ConnectionError, match="could not subscribe"):
            await handle.result(timeout=30)
        assert handle._sub is None and client._subscriber.num_channels == 0
        gate.set()
        await asyncio.to_thread(worker.serve, ["a", "b"])
        assert (await handle.result(timeout=30)).text == "ab"

    run(settings, body, subscribe_timeout_s=0.5)


def test_a_channel_listened_to_again_right_after_a_close_still_gets_messages(
    settings: Settings, r: redis.Redis
) -> None:
    """A mailbox closed and another opened on the same channel in one go (a handle closed
    then read again, a resumed stream): the stale UNSUBSCRIBE must not end the new one."""

    async def body(client: AsyncClient) -> None:
        sub = client._subscriber
        first = await sub.subscribe("tft:ch:again", timeout=5)
        first.close()
        again = await sub.subscribe("tft:ch:again", timeout=5)
        await asyncio.sleep(0)  # the closed mailbox's background task runs now
        assert r.publish("tft:ch:again", b"hello") == 1
        assert await again.get(timeout=10) == b"hello"
        again.close()

    run(settings, body)


def test_a_closed_handle_reads_again_on_a_fresh_subscription(
    settings: Settings, worker: FakeWorker, r: redis.Redis
) -> None:
    async def body(client: AsyncClient) -> None:
        handle = await client.submit("hi", max_tokens=8)
        rid = await asyncio.to_thread(worker.take)
        await asyncio.to_thread(worker.emit, rid, 0, ["a"])
        events = handle.stream()
        assert isinstance(await anext(events), TokenEvent)
        handle.close()
        assert handle._sub is None  # released and forgotten: the next read subscribes again
        channel = Keys(settings.key_prefix).channel(rid)

        def finish_once_listened_to() -> None:  # the rest comes over the new subscription
            wait_for(
                lambda: r.pubsub_numsub(channel)[0][1],
                "the handle to subscribe again",
                timeout_s=20,
                poll_s=0.005,
            )
            worker.emit(rid, 1, ["b"])
            worker.finish(rid, num_tokens=2, text="ab")

        finishing = asyncio.create_task(asyncio.to_thread(finish_once_listened_to))
        result = await handle.result(timeout=30)
        await finishing
        assert result.text == "ab"

    run(settings, body, recheck_s=60.0)  # a lost subscription would show as a timeout
