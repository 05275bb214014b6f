from __future__ import annotations

import pytest

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys, check_model_name, check_request_id
from tokenfleet.shared.priority import Priority


def test_every_name_starts_with_the_prefix_and_names_are_distinct() -> None:
    k = Keys("fleet")
    names = [
        k.stream("m", Priority.CRITICAL),
        k.stream("m", Priority.BATCH),
        k.stream("other", Priority.CRITICAL),
        k.queue_config("m", Priority.CRITICAL),
        k.queues,
        k.record("r1"),
        k.tokens("r1"),
        k.channel("r1"),
        k.record("r2"),
        k.cancel_set,
        k.worker("w1"),
        k.workers,
        k.dead_letter,
        k.served,
        k.declared,
        k.pool("p"),
        k.pool_members("p"),
        k.pool_preemptions("p"),
        k.pools,
        k.api_key("abc123def0"),
        k.api_key("abc123def1"),
        k.api_keys,
        k.api_key_names,
    ]
    assert all(n.startswith("fleet:") for n in names)
    assert len(set(names)) == len(names)


def test_names_of_the_prefix_alone_are_set_once_per_prefix() -> None:
    k = Keys("fleet")
    assert (k.served, k.declared, k.queues, k.cancel_set) == (
        "fleet:served",
        "fleet:models",
        "fleet:queues",
        "fleet:cancel",
    )
    assert Keys("other").served == "other:served" and Keys() == Keys("tokenfleet")


def test_cluster_names_share_one_hash_slot_and_others_are_unchanged() -> None:
    from tokenfleet.shared.cluster_connection import fleet_slot
    from tokenfleet.shared.settings import Settings

    plain = Keys.for_settings(Settings(key_prefix="fleet"))
    tagged = Keys.for_settings(Settings(key_prefix="fleet", redis_mode="cluster"))
    assert plain == Keys("fleet") and plain.record("r") == "fleet:req:r"
    assert plain.publish_command == "PUBLISH" and tagged.publish_command == "SPUBLISH"
    names = [tagged.record("r"), tagged.tokens("r"), tagged.channel("r"), tagged.cancel_set,
             tagged.stream("m", Priority.BATCH), tagged.pool_members("p"), tagged.batch("b"),
             tagged.api_key("k"), tagged.worker("w"), tagged.served]  # fmt: skip
    assert all(n.startswith("{fleet}:") for n in names)
    assert {fleet_slot(n) for n in names} == {fleet_slot("{fleet}")}
    assert [n.replace("{fleet}", "fleet") for n in names[:3]] == [
        plain.record("r"), plain.tokens("r"), plain.channel("r")
    ]  # fmt: skip


def test_on_a_cluster_a_model_s_lane_is_its_own_slot_and_fleet_rooms_stay_in_the_fleet_s() -> None:
    from dataclasses import replace

    from tokenfleet.shared.cluster_connection import fleet_slot
    from tokenfleet.shared.settings import Settings

    settings = Settings(key_prefix="fleet", redis_mode="cluster")
    fleet = Keys.for_settings(settings)
    lane = Keys.for_settings(replace(settings, lane="org/model-1"))
    assert lane == fleet.for_model("org/model-1") and lane.fleet == fleet and fleet.laned
    lane_names = [lane.record("r"), lane.tokens("r"), lane.channel("r"), lane.cancel_set,
                  lane.stream("org/model-1", Priority.BATCH), lane.queues, lane.drained,
                  lane.worker("w"), lane.workers, lane.dead_letter, lane.served,
                  lane.routers("org/model-1"), lane.session("h"), lane.prefixes("w")]  # fmt: skip
    assert all(n.startswith("{fleet|org/model-1}:") for n in lane_names)
    assert {fleet_slot(n) for n in lane_names} == {fleet_slot("{fleet|org/model-1}")}
    fleet_names = [lane.api_key("k"), lane.batch("b"), lane.file("f"), lane.owners,
                   lane.pool("p"), lane.pool_members("p"), lane.pools, lane.lanes,
                   fleet.served, fleet.declared]  # fmt: skip
    assert all(n.startswith("{fleet}:") for n in fleet_names)
    assert lane.served != fleet.served  # the lane's copy, and the registry's
    other = fleet.for_model("other")
    assert other.record("r") != lane.record("r") and other.lanes == lane.lanes
    # off a cluster a lane changes no name
    plain = Keys.for_settings(replace(settings, redis_mode="standalone", lane="org/model-1"))
    assert plain.for_model("x") == plain.fleet == plain and not plain.laned
    assert plain.record("r") == "fleet:req:r" and plain.lanes == "fleet:lanes"


def test_a_lane_is_set_by_code_not_by_the_environment() -> None:
    from tokenfleet.shared.errors import SettingsError
    from tokenfleet.shared.settings import Settings

    with pytest.raises(SettingsError, match="TOKENFLEET_LANE"):
        Settings.from_env({"TOKENFLEET_LANE": "m"})
    with pytest.raises(SettingsError, match="not a model name"):
        Settings(lane="{bad}")


def test_two_prefixes_never_share_a_name() -> None:
    a, b = Keys("a"), Keys("b")
    assert a.record("x") != b.record("x")
    assert a.stream("m", Priority.NORMAL) != b.stream("m", Priority.NORMAL)


@pytest.mark.parametrize("model", ["default", "Qwen/Qwen2.5-0.5B", "my.model_v2-1"])
def test_valid_model_names(model: str) -> None:
    assert check_model_name(model) == model


@pytest.mark.parametrize("model", ["", "a b", "-x", "a:b", "x" * 129])
def test_invalid_model_names(model: str) -> None:
    with pytest.raises(InvalidRequest, match="model name"):
        check_model_name(model)


@pytest.mark.parametrize("rid", ["", "a b", "a/b", "a:b", "é", "x" * 129])
def test_invalid_request_ids(rid: str) -> None:
    with pytest.raises(InvalidRequest, match="request id"):
        check_request_id(rid)


def test_priority_parse() -> None:
    assert Priority.parse("Critical") is Priority.CRITICAL
    assert Priority.parse(2) is Priority.BATCH
    assert min(Priority) is Priority.CRITICAL
    with pytest.raises(InvalidRequest, match=r"unknown priority .urgent.*critical, normal, batch"):
        Priority.parse("urgent")
    with pytest.raises(InvalidRequest):
        Priority.parse(True)
