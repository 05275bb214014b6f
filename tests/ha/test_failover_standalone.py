"""Chaos, standalone Redis: restarted from a snapshot taken mid-run, with the default settings
(no AOF, no WAIT). Everything Redis took after the snapshot is gone when it comes back: token
lists shorter than the workers left them, records back at ``running`` or ``queued``, ends
undone, entries the workers had acked back in their pending lists. The workers put it back from
what they published (worker/service/repair.py); requests submitted after the snapshot that no
worker has started are gone too: their handles (and the gateway's) submit them again. Every
request ends exactly once, ``done``, each client stream (``Handle.stream()`` and SSE through the
gateway) gap-free, duplicate-free and equal to the undisturbed greedy run
(tests/ha/chaos_fleet.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from chaos_fleet import chaos_fleet, heartbeat_of
from ha_helpers import wait_for

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow
PREFIX = "chs"
SHORT = 40  # requests that end between the snapshot and the restart


def test_restarted_from_a_snapshot_taken_mid_run_nothing_is_lost(
    tiny_llama_dir: Path, chaos_reference: dict[str, list[int]], tmp_path: Path
) -> None:
    server = RedisServer(unix_socket=False, appendonly=False).start()
    try:
        settings = Settings(redis_url=server.url, key_prefix=PREFIX)

        def inspect() -> redis.Redis:
            return redis.Redis.from_url(server.url, socket_timeout=10)

        ready = heartbeat_of(inspect, Keys(PREFIX))
        flags = ["--redis-url", server.url]
        with chaos_fleet(
            tiny_llama_dir, tmp_path, settings=settings, flags=flags, inspect=inspect, ready=ready
        ) as fleet:
            fleet.submit(4, sse=2)
            fleet.submit(2, max_tokens=SHORT)
            fleet.wait_running(min_tokens=8)
            with inspect() as r:
                r.save()  # the snapshot (dump.rdb in the server's directory)
            fleet.submit(4, sse=1)  # after the snapshot: gone on restart unless a worker has them

            def one_ended_since() -> bool:
                return any(x is not None and x.status == "done" for x in fleet.records())

            wait_for(one_ended_since, "a request to end after the snapshot")
            recs = fleet.records()
            assert any(x is not None and x.status == "running" for x in recs), recs
            server.restart()  # SIGKILL; the new process loads the snapshot
            fleet.submit(2)  # the restarted server takes new work too
            fleet.check(chaos_reference, "standalone restarted from a mid-run snapshot")
    finally:
        server.stop()
