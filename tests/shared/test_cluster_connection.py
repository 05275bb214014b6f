"""Cluster-mode pieces that need no cluster: reading ``CLUSTER SLOTS`` and telling which error
replies mean "this node does not serve the slot now" (a lost connection, not a failed command).
The connections themselves are checked on a real cluster (tests/ha)."""

from __future__ import annotations

import pytest
import redis
from redis.exceptions import AskError, ClusterDownError, MovedError, ReadOnlyError, TryAgainError

from tokenfleet.shared.cluster_connection import fleet_slot, not_served_here, owner_in

REPLY = [
    [0, 5460, [b"10.0.0.1", 7000, b"id-a"], [b"10.0.0.4", 7003, b"id-d"]],
    [5461, 10922, [b"", 7001, b"id-b"]],  # an empty host: the node that was asked
    [10923, 16383, [b"10.0.0.3", 7002, b"id-c"]],
]


@pytest.mark.parametrize(
    ("slot", "owner"),
    [(0, ("10.0.0.1", 7000)), (5461, ("10.0.0.9", 7001)), (16383, ("10.0.0.3", 7002))],
)
def test_the_owner_of_a_slot_is_the_first_member_of_its_range(
    slot: int, owner: tuple[str, int]
) -> None:
    found, nodes = owner_in(REPLY, slot, ("10.0.0.9", 7001))
    assert found == owner
    assert ("10.0.0.4", 7003) in nodes and len(nodes) == 4


def test_an_unassigned_slot_has_no_owner() -> None:
    assert owner_in(REPLY[:1], 9000, ("h", 1))[0] is None
    assert owner_in([], 0, ("h", 1)) == (None, [])


def test_the_fleet_slot_is_the_hash_tag_s() -> None:
    assert fleet_slot("{fleet}") == fleet_slot("{fleet}:req:abc") == fleet_slot("fleet")
    assert fleet_slot("{a}") != fleet_slot("{b}")


@pytest.mark.parametrize(
    "exc",
    [
        MovedError("3999 127.0.0.1:6381"),
        AskError("3999 127.0.0.1:6381"),
        TryAgainError("Multiple keys request during rehashing of slot"),
        ClusterDownError("The cluster is down"),
        ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError("UNBLOCKED force unblock from blocking operation, instance state"),
    ],
)
def test_replies_that_mean_the_slot_is_elsewhere(exc: redis.ResponseError) -> None:
    assert not_served_here(exc)


def test_other_error_replies_stay_errors() -> None:
    assert not not_served_here(redis.ResponseError("WRONGTYPE Operation against a key"))
    assert not not_served_here(redis.ResponseError("ERR unknown command"))
