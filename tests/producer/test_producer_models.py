"""Models in a fleet (issue 15 item 5): a request for a model that no live worker serves and the
fleet does not declare is refused at submit with nothing written; a declared one without a live
worker is accepted and says what it waits on; an empty fleet accepts everything.

Live workers are stood in for by their heartbeat (``Heartbeat.beat``, what a worker's loop
calls); tests/worker/test_worker_models.py runs a real worker process.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from waiting import wait_for

from tokenfleet.producer import AsyncClient, Client, Handle, ModelInfo, ModelNotServed
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.service.heartbeat import Heartbeat


def _beat(r: redis.Redis, settings: Settings, model: str, ttl_s: float = 30.0) -> Heartbeat:
    heartbeat = Heartbeat(r, settings, worker_name=f"w-{model}", model_name=model, ttl_s=ttl_s)
    heartbeat.beat({"model": model, "running": 0})  # a worker's stats name its model
    return heartbeat


def test_an_empty_fleet_accepts_any_model_and_says_it_waits(client: Client) -> None:
    handle = client.submit("hi", model="anything", max_tokens=2)
    assert client.status(handle.request_id).waiting_on == "anything"
    assert client.models() == []


def test_unknown_model_is_refused_by_every_submit_and_nothing_is_written(
    client: Client, r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    r.sadd(keys.declared, "declared-1")
    _beat(r, settings, "served-1")
    before = set(r.keys("*"))
    with pytest.raises(ModelNotServed) as err:
        client.submit("hi", model="nope")
    assert err.value.model == "nope" and err.value.code == "model_not_found"
    assert str(err.value) == (
        "model 'nope' is not served by any live worker and not declared in this fleet "
        "(served: served-1; declared: declared-1)"
    )
    with pytest.raises(ModelNotServed):
        client.try_submit("hi", model="nope")
    out = client.submit_many(
        [{"prompt": "a", "model": "nope"}, {"prompt": "b", "model": "served-1"}, "c"]
    )
    assert isinstance(out[0], ModelNotServed) and out[0].model == "nope"
    assert isinstance(out[2], ModelNotServed) and out[2].model == "default"
    accepted = out[1]
    assert isinstance(accepted, Handle)

    async def from_async() -> list[BaseException]:
        async with AsyncClient.from_url(settings=settings) as aclient:
            refused: list[BaseException] = []
            for submit in (aclient.submit, aclient.try_submit):
                with pytest.raises(ModelNotServed) as aerr:
                    await submit("hi", model="nope")
                refused.append(aerr.value)
            for item in await aclient.submit_many([{"prompt": "a", "model": "nope"}]):
                assert isinstance(item, BaseException)
                refused.append(item)
            return refused

    refused = asyncio.run(from_async())
    assert len(refused) == 3 and all(isinstance(e, ModelNotServed) for e in refused)
    # only the served model's request left a trace: its record, its stream, the queue's name,
    # its id in the recent list
    assert set(r.keys("*")) - before == {
        keys.record(accepted.request_id).encode(),
        keys.stream("served-1", Priority.NORMAL).encode(),
        keys.queues.encode(),
        keys.recent.encode(),
    }
    assert r.lrange(keys.recent, 0, -1) == [accepted.request_id.encode()]
    assert r.smembers(keys.queues) == {b"served-1|normal"}
    assert not r.exists(keys.stream("nope", Priority.NORMAL))


def test_a_served_model_is_accepted_without_waiting(
    client: Client, r: redis.Redis, settings: Settings
) -> None:
    _beat(r, settings, "m1")
    handle = client.submit("hi", model="m1")
    assert client.status(handle.request_id).waiting_on == ""
    [info] = client.models()
    assert (info.name, info.served, info.declared) == ("m1", True, False)
    assert info.expires_at is not None and info.expires_at > time.time() + 20


def test_a_declared_model_without_a_worker_waits_and_says_so(
    client: Client, r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    r.sadd(keys.declared, "big")
    _beat(r, settings, "small")
    handle = client.submit("hi", model="big", max_tokens=2)
    record = client.status(handle.request_id)
    assert (record.status.value, record.waiting_on) == ("queued", "big")
    assert record.to_dict()["waiting_on"] == "big"
    assert [(m.name, m.served, m.declared) for m in client.models()] == [
        ("big", False, True),
        ("small", True, False),
    ]
    # once a worker serves it, new requests no longer wait on it
    _beat(r, settings, "big")
    assert client.status(client.submit("hi", model="big").request_id).waiting_on == ""


def test_an_existing_request_id_answers_as_before_when_its_model_is_refused(
    client: Client, r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    r.sadd(keys.declared, "was-declared")
    first = client.submit("hi", model="was-declared", request_id="keep-1")
    r.srem(keys.declared, "was-declared")
    _beat(r, settings, "other")
    again = client.submit("hi", model="was-declared", request_id="keep-1")
    assert again.request_id == first.request_id
    out = client.submit_many([{"prompt": "hi", "model": "was-declared", "request_id": "keep-1"}])
    assert isinstance(out[0], Handle)
    with pytest.raises(ModelNotServed):
        client.submit("hi", model="was-declared", request_id="keep-2")


def test_expiry_makes_a_model_unserved_again(
    client: Client, r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    r.sadd(keys.declared, "keeps-the-fleet-non-empty")
    _beat(r, settings, "brief", ttl_s=0.3)
    client.submit("hi", model="brief")

    def lapsed() -> bool:
        return not any(m.served for m in client.models() if m.name == "brief")

    wait_for(lapsed, "the served entry of 'brief' to lapse", timeout_s=30)
    [info] = [m for m in client.models() if m.name == "brief"]
    assert info.expires_at is not None and info.expires_at <= time.time()
    with pytest.raises(ModelNotServed):
        client.submit("hi", model="brief")


def test_an_expired_served_entry_alone_leaves_the_fleet_empty(
    client: Client, r: redis.Redis, keys: Keys
) -> None:
    r.zadd(keys.served, {"gone": time.time() - 5})
    assert client.status(client.submit("hi", model="new").request_id).waiting_on == "new"


def test_a_beat_never_shortens_a_peers_expiry_and_a_stopping_worker_serves_nothing(
    r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    _beat(r, settings, "m", ttl_s=60)
    long_expiry = r.zscore(keys.served, "m")
    _beat(r, settings, "m", ttl_s=5)
    assert r.zscore(keys.served, "m") == long_expiry
    stopping = Heartbeat(r, settings, worker_name="s", model_name="quiet", ttl_s=5)
    stopping.beat({"running": 0}, serving=False)
    assert r.zscore(keys.served, "quiet") is None
    assert r.exists(keys.worker("s"))  # its heartbeat itself still beats


def test_both_faces_list_the_same_models(
    client: Client, r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    r.sadd(keys.declared, "b", "a")
    _beat(r, settings, "a")
    r.zadd(keys.served, {"old": time.time() - 100})

    async def from_async() -> list[ModelInfo]:
        async with AsyncClient.from_url(settings=settings) as aclient:
            return await aclient.models()

    sync = client.models()
    assert [(m.name, m.served, m.declared) for m in sync] == [
        ("a", True, True),
        ("b", False, True),
        ("old", False, False),
    ]
    assert sync[1].expires_at is None
    assert sync[0].workers == ("w-a",)
    assert [m.to_dict() for m in asyncio.run(from_async())] == [m.to_dict() for m in sync]


def test_a_models_workers_are_the_live_heartbeats_that_name_it(
    client: Client, r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    for name, model in (("w-2", "a"), ("w-1", "a"), ("w-b", "b")):
        beat = Heartbeat(r, settings, worker_name=name, model_name=model, ttl_s=30)
        beat.beat({"model": model, "running": 0})
    stopping = Heartbeat(r, settings, worker_name="w-3", model_name="a", ttl_s=30)
    stopping.beat({"model": "a", "running": 0, "stopping": 1}, serving=False)
    r.zadd(keys.workers, {"lapsed": time.time() - 100})  # a name whose heartbeat is gone
    r.sadd(keys.declared, "c")
    workers = {m.name: m.workers for m in client.models()}
    assert workers == {"a": ("w-1", "w-2", "w-3"), "b": ("w-b",), "c": ()}
    assert client.models()[0].to_dict()["workers"] == ["w-1", "w-2", "w-3"]
    r.delete(keys.worker("w-b"))  # its heartbeat lapsed: no longer one of its model's workers
    assert [m.workers for m in client.models() if m.name == "b"] == [()]
