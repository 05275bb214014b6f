"""Idempotency fingerprints (issue 15 item 2): the same request_id with the same body returns
the existing request; with a different body it is refused with ``IdempotencyConflict``."""

from __future__ import annotations

import asyncio

import pytest
import redis
from producer_helpers import FakeWorker

from tokenfleet.producer import AsyncClient, Client, Handle, IdempotencyConflict, InvalidRequest
from tokenfleet.producer.core.request import prepare, prepare_many
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import request_fingerprint
from tokenfleet.shared.settings import Settings

STREAM = ("default", Priority.NORMAL)


def _fp(settings: Settings, now: float = 1000.0, **params: object) -> str:
    params.setdefault("request_id", "same-id")
    return request_fingerprint(prepare(settings, now=now, **params).payload)


def test_fingerprint_ignores_only_the_submit_time_and_deadline(settings: Settings) -> None:
    base = _fp(settings, prompt="hi", max_tokens=4)
    assert _fp(settings, now=2000.0, prompt="hi", max_tokens=4) == base
    assert _fp(settings, now=3000.0, prompt="hi", max_tokens=4, deadline_s=5) == base
    different = [
        {"prompt": "ho", "max_tokens": 4},
        {"prompt": "hi", "max_tokens": 5},
        {"prompt": "hi", "max_tokens": 4, "temperature": 0.5},
        {"prompt": "hi", "max_tokens": 4, "model": "other"},
        {"prompt": "hi", "max_tokens": 4, "priority": "critical"},
        {"prompt": "hi", "max_tokens": 4, "metadata": {"deadline": 1}},
        {"prompt": [1, 2], "max_tokens": 4},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        # a prompt that spells the cut markers is still part of what is compared
        {"prompt": 'hi,"deadline":1,"metadata":', "max_tokens": 4},
    ]
    fps = {_fp(settings, **params) for params in different}  # type: ignore[arg-type]
    assert base not in fps and len(fps) == len(different)


def test_submit_and_submit_many_share_fingerprints(settings: Settings) -> None:
    many = prepare_many(settings, [{"prompt": "x", "max_tokens": 3, "request_id": "a"}], now=5.0)
    one = prepare(settings, now=9.0, prompt="x", max_tokens=3, request_id="a")
    assert request_fingerprint(many[0].payload) == request_fingerprint(one.payload)


def test_same_body_returns_the_request_other_body_is_refused(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    first = client.submit("hello", request_id="order-7", max_tokens=8, deadline_s=60)
    again = client.submit("hello", request_id="order-7", max_tokens=8, deadline_s=30)
    assert again.request_id == first.request_id
    with pytest.raises(IdempotencyConflict) as err:
        client.submit("hello!", request_id="order-7", max_tokens=8)
    assert isinstance(err.value, InvalidRequest)
    assert err.value.request_id == "order-7" and err.value.code == "idempotency_conflict"
    assert "request id order-7 is already taken by a different request" in str(err.value)
    with pytest.raises(IdempotencyConflict):
        client.try_submit("hello", request_id="order-7", max_tokens=9)
    assert r.xlen(keys.stream(*STREAM)) == 1
    assert r.hget(keys.record("order-7"), "status") == b"queued"  # the original is untouched


def test_submit_many_reports_conflicts_per_request(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    client.submit("a", request_id="k1")
    out = client.submit_many(
        [
            {"prompt": "a", "request_id": "k1"},  # same: the existing request
            {"prompt": "b", "request_id": "k1"},  # different: refused
            {"prompt": "c", "request_id": "k2"},  # new
            {"prompt": "d", "request_id": "k2"},  # the same id twice in one call, other body
        ]
    )
    assert [type(x).__name__ for x in out] == [
        "Handle",
        "IdempotencyConflict",
        "Handle",
        "IdempotencyConflict",
    ]
    assert isinstance(out[1], IdempotencyConflict) and out[1].request_id == "k1"
    assert isinstance(out[3], IdempotencyConflict) and out[3].request_id == "k2"
    assert r.xlen(keys.stream(*STREAM)) == 2


def test_an_id_repeated_within_one_call_is_enqueued_once(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    """No record exists before the call (the script's one EXISTS for the whole call says so):
    the second and third uses of the id meet the record the first one created."""
    out = client.submit_many(
        [
            {"prompt": "a", "request_id": "d1"},
            {"prompt": "a", "request_id": "d1"},
            {"prompt": "b", "request_id": "d1"},
            "plain",
        ]
    )
    assert [type(x).__name__ for x in out] == ["Handle", "Handle", "IdempotencyConflict", "Handle"]
    assert r.xlen(keys.stream(*STREAM)) == 2


def test_only_client_chosen_ids_keep_a_fingerprint(
    client: Client, r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    """A generated id (128 random bits) cannot be met by another request: no hash is computed,
    sent or kept for it. Its holder may still resubmit under it (then as a chosen id)."""
    client.submit("x", request_id="mine", max_tokens=4)
    generated = client.submit("x", max_tokens=4).request_id
    many = client.submit_many(["y", {"prompt": "y", "request_id": "mine-2"}])
    assert (
        r.hget(keys.record("mine"), "fingerprint")
        == _fp(settings, prompt="x", max_tokens=4, request_id="mine").encode()
    )
    assert r.hget(keys.record(generated), "fingerprint") is None
    handles = [h for h in many if isinstance(h, Handle)]
    assert r.hget(keys.record(handles[0].request_id), "fingerprint") is None
    assert r.hget(keys.record("mine-2"), "fingerprint") is not None
    assert client.submit("x", request_id=generated, max_tokens=4).request_id == generated
    assert r.xlen(keys.stream(*STREAM)) == 4


def test_finished_request_conflicts_too(client: Client, worker: FakeWorker) -> None:
    client.submit("hello", request_id="job-9")
    worker.serve(["ok"])
    assert client.submit("hello", request_id="job-9").result(timeout=10).text == "ok"
    with pytest.raises(IdempotencyConflict, match="status done"):
        client.submit("bye", request_id="job-9")


def test_record_without_fingerprint_is_taken_as_the_same(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    """Records written by a producer before fingerprints existed (no field) stay idempotent."""
    client.submit("hello", request_id="old-1")
    r.hdel(keys.record("old-1"), "fingerprint")
    assert client.submit("anything", request_id="old-1").request_id == "old-1"


def test_async_client_refuses_conflicts(settings: Settings) -> None:
    async def body() -> None:
        async with AsyncClient.from_url(settings=settings) as aclient:
            await aclient.submit("a", request_id="as-1")
            assert (await aclient.submit("a", request_id="as-1")).request_id == "as-1"
            with pytest.raises(IdempotencyConflict, match="as-1"):
                await aclient.submit("b", request_id="as-1")
            out = await aclient.submit_many([{"prompt": "c", "request_id": "as-1"}])
            assert isinstance(out[0], IdempotencyConflict)

    asyncio.run(body())
