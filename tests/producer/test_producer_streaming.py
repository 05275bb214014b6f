"""Streaming with a scripted fake worker: late subscribers, reconnects, gaps and duplicates all
end in one gap-free, duplicate-free sequence of indices and exactly one terminal event."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from producer_helpers import FakeWorker

from tokenfleet.producer import Client
from tokenfleet.shared.schema import Event, TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings


def _take(events: Iterator[Event], n: int) -> list[Event]:
    return [next(events) for _ in range(n)]


def _check(events: list[Event], first: int, texts: str) -> None:
    """Token indices run first, first + 1, ... once each; their texts concatenate to
    ``texts``; exactly one terminal event, last."""
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.index for t in tokens] == list(range(first, first + len(tokens)))
    assert "".join(t.text for t in tokens) == texts
    assert isinstance(events[-1], TerminalEvent)
    assert sum(isinstance(e, TerminalEvent) for e in events) == 1


def test_stream_and_result_agree(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("hi")
    worker.serve(["Hel", "lo", "", " world"])
    events = list(handle.stream())
    _check(events, 0, "Hello world")
    assert len(events) == 5
    result = handle.result(timeout=10)
    assert result.text == "Hello world"
    assert result.token_ids == [100, 101, 102, 103]
    assert result.finish_reason == "stop"
    assert result.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    assert client._subscriber.num_channels == 0  # released at the terminal event


def test_late_subscriber_gets_everything_once(
    client: Client, worker: FakeWorker, settings: Settings, r: redis.Redis
) -> None:
    handle = client.submit("hi")
    rid = worker.take()
    worker.emit(rid, 0, ["a", "b"])
    with Client(r, settings=settings, recheck_s=1.0) as late:
        events = late.handle(rid).stream()
        seen = _take(events, 2)
        worker.emit(rid, 2, ["c", "d"])
        worker.republish(rid, 1)  # a duplicate on the channel
        worker.emit(rid, 4, ["e"], publish=False)  # a gap on the channel: list only
        worker.emit(rid, 5, ["f"])
        worker.finish(rid, num_tokens=6)
        seen += list(events)
        _check(seen, 0, "abcdef")
        assert len(seen) == 7
        resumed = list(late.stream(rid, from_index=4))  # a reconnecting caller
        _check(resumed, 4, "ef")
        assert resumed[-1] == seen[-1]
    assert handle.result(timeout=10).text == "abcdef"


def test_reconnect_mid_stream(client: Client, worker: FakeWorker, r: redis.Redis) -> None:
    handle = client.submit("hi")
    rid = worker.take()
    events = handle.stream()
    worker.emit(rid, 0, ["a", "b", "c"])
    seen = _take(events, 3)
    killed = r.client_kill_filter(_type="pubsub")
    assert killed >= 1
    worker.emit(rid, 3, ["d", "e"])  # published while the subscriber is down
    worker.emit(rid, 5, ["f"])
    worker.finish(rid, num_tokens=6)
    seen += list(events)
    _check(seen, 0, "abcdef")
    assert len(seen) == 7
    assert client._subscriber.connects >= 2


def test_terminal_published_while_disconnected(
    client: Client, worker: FakeWorker, r: redis.Redis
) -> None:
    handle = client.submit("hi")
    rid = worker.take()
    worker.emit(rid, 0, ["x"])
    assert isinstance(next(handle.stream()), TokenEvent)
    r.client_kill_filter(_type="pubsub")
    worker.finish(rid, num_tokens=1)
    assert handle.result(timeout=20).text == "x"


def test_finished_request_is_rebuilt_from_the_record(
    client: Client, worker: FakeWorker, settings: Settings, r: redis.Redis
) -> None:
    live = client.submit("hi")
    rid = worker.serve(["p", "q"])
    first = list(live.stream())
    with Client(r, settings=settings) as other:
        again = list(other.stream(rid))
        assert again == first
        assert other.handle(rid).result().text == "pq"
        assert list(other.stream(rid, from_index=2)) == [first[-1]]


def test_live_events_need_no_recheck(
    settings: Settings, worker: FakeWorker, r: redis.Redis
) -> None:
    """With re-checks effectively off, events can only arrive over the channel."""
    with Client(r, settings=settings, recheck_s=3600) as quiet:
        fresh = quiet.submit("hi")
        rid = worker.take()
        late = quiet.handle(rid)
        worker.emit(rid, 0, ["a"])
        assert next(late.stream(timeout=30)).to_dict()["text"] == "a"  # sync, then channel
        worker.emit(rid, 1, ["b"])
        worker.republish(rid, 0)
        worker.finish(rid, num_tokens=2)
        events = list(fresh.stream(timeout=30))
        _check(events, 0, "ab")
        assert len(events) == 3
        assert [e.to_dict()["type"] for e in late.stream(1, timeout=30)] == ["token", "done"]


def test_tokens_published_before_the_subscription_is_confirmed_are_not_lost(
    r: redis.Redis, settings: Settings, worker: FakeWorker
) -> None:
    """``submit`` sends SUBSCRIBE without waiting for Redis to confirm it. Here the whole
    request is served before the subscriber may even connect; the handle's first read still
    gets everything from the record and list, not after a quiet-channel recheck."""
    with Client(r, settings=settings, recheck_s=60.0) as client:
        with client._subscriber._lock:  # the reader thread can neither connect nor subscribe
            handle = client.submit("hi")
            assert handle._sub is not None and not handle._sub.confirmation.is_set()
            worker.serve(["a", "b", "c"])
        sub, waits = handle._sub, []
        get = sub.get

        def counted_get(timeout: float | None) -> object | None:
            waits.append(timeout)
            return get(timeout)

        sub.get = counted_get  # type: ignore[method-assign]
        result = handle.result(timeout=30)
    assert (result.text, result.finish_reason) == ("abc", "stop")
    assert waits == []  # all of it came from the read after the confirmation: no channel wait


def test_an_unconfirmed_subscription_fails_the_read_not_the_request(
    r: redis.Redis, settings: Settings, worker: FakeWorker
) -> None:
    """The caller's own timeout comes first as ``TimeoutError``; ``subscribe_timeout_s`` as
    ``ConnectionError``; either way a later read subscribes afresh and gets the result."""
    with Client(r, settings=settings, subscribe_timeout_s=0.5) as client:
        with client._subscriber._lock:  # no confirmation can arrive meanwhile
            handle = client.submit("hi")
            with pytest.raises(TimeoutError):
                handle.result(timeout=0.1)
            with pytest.raises(redis.ConnectionError, match="could not subscribe"):
                handle.result(timeout=30)
            assert handle._sub is None and client._subscriber.num_channels == 0
        worker.serve(["a", "b"])
        assert handle.result(timeout=30).text == "ab"
