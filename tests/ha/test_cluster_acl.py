"""The documented Redis ACL roles on a real Redis Cluster (docs/security.md, "In cluster
mode": the patterns carry the fleet's hash tag, and the roles add ``+cluster|slots`` and sharded
pub/sub). A real worker runs as ``tf-worker`` and a producer as ``tf-producer``, with the users
set on every node (a replica promoted in a failover has them too): a request streams to the
end, a queued one is cancelled, and no node logs a denial for either user."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from acl_roles_doc import documented_acl_commands
from ha_helpers import HAWorker, seed_url
from waiting import DEADLINE_S, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
PREFIX = "hacla"
USERS = ("tf-producer", "tf-gateway", "tf-worker", "tf-admin")
CLUSTER_EXTRA = {  # docs/security.md: what cluster mode adds to each role
    "tf-producer": ["+cluster|slots", "+spublish", "+ssubscribe", "+sunsubscribe"],
    "tf-gateway": ["+cluster|slots", "+spublish", "+ssubscribe", "+sunsubscribe"],
    "tf-worker": ["+cluster|slots", "+spublish"],
    "tf-admin": [],
}


def cluster_acl_commands(passwords: dict[str, str]) -> list[list[str]]:
    """The documented commands with the hash-tagged patterns and the cluster additions."""
    out = []
    for argv in documented_acl_commands(PREFIX, passwords, cluster=True):
        out.append([*argv, *CLUSTER_EXTRA[argv[2]]])
    return out


def with_user(url: str, user: str, password: str) -> str:
    assert url.startswith("redis://")
    return f"redis://{user}:{password}@{url[len('redis://') :]}"


@pytest.fixture
def users(redis_cluster: LocalCluster) -> Iterator[dict[str, str]]:
    passwords = {user: os.urandom(12).hex() for user in USERS}
    nodes = [redis.Redis(port=p) for p in redis_cluster.ports]
    version = tuple(int(x) for x in str(nodes[0].info("server")["redis_version"]).split(".")[:2])
    setinfo = ["+client|setinfo"] if version >= (7, 2) else []  # docs/security.md: add it there
    try:
        for node in nodes:
            for argv in cluster_acl_commands(passwords):
                node.execute_command(*argv, *setinfo)
            node.acl_log_reset()
        yield passwords
    finally:
        for node in nodes:
            for user in USERS:
                node.acl_deluser(user)
            node.close()


def denials(cluster: LocalCluster, names: set[str]) -> list[dict[str, Any]]:
    out = []
    for port in cluster.ports:
        with redis.Redis(port=port) as node:
            for entry in node.acl_log(count=1000):
                text = {
                    (k.decode() if isinstance(k, bytes) else k): v.decode()
                    if isinstance(v, bytes)
                    else v
                    for k, v in entry.items()
                }
                if text.get("username") in names:
                    out.append({"port": port, **text})
    return out


def test_the_documented_roles_run_a_fleet_on_the_cluster(
    redis_cluster: LocalCluster, users: dict[str, str], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    seed = seed_url(redis_cluster, PREFIX)
    worker_url = with_user(seed, "tf-worker", users["tf-worker"])
    worker = HAWorker(tiny_llama_dir, redis_cluster, PREFIX, "acl-w", tmp_path,
                      "--priorities", "critical,normal", "--redis-url", worker_url)  # fmt: skip
    try:
        settings = Settings(
            redis_url=with_user(seed, "tf-producer", users["tf-producer"]),
            redis_mode="cluster",
            key_prefix=PREFIX,
        )
        with Client.from_url(settings=settings) as client:
            wait_for(lambda: worker.alive() and client.models(), "the worker")
            handle = client.submit("ACL on a cluster", max_tokens=8, ignore_eos=True)
            events = list(handle.stream(timeout=DEADLINE_S))
            assert handle.result(timeout=DEADLINE_S).token_ids and len(events) == 9
            queued = client.submit("never served", priority="batch", max_tokens=4)
            assert queued.cancel()
            wait_for(
                lambda: client.status(queued.request_id).status == "cancelled",
                "the cancel",
            )
        assert denials(redis_cluster, {"tf-worker", "tf-producer"}) == []
        assert worker.alive(), worker.output()
    finally:
        worker.close()
