"""Tenants from the producer's side (docs/fairness.md): ``tenant=`` on both faces, refusal of a
bad name with nothing stored, the queue's waiting count and ``tenant_stats`` over tenant queues,
and ``tokenfleet tenants set`` / ``list``."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis

from tokenfleet.producer import AsyncClient, Client
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main


def test_tenant_on_both_faces_waits_in_its_queue_and_is_counted(
    client: Client, settings: Settings, r: redis.Redis, keys: Keys
) -> None:
    client.submit("hello there", tenant="acme", request_id="a1", max_tokens=4)
    client.submit_many([{"prompt": "x" * 40, "tenant": "acme"} for _ in range(3)])

    async def more() -> None:
        async with AsyncClient.from_url(settings=settings) as ac:
            await ac.submit("hi", tenant="globex", max_tokens=4)
            await ac.submit_many([{"prompt": "y", "tenant": "globex"}])

    asyncio.run(more())
    normal = Priority.NORMAL
    # a1 was admitted to wake a worker; the rest wait in their tenants' queues
    assert r.xlen(keys.tenant_queue("default", normal, "acme")) == 3
    assert r.xlen(keys.tenant_queue("default", normal, "globex")) == 2
    (q,) = [q for q in client.queue_stats() if q.priority == "normal"]
    assert q.waiting == 6  # shared stream + tenant queues
    rows = {t["tenant"]: t for t in client.tenant_stats()}
    assert rows["acme"]["waiting"] == 3 and rows["globex"]["waiting"] == 2
    assert rows["acme"]["admitted"] == 1 and rows["acme"]["running"] == 0
    assert client.fleet_status()["tenants"] == client.tenant_stats()


def test_a_bad_tenant_is_refused_naming_the_field_and_nothing_is_stored(
    client: Client, r: redis.Redis
) -> None:
    with pytest.raises(InvalidRequest, match="tenant"):
        client.submit("x", tenant="no spaces")
    with pytest.raises(InvalidRequest, match=r"requests\[1\]: .*tenant"):
        client.submit_many([{"prompt": "x"}, {"prompt": "y", "tenant": ""}])
    assert r.dbsize() == 0


def test_tenants_set_and_list(
    redis_url: str,
    r: redis.Redis,
    keys: Keys,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", "tft")
    url = ["--redis-url", redis_url]
    r.sadd(keys.queues, "m1|normal")
    assert main(["tenants", "set", "acme", "--weight", "3", "--max-waiting", "10", *url]) == 0
    assert "weight 3, own bound 10" in capsys.readouterr().out
    book = keys.tenant_book("m1")
    assert r.hget(book, "w|acme") == b"3.0" and r.hget(book, "max|acme") == b"10"
    assert main(["tenants", "set", "acme", "--no-max-waiting", *url]) == 0
    capsys.readouterr()
    assert r.hget(book, "max|acme") is None and r.hget(book, "w|acme") == b"3.0"
    assert main(["tenants", "list", "--json", *url]) == 0
    listed = orjson.loads(capsys.readouterr().out)
    assert listed["tenants"] == {"acme": {"weight": 3.0, "max_waiting": None}}
    assert [(m["model"], m["tenant"], m["weight"]) for m in listed["models"]] == [
        ("m1", "acme", 3.0)
    ]
    assert main(["tenants", "list", *url]) == 0
    assert "acme" in capsys.readouterr().out
    assert main(["tenants", "set", "acme", "--weight", "0", *url]) == 1
    assert "weight must be" in capsys.readouterr().err


def test_a_lane_without_queues_reads_no_tenants() -> None:
    """On a cluster the lanes are listed twice per reading (its queues, then lane by lane), each
    time through a cache of up to 1 s: a lane can come with no queue read for it. Its tenant
    rows are then none, asked with no round trip (an empty transaction has no key to route by:
    the console's status.json answered 500 on a cluster)."""
    from tokenfleet.producer.core.fleet_status import lane_tenants

    plan = lane_tenants(Keys("t", cluster=True, lane="m"), [])
    with pytest.raises(StopIteration) as ended:
        next(plan)
    assert ended.value.value == []
