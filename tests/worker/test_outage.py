"""Redis outages, piece by piece (the whole fleet: test_redis_outage.py): a publish whose replies
were lost runs again without duplicating anything, orphans are found, the rider's backoff."""

from __future__ import annotations

import pytest
import redis
from prometheus_client import CollectorRegistry
from redis.backoff import NoBackoff
from redis.retry import Retry
from worker_helpers import enqueue, make_intake, make_request, record, subscribe, wait_for

from tokenfleet.shared.errors import RedisUnavailable
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.replica_wait import ReplicationLagged
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port
from tokenfleet.worker.intake.claimer import Claimer
from tokenfleet.worker.publish.publisher import Finish, Publisher
from tokenfleet.worker.service.outage import BACKOFF_CEILING_S, BACKOFF_FIRST_S, OutageRider


def test_a_publish_whose_replies_were_lost_runs_again_and_duplicates_nothing(
    r: redis.Redis, redis_url: str, settings: Settings, keys: Keys
) -> None:
    """Redis ran the round trip, then the connection died before the replies were read (a
    restart or a stall past the socket timeout): the worker cannot tell, so it runs it again;
    the tokens count as appended (the list ends at their end), the finish as done."""
    for rid in ("a", "b", "warm"):
        enqueue(r, keys, make_request(rid))
    intake = make_intake(r, settings)
    a, b, warm = intake.starter.start(intake.streams.pull(3))[0]
    log = subscribe(r, keys, ["a", "b"])
    own = redis.Redis.from_url(redis_url)
    publisher = Publisher(own, settings, model_name="default", worker_name="w1")
    warm_event = TokenEvent("warm", 0, 1, "w")
    publisher.publish([(warm, [warm_event])], [])  # loads the script; opens the connection
    conn = publisher._conn
    events = [TokenEvent("a", i, 100 + i, f"<{i}>") for i in range(2)]
    event = TerminalEvent("b", TerminalStatus.DONE, num_tokens=0)
    finish = Finish(event, b.entry.priority, b.entry.entry_id, "")
    pending = publisher.send([(a, events)], [finish], ["a"])
    wait_for(lambda: r.llen(keys.tokens("a")) == 2, "the first try to run")
    conn.disconnect()  # the replies are lost with the connection (they had arrived)
    with pytest.raises(redis.ConnectionError):
        pending.result()
    result = pending.result()  # sent again, on a new connection
    assert pending.attempts == 2
    assert [job for job, _ in result.appended] == [a] and not result.lost
    assert result.finished == [finish]
    assert r.llen(keys.tokens("a")) == 2  # no duplicate
    rec = record(r, keys, "b")
    assert rec is not None and rec.status == "done"
    log.pump()
    assert [e.index for e in log.tokens("a")] == [0, 1]
    assert [e.status for e in log.events["b"]] == [TerminalStatus.DONE]  # one terminal event
    publisher.close()
    own.close()


