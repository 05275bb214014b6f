"""A worker's heartbeat on a cluster also writes the fleet's registry (another slot): what it
writes, and that a registry that does not answer neither fails the beat nor is asked every beat.

Hash tags mean nothing to a standalone server, so the cluster's names are written to one here."""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import free_port
from tokenfleet.worker.service.heartbeat import REGISTRY_BACKOFF_S, Heartbeat

CLUSTER = Settings(  # a worker's: its lane is its model's (no server is reached through it)
    redis_url="redis://127.0.0.1:7000/0", redis_mode="cluster", key_prefix="rb", lane="m"
)


def test_a_beat_writes_its_lane_and_the_fleet_s_registry(r: redis.Redis) -> None:
    keys = Keys("rb", cluster=True, lane="m")
    beat = Heartbeat(r, CLUSTER, worker_name="w", model_name="m", ttl_s=5, fleet_client=r)
    assert beat.keys == keys
    beat.beat({"model": "m", "running": 0})
    assert r.exists(keys.worker("w")) and r.zscore(keys.served, "m")  # the lane's own copy
    assert r.sismember(keys.fleet.lanes, "m")
    assert (r.zscore(keys.fleet.served, "m") or 0) > time.time()
    beat.beat({"model": "m", "running": 0}, serving=False)  # stopping: still listed, not served
    assert r.sismember(keys.fleet.lanes, "m")


class CountingClient(redis.Redis):
    """A client of a port nothing listens on, counting the registry writes tried."""

    tried = 0

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        CountingClient.tried += 1
        return super().pipeline(*args, **kwargs)


def test_a_registry_that_does_not_answer_costs_one_try_per_backoff(r: redis.Redis) -> None:
    dead = CountingClient(port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    beat = Heartbeat(r, CLUSTER, worker_name="w2", model_name="m", ttl_s=5, fleet_client=dead)
    for _ in range(3):
        beat.beat({"model": "m", "running": 0})  # the lane's beat still goes through
    assert r.exists(beat.keys.worker("w2"))
    assert CountingClient.tried == 1  # then no try for REGISTRY_BACKOFF_S
    beat._register_after -= REGISTRY_BACKOFF_S  # (as if the backoff had passed)
    beat.beat({"model": "m", "running": 0})
    assert CountingClient.tried == 2
