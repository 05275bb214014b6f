"""``submit_many`` on the wire (issue 15): its ``EVALSHA``s are packed by hiredis and sent on one
pooled connection by both drivers (``producer/core/script_wire.py``); its template fast path
validates exactly as ``submit`` does. Wire tests run both faces against the real server."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio

from tokenfleet.producer import AsyncClient, Client
from tokenfleet.producer.core.request import prepare, prepare_many
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings


def run_sync(redis_url: str, settings: Settings, call: Callable[[Any], Any]) -> Any:
    """``call(client)`` through a sync client of its own."""
    conn = redis.Redis.from_url(redis_url)
    try:
        with Client(conn, settings=settings) as client:
            return call(client)
    finally:
        conn.close()


def run_async(redis_url: str, settings: Settings, call: Callable[[Any], Any]) -> Any:
    """``await call(client)`` through an asyncio client of its own."""

    async def main() -> Any:
        conn = redis.asyncio.Redis.from_url(redis_url)
        try:
            async with AsyncClient(conn, settings=settings) as client:
                return await call(client)
        finally:
            await conn.aclose()

    return asyncio.run(main())


def on_both(redis_url: str, settings: Settings, call: Callable[[Any], Any]) -> list[Any]:
    return [run_sync(redis_url, settings, call), run_async(redis_url, settings, call)]


def test_submit_many_after_the_server_forgot_its_scripts(
    r: redis.Redis, redis_url: str, settings: Settings, keys: Keys
) -> None:
    def flush_then_submit(client: Any) -> Any:
        r.script_flush()  # a restarted server: every EVALSHA answers NOSCRIPT
        return client.submit_many([{"prompt": f"p{i}", "request_id": f"x{i}"} for i in range(3)])

    sync_out, aio_out = on_both(redis_url, settings, flush_then_submit)
    assert [h.request_id for h in sync_out] == ["x0", "x1", "x2"]
    assert [h.request_id for h in aio_out] == ["x0", "x1", "x2"]  # "exists": the same handles
    assert r.xlen(keys.stream("default", Priority.NORMAL)) == 3  # run once each, not twice
    assert r.hget(keys.record("x2"), "status") == b"queued"


def test_sync_submit_many_on_a_connection_the_server_closed(
    r: redis.Redis, redis_url: str, settings: Settings, keys: Keys
) -> None:
    # as before the change: the sync pool reconnects (asyncio's reconnects are issue 15 item 1)
    def kill_then_submit(client: Any) -> Any:
        client.submit_many(["warm"])  # the pool now holds an idle connection
        r.client_kill_filter(_type="normal", skipme=True)
        return client.submit_many(["a", "b"])

    out = run_sync(redis_url, settings, kill_then_submit)
    assert [r.hget(keys.record(h.request_id), "status") for h in out] == [b"queued"] * 2


@pytest.mark.parametrize("run", [run_sync, run_async])
def test_an_error_reply_is_raised_by_both_faces(
    r: redis.Redis, redis_url: str, settings: Settings, keys: Keys, run: Any
) -> None:
    r.set(keys.stream("default", Priority.NORMAL), "not a stream")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        run(redis_url, settings, lambda c: c.submit_many(["a"]))


def test_template_fast_path_keeps_types_apart(settings: Settings) -> None:
    # 1 == True in Python: a template keyed by value alone would let True pass as max_tokens=1
    with pytest.raises(InvalidRequest, match=r"requests\[1\]: .*max_tokens"):
        prepare_many(
            settings,
            [{"prompt": "a", "max_tokens": 1}, {"prompt": "b", "max_tokens": True}],
            now=0.0,
        )


def test_template_fast_path_refuses_what_submit_refuses(settings: Settings) -> None:
    with pytest.raises(InvalidRequest, match=r"requests\[1\]: prompt is not valid UTF-8"):
        prepare_many(settings, ["ok", "bad \ud800"], now=0.0)
    with pytest.raises(InvalidRequest, match=r"requests\[0\]: prompt is empty"):
        prepare_many(settings, [""], now=0.0)
    with pytest.raises(InvalidRequest, match=r"requests\[1\]: request id"):
        prepare_many(settings, [{"prompt": "a"}, {"prompt": "b", "request_id": "-x"}], now=0.0)


def test_template_fast_path_payloads_equal_prepare(settings: Settings) -> None:
    specs: list[Any] = [
        "plain",
        {"prompt": 'é ☃ \n "q"', "max_tokens": 7, "stop": ["a", "b"]},  # a list: the slow path
        {"max_tokens": 7, "prompt": "reordered", "request_id": "rid-1"},
        {"prompt": "high", "priority": "critical", "deadline_s": 5.0, "seed": 3},
        {"prompt": "high again", "priority": "critical", "deadline_s": 5.0, "seed": 3},
        "a long shared document. " * 30,  # over a chunk: its prefix chain routes it (routing)
        {"prompt": "another long one, " * 40, "max_tokens": 7},
    ]
    got = prepare_many(settings, specs, now=100.0)
    # a long bulk prompt keeps what its chain is computed from (once the model's route tokenizer
    # is known); a short one is not tokenized for routing
    assert got[-1].route_input == (specs[-1]["prompt"], None, None)
    assert got[-2].route_input == (specs[-2], None, None) and got[0].route_input is None
    for spec, p in zip(specs, got, strict=True):
        params = {"prompt": spec} if isinstance(spec, str) else dict(spec)
        chosen = "request_id" in params
        params.setdefault("request_id", p.request_id)
        one = prepare(settings, now=100.0, **params)
        # a generated id: not chosen; submit keeps every prompt's route input
        assert p == dataclasses.replace(one, chosen_id=chosen, route_input=p.route_input)
        assert one.route_input == (params["prompt"], None, None)
        assert one.chosen_id
    assert len({p.request_id for p in got}) == len(got)
    assert [p.chosen_id for p in prepare_many(settings, specs, now=100.0)] == [
        False,
        False,
        True,
        False,
        False,
        False,
        False,
    ]
