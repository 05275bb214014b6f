"""``core.lanes`` against a real Redis: the cross-lane checks a cluster producer makes.

Hash tags mean nothing to a standalone server, so the lane names (``Keys(cluster=True)``) are
used here on one: what is tested is what the directory reads and decides, not the routing to
slots (tests/ha/test_cluster_path.py runs that on a real cluster)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from tokenfleet.producer.core import ops
from tokenfleet.producer.core.effects import Plan
from tokenfleet.producer.core.lanes import LaneDirectory
from tokenfleet.producer.core.slot_clients import SlotClients
from tokenfleet.producer.sync_io.driver import SyncDriver
from tokenfleet.shared.errors import UnknownRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.enqueue import ENQUEUE, enqueue_keys_args
from tokenfleet.shared.settings import Settings


def run(r: redis.Redis, plan: Plan[Any]) -> Any:
    return SyncDriver(SlotClients.single(r, None), r).run(plan)  # type: ignore[arg-type]


def script_refusal(r: redis.Redis, keys: Keys, model: str) -> str | None:
    """What the enqueue script (in one slot: ``keys`` unlaned) says about ``model``."""
    from tokenfleet.producer.core.request import prepare

    prepared = prepare(Settings(), now=time.time(), prompt="x", model=model, max_tokens=1)
    k, a = enqueue_keys_args(
        keys, model, Priority.NORMAL, [prepared], now=time.time(), ttl_s=60, route=None
    )
    code, value = ops.enqueue_pair(registry.call(r, ENQUEUE, k, a))
    return str(value) if code == "unserved" else None


@pytest.mark.parametrize(
    ("served", "declared"),
    [
        ({}, set()),  # an empty fleet: anything goes
        ({"m": +60}, set()),
        ({"a": +60, "b": -5}, {"c"}),
        ({"b": -5}, set()),  # only a lapsed server: empty again
        ({}, {"x", "y"}),
        ({f"s{i:02d}": +60 for i in range(12)}, set()),  # lists cut at 10
    ],
)
@pytest.mark.parametrize("model", ["m", "b", "c", "zz"])
def test_the_registry_check_refuses_exactly_as_the_enqueue_script_does(
    r: redis.Redis, served: dict[str, float], declared: set[str], model: str
) -> None:
    now = time.time()
    one_slot, laned = Keys("one"), Keys("lanes", cluster=True)
    for keys in (one_slot, laned.fleet):
        if served:
            r.zadd(keys.served, {m: now + dt for m, dt in served.items()})
        if declared:
            r.sadd(keys.declared, *declared)
    expected = script_refusal(r, one_slot, model)
    refused = run(r, LaneDirectory(laned).enter([model]))
    got = refused.get(model)
    assert (None if got is None else str(got)) == expected
    assert r.sismember(laned.lanes, model) == (expected is None)  # registered when accepted


def test_a_request_is_found_in_its_lane_and_a_chosen_id_held_by_another_lane_is_caught(
    r: redis.Redis,
) -> None:
    keys = Keys("find", cluster=True)
    r.sadd(keys.lanes, "a", "b")
    r.hset(keys.for_model("b").record("r1"), "status", "queued")
    directory = LaneDirectory(keys)
    assert run(r, directory.keys_of("r1")) == keys.for_model("b")
    with pytest.raises(UnknownRequest):
        run(r, directory.keys_of("nowhere"))
    assert run(r, directory.held_elsewhere("a", ["r1", "r2"])) == {"r1"}
    assert run(r, directory.held_elsewhere("b", ["r1"])) == set()  # its own lane: the script's
    assert run(r, directory.existing([("b", "r1"), ("a", "r1")])) == {("b", "r1")}
    # a remembered id is looked up without a read; a fresh lookup finds where it is now
    directory.remember("r1", "a")
    assert run(r, directory.keys_of("r1")) == keys.for_model("a")
    assert run(r, directory.keys_of("r1", fresh=True)) == keys.for_model("b")


def test_off_a_cluster_the_directory_reads_and_writes_nothing(r: redis.Redis) -> None:
    keys = Keys("plain")
    directory = LaneDirectory(keys)
    before = r.dbsize()
    r.zadd(keys.served, {"other": time.time() + 60})  # would refuse "m" on a cluster
    assert run(r, directory.enter(["m"])) == {}
    assert run(r, directory.keys_of("anything")) == keys
    assert run(r, directory.held_elsewhere("m", ["x"])) == set()
    assert r.dbsize() == before + 1


def test_submit_many_s_checks_refuse_what_one_slot_would(r: redis.Redis) -> None:
    from tokenfleet.producer.core.lanes import lane_refusals
    from tokenfleet.producer.core.request import prepare_many
    from tokenfleet.shared.errors import IdempotencyConflict, ModelNotServed

    keys = Keys("many", cluster=True)
    r.zadd(keys.served, {"a": time.time() + 60, "b": time.time() + 60})
    r.sadd(keys.lanes, "a", "b", "gone")
    r.hset(keys.for_model("b").record("held"), "status", "done")
    r.hset(keys.for_model("gone").record("kept"), "status", "done")
    requests: list[Any] = [
        {"prompt": "x", "model": "a", "request_id": "same"},
        {"prompt": "x", "model": "a", "request_id": "same"},  # a retry: the script's to answer
        {"prompt": "x", "model": "b", "request_id": "same"},  # one id, another model
        {"prompt": "x", "model": "a", "request_id": "held"},  # held by b's lane
        {"prompt": "x", "model": "gone"},  # neither served nor declared
        {"prompt": "x", "model": "gone", "request_id": "kept"},  # but this id exists there
        {"prompt": "x", "model": "a"},
    ]
    prepared = prepare_many(Settings(), requests, now=time.time())
    refusals = run(r, lane_refusals(LaneDirectory(keys), prepared))
    assert sorted(refusals) == [2, 3, 4]
    assert isinstance(refusals[2], IdempotencyConflict) and "same" in str(refusals[2])
    assert isinstance(refusals[3], IdempotencyConflict)
    assert isinstance(refusals[4], ModelNotServed) and refusals[4].model == "gone"