def test_orphans_are_own_pending_entries_that_no_job_holds(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    """What a lost round trip read (pending under this worker's name, never started) is found
    and claimed again; what the worker runs is not."""
    for rid in ("o1", "o2", "o3"):
        enqueue(r, keys, make_request(rid))
    intake = make_intake(r, settings)
    read = intake.streams.pull(3)  # read, as by a round trip whose reply was lost
    claimer = Claimer(r, intake.streams, claim_idle_s=5)
    found = claimer.orphans({read[0].key})  # the first one runs
    assert [e.key for e in found] == [e.key for e in read[1:]]
    assert claimer.orphans({e.key for e in read}) == []


def _rider(
    client: redis.Redis, retry_s: float, probe_key: str = ""
) -> tuple[OutageRider, list[float]]:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    rider = OutageRider(
        client,
        worker_name="w",
        retry_s=retry_s,
        registry=CollectorRegistry(),
        model_name="m",
        probe_key=probe_key,
        clock=lambda: now[0],
        sleep=sleep,
    )
    return rider, slept


def test_the_rider_backs_off_with_jitter_and_gives_up_after_retry_s() -> None:
    # no redis-py retries: each PING fails at once (the fake clock counts the rider's backoff)
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    rider, slept = _rider(dead, retry_s=5)
    with pytest.raises(RedisUnavailable, match="unreachable"):
        rider.wait(redis.ConnectionError("gone"))
    bounds = [min(BACKOFF_CEILING_S, BACKOFF_FIRST_S * 2**i) for i in range(len(slept))]
    assert all(b / 2 <= s <= b for s, b in zip(slept, bounds, strict=True))
    assert max(slept) <= BACKOFF_CEILING_S and sum(slept) >= 5
    assert not rider.connected and rider.outages == 1
    reg = rider._connected  # the gauge "waiting for Redis"
    assert reg._value.get() == 0


def test_the_rider_returns_once_redis_answers(r: redis.Redis) -> None:
    rider, slept = _rider(r, retry_s=0)
    rider.wait(redis.TimeoutError("stalled"))
    assert rider.connected and rider.outages == 1 and slept == []
    assert rider._connected._value.get() == 1


def test_the_rider_waits_while_the_primary_refuses_writes() -> None:
    """A primary whose ``min-replicas-to-write`` it cannot meet answers PING but refuses every
    write: an outage that began with a refused write (``ReplicationLagged``) lasts until a write
    goes through (here: never, so the rider gives up), one that began otherwise ends at PING; a
    write that goes through but no replica confirms (``WAIT``) keeps it waiting too."""
    probe = Keys("tf").worker_probe("w")
    with RedisServer() as server:
        client = redis_client(Settings(redis_url=server.url))
        waiting = redis_client(Settings(redis_url=server.url, redis_wait_replicas=1))
        try:
            client.config_set("min-replicas-to-write", 1)
            rider, slept = _rider(client, retry_s=3, probe_key=probe)
            with pytest.raises(RedisUnavailable, match="NOREPLICAS"):
                rider.wait(ReplicationLagged("refused"))
            rider, slept = _rider(client, retry_s=3, probe_key=probe)
            rider.wait(redis.ConnectionError("gone"))
            assert rider.connected and slept == []
            assert not client.exists(probe)  # PING only: nothing written
            client.config_set("min-replicas-to-write", 0)
            rider.wait(ReplicationLagged("refused"))
            assert rider.connected and slept == [] and 0 < client.pttl(probe) <= 1000
            rider, slept = _rider(waiting, retry_s=3, probe_key=probe)  # no replica to confirm
            with pytest.raises(RedisUnavailable, match="0 replicas confirmed"):
                rider.wait(ReplicationLagged("unconfirmed"))
        finally:
            client.close()
            waiting.close()


def test_redis_timeouts_are_settings() -> None:
    assert Settings().redis_options() == {
        "socket_timeout": 10,
        "socket_connect_timeout": 5,
        "health_check_interval": 30,
        "max_connections": 2000,
    }
    env = {"TOKENFLEET_REDIS_SOCKET_TIMEOUT_S": "3", "TOKENFLEET_REDIS_RETRY_S": "0"}
    s = Settings.from_env(env)
    assert s.redis_socket_timeout_s == 3 and s.redis_retry_s == 0
    with pytest.raises(ValueError, match="redis_socket_timeout_s"):
        Settings(redis_socket_timeout_s=0)
    with pytest.raises(ValueError, match="redis_retry_s"):
        Settings(redis_retry_s=-1)


def test_status_says_what_a_worker_knows_about_redis() -> None:
    from tokenfleet.worker.commands.status import render

    def row(**over: object) -> dict[str, object]:
        w = {"name": "w", "model": "m", "priorities": "normal", "beat_age_s": 0.5, "up_s": 9.0}
        w |= {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 1}
        w |= {"kv_usage": 0.0, "tokens_total": 0, "stopping": False, "redis_state": "ok"}
        w |= {"redis_outages": 0, "redis_outage_s": 0.0}
        return w | over

    def text(w: dict[str, object]) -> str:
        snap = {"prefix": "p", "workers": [w], "lapsed_workers": [], "queues": []}
        return render(snap | {"dead_letters": 0, "pools": []})

    assert "Redis" not in text(row())
    assert "recovering from a Redis outage" in text(row(redis_state="recovering"))
    assert "waiting for Redis?" in text(row(beat_age_s=7.0))
    assert "2 Redis outages, 16s" in text(row(redis_outages=2, redis_outage_s=15.7))
