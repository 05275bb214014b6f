"""Tenants from the producer's side (docs/fairness.md): ``tenant=`` on both faces, refusal of a
bad name with nothing stored, the queue's waiting count and ``tenant_stats`` over tenant queues,
and ``tokenfleet tenants set`` / ``list``."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis

from tokenfleet.producer import AsyncClient, Client
from tokenfleet.shared.errors import InvalidRequest, Overloaded
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


def test_settings_set_before_a_model_exists_reach_its_book_with_its_first_requests(
    client: Client, r: redis.Redis, keys: Keys, settings: Settings
) -> None:
    """``tenants set`` copies into the models known then; a model used later gets the settings
    from its producers' enqueue (read from the fleet's hash), and a stale copy never undoes a
    later ``set``."""
    from tokenfleet.producer import tenants as admin

    admin.set_tenant(r, keys, "acme", weight=3, max_waiting=2)
    admin.set_tenant(r, keys, "default", weight=2)
    book = keys.tenant_book("later")
    assert not r.exists(book)  # no model known yet: nothing copied
    client.submit("one", tenant="acme", model="later", max_tokens=2)
    assert r.hget(book, "w|acme") == b"3.0" and r.hget(book, "max|acme") == b"2"
    assert r.hget(book, "w|default") == b"2.0"  # (beside another tenant, the default's count)
    # its own bound applies in the new model: one admitted, two wait, the next is refused
    client.submit_many([{"prompt": "x", "tenant": "acme", "model": "later"} for _ in range(2)])
    assert r.xlen(keys.tenant_queue("later", Priority.NORMAL, "acme")) == 2
    refused = client.submit_many([{"prompt": "y", "tenant": "acme", "model": "later"}])
    assert isinstance(refused[0], Overloaded) and "own bound" in str(refused[0])
    # a later set wins over a producer's cached copy of the earlier one
    admin.set_tenant(r, keys, "acme", weight=5, clear_bound=True)
    assert r.hget(book, "w|acme") == b"5.0" and r.hget(book, "max|acme") is None
    client.submit("two", tenant="acme", model="later", max_tokens=2)  # (cache: weight 3, bound 2)
    assert r.hget(book, "w|acme") == b"5.0" and r.hget(book, "max|acme") is None
    rows = {(row.model, row.tenant): row for row in admin.book_rows(r, keys, "later")}
    assert (rows["later", "acme"].weight, rows["later", "acme"].max_waiting) == (5.0, None)
    # another client (no cache) on yet another model: the newest settings, no own bound
    with Client.from_url(settings=settings) as other:
        other.submit("three", tenant="acme", model="newest", max_tokens=2)
    newest = keys.tenant_book("newest")
    assert r.hget(newest, "w|acme") == b"5.0" and r.hget(newest, "max|acme") in (None, b"")
    rows = {(row.model, row.tenant): row for row in admin.book_rows(r, keys, "newest")}
    assert rows["newest", "acme"].max_waiting is None
