"""The console's dead-letter actions on a real 3-primary Redis Cluster: a real gateway
(``tokenfleet serve --redis-mode cluster --auth required``, seeded with a node that owns neither
slot) lists the dead letters of a model whose lane lives on another primary than the fleet's
slot; a viewer key's requeue and discard are refused and change nothing; an admin key's requeue
runs the request on a real worker (in that lane), and its discard deletes the letter there.

The dead letters are made before any worker runs: the requests wait in the model's queue, and a
scripted pretend worker (``pretend_worker``) ends each ``error`` through the real finish script,
which copies its entry to the lane's dead-letter stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from ha_checks import _cli, gateway_process
from ha_helpers import DEADLINE_S, HAWorker, cluster_flags, cluster_settings, wait_for
from pretend_worker import fail_waiting

from tokenfleet.producer import Client
from tokenfleet.shared.cluster_connection import fleet_slot
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
PREFIX = "hacon"


def model_on_another_primary(cluster: LocalCluster) -> str:
    """A model name whose lane's slot another primary owns than the fleet's slot's."""
    fleet_owner = cluster.owner_port(fleet_slot(Keys(PREFIX, cluster=True).fleet_root))
    for n in range(100):
        name = f"lane{n}"
        if cluster.owner_port(fleet_slot(Keys(PREFIX, cluster=True, lane=name).root)) != (
            fleet_owner
        ):
            return name
    raise AssertionError("every candidate lane is on the fleet's primary")


@dataclass
class ConsoleCluster:
    setup: LocalCluster
    settings: Settings
    model: str
    lane_r: redis.Redis  # a client of the model's lane's primary
    lane_keys: Keys
    url: str  # the gateway's
    viewer: dict[str, str]
    admin: dict[str, str]
    log_dir: Path


@pytest.fixture(scope="module")
def cluster_console(
    redis_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleCluster]:
    settings = cluster_settings(redis_cluster, PREFIX)
    flags = cluster_flags(redis_cluster, PREFIX)
    model = model_on_another_primary(redis_cluster)
    lane = replace(settings, lane=model)
    lane_r = redis_client(lane)
    with redis_client(settings) as fleet_r:  # no worker yet: declared, the model is accepted
        fleet_r.sadd(Keys.for_settings(settings).declared, model)

    def bearer(role: str) -> dict[str, str]:
        made = _cli(PREFIX, flags, "keys", "create", "--name", f"con-{role}", "--role", role,
                    "--json")  # fmt: skip
        return {"Authorization": f"Bearer {json.loads(made)['api_key']}"}

    viewer, admin = bearer("viewer"), bearer("admin")
    log_dir = tmp_path_factory.mktemp("ha-console")
    with gateway_process(PREFIX, flags, log_dir, "--auth", "required") as url:
        yield ConsoleCluster(
            redis_cluster, settings, model, lane_r, Keys.for_settings(lane), url, viewer, admin,
            log_dir,
        )  # fmt: skip
    lane_r.close()


def test_dead_letters_requeue_and_discard_on_the_cluster(
    cluster_console: ConsoleCluster, tiny_llama_dir: Path
) -> None:
    c = cluster_console
    with Client.from_url(settings=c.settings) as producer:
        for i in range(2):
            producer.submit(f"dead letter {i} on a cluster", model=c.model, max_tokens=6,
                            ignore_eos=True, request_id=f"con-{i}")  # fmt: skip
    stream = c.lane_keys.stream(c.model, Priority.NORMAL)
    wait_for(lambda: c.lane_r.xlen(stream) == 2, "both requests queued in the model's lane")
    failed = [fail_waiting(c.lane_r, c.lane_keys, c.model) for _ in range(2)]
    assert failed == ["con-0", "con-1"]
    # the letters are in the lane's slot, on its primary (not the fleet's)
    dead = c.lane_keys.dead_letter
    assert dead.startswith(f"{{{PREFIX}|{c.model}}}:")
    with redis.Redis(port=c.setup.owner_port(fleet_slot(dead))) as direct:
        assert direct.xlen(dead) == 2

    with httpx.Client(base_url=c.url, timeout=30) as http:

        def listed() -> dict[str, Any]:
            got = http.get("/console/status.json", headers=c.viewer)
            assert got.status_code == 200, got.text
            snapshot: dict[str, Any] = got.json()
            return snapshot if len(snapshot["dead"]) == 2 else {}

        # (a new lane is seen once the gateway's cached list of lanes is read again: <= 1 s)
        snap = wait_for(listed, "the console to list both dead letters")
        letters = {d["request_id"]: d for d in snap["dead"]}
        assert set(letters) == set(failed)
        assert {d["lane"] for d in letters.values()} == {c.model}
        assert all(d["requeueable"] for d in letters.values())
        assert snap["status"]["dead_letters"] == 2  # as ``tokenfleet status`` counts
        page = http.get("/console", headers=c.viewer).text
        assert all(f">{rid}</a>" in page for rid in failed)
        forms = {rid: {"lane": d["lane"], "entry": d["entry"]} for rid, d in letters.items()}

        for action in ("requeue", "discard"):  # a viewer looks, never acts
            refused = http.post(f"/console/dead/{action}", data=forms["con-0"], headers=c.viewer)
            assert refused.status_code == 403 and "may look, not act" in refused.text
        assert c.lane_r.xlen(dead) == 2 and c.lane_r.xlen(stream) == 0  # nothing changed

        requeued = http.post("/console/dead/requeue", data=forms["con-0"], headers=c.admin)
        assert requeued.status_code == 200, requeued.text
        new_id = requeued.text.split('href="/console/requests/', 1)[1].split('"', 1)[0]
        assert new_id.startswith("con-0.r")
        assert c.lane_r.xlen(stream) == 1  # queued again in its lane
        again = http.post("/console/dead/requeue", data=forms["con-0"], headers=c.admin)
        assert again.status_code == 409 and "no dead letter" in again.text  # runs once

        discarded = http.post("/console/dead/discard", data=forms["con-1"], headers=c.admin)
        assert discarded.status_code == 200 and "discarded" in discarded.text
        gone = http.post("/console/dead/discard", data=forms["con-1"], headers=c.admin)
        assert gone.status_code == 200 and "already gone" in gone.text
        assert c.lane_r.xlen(dead) == 0

        worker = HAWorker(tiny_llama_dir, c.setup, PREFIX, "con-w", c.log_dir, model=c.model)
        try:
            wait_for(lambda: worker.ready(c.lane_r), "the lane's worker")
            with Client.from_url(settings=c.settings) as producer:
                result = producer.handle(new_id).result(timeout=DEADLINE_S)
            assert result.usage["completion_tokens"] == 6  # the requeued request ran
        finally:
            worker.close()
        record = http.get(f"/console/requests/{new_id}", headers=c.viewer)
        assert record.status_code == 200
        assert '<dd data-k="status"><span class="status done">done</span>' in record.text
        after = http.get("/console/status.json", headers=c.viewer).json()
        assert after["dead"] == [] and after["status"]["dead_letters"] == 0
