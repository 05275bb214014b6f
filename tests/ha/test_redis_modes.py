"""Connection modes: settings validation, the CLI flags, and the client factory (one place for
every process). Sentinel-mode clients are checked against the session's real Sentinel setup,
cluster-mode ones against the session's real Redis Cluster."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import pytest
import redis

from tokenfleet.shared.cluster_connection import (
    AsyncSlotConnection,
    SlotConnection,
    SlotMoved,
    SlotSSLConnection,
    fleet_slot,
)
from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.redis_connect import async_redis_client, redis_client
from tokenfleet.shared.redis_flags import add_redis_flags, redis_env, settings_from_flags
from tokenfleet.shared.sentinel_connection import PrimaryConnection, PrimarySSLConnection
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel
from tokenfleet.worker.pipelined import dedicated_connection

SENTINEL_ENV = {
    "TOKENFLEET_REDIS_MODE": "sentinel",
    "TOKENFLEET_SENTINELS": "10.0.0.1:26379, sentinel-b:26380,[::1]:26381",
    "TOKENFLEET_SENTINEL_SERVICE": "mymaster",
}


def test_settings_read_the_sentinel_variables() -> None:
    s = Settings.from_env(SENTINEL_ENV)
    assert s.redis_mode == "sentinel" and s.sentinel_service == "mymaster"
    assert s.sentinel_addresses() == [("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381)]
    assert Settings.from_env({}).redis_mode == "standalone"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**SENTINEL_ENV, "TOKENFLEET_SENTINELS": "a:1,b"}, "entry 'b' is not host:port"),
        ({**SENTINEL_ENV, "TOKENFLEET_SENTINELS": "a:1,,b:2"}, "entry '' is not host:port"),
        ({**SENTINEL_ENV, "TOKENFLEET_SENTINELS": "a:99999"}, "not host:port"),
        ({**SENTINEL_ENV, "TOKENFLEET_SENTINELS": ""}, "needs the sentinels"),
        ({**SENTINEL_ENV, "TOKENFLEET_SENTINEL_SERVICE": ""}, "service's name"),
        ({**SENTINEL_ENV, "REDIS_URL": "unix:///tmp/r.sock"}, "not a unix socket"),
        ({"TOKENFLEET_REDIS_MODE": "sentinels"}, "not one of standalone, sentinel, cluster"),
        ({"TOKENFLEET_SENTINEL_SERVCE": "x"}, "unknown setting TOKENFLEET_SENTINEL_SERVCE"),
        ({**SENTINEL_ENV, "TOKENFLEET_SENTINEL_TLS": "yes"}, "SENTINEL_TLS must be 0 or 1"),
        ({**SENTINEL_ENV, "TOKENFLEET_SENTINEL_TLS": "2"}, "must be 0 or 1"),
    ],
)
def test_bad_connection_settings_fail_with_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("url", "message"),
    [("unix:///tmp/r.sock", "not a unix socket"), ("redis://h:7000/2", "db 0 only")],
)
def test_cluster_mode_refuses_a_url_no_cluster_serves(url: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings(redis_url=url, redis_mode="cluster")


def test_cluster_mode_clients_resolve_the_fleet_slot_from_the_url_s_node() -> None:
    s = Settings(redis_url="rediss://app:pw@node-a:7001/0?ssl_cert_reqs=none", key_prefix="f",
                 redis_mode="cluster")  # fmt: skip
    client = redis_client(s)  # lazy: nothing connects yet
    pool = client.connection_pool
    assert issubclass(pool.connection_class, SlotSSLConnection)
    owner = pool.connection_kwargs["slot_owner"]
    assert owner.seeds == [("node-a", 7001)] and owner.slot == fleet_slot("{f}")
    assert (pool.connection_kwargs["username"], pool.connection_kwargs["password"]) == ("app", "pw")
    assert "db" not in owner.query_kwargs and owner.query_kwargs["password"] == "pw"
    aclient = async_redis_client(Settings(redis_url="redis://n:1/0", redis_mode="cluster"))
    assert issubclass(aclient.connection_pool.connection_class, AsyncSlotConnection)
    plain = redis_client(Settings(redis_url="redis://n:1", redis_mode="cluster"))
    kind = plain.connection_pool.connection_class
    assert issubclass(kind, SlotConnection) and not issubclass(kind, redis.SSLConnection)


def test_every_kind_of_connection_reaches_the_slot_s_primary(redis_cluster: LocalCluster) -> None:
    slot = fleet_slot("{modes}")
    owner = redis_cluster.owner_port(slot)
    seed = next(p for p in redis_cluster.ports if p != owner)
    s = Settings(redis_url=f"redis://127.0.0.1:{seed}/0", key_prefix="modes", redis_mode="cluster")
    client = redis_client(s)
    try:
        assert client.set("{modes}:probe", 1) and client.get("{modes}:probe") == b"1"
        conn = dedicated_connection(client)  # outside the pool: the worker's reader, publisher
        try:
            conn.send_command("PING")
            assert conn.read_response() in (b"PONG", "PONG")
            assert conn.port == owner
            conn.send_command("SET", "elsewhere", 1)  # another slot: MOVED, a lost connection
            with pytest.raises(SlotMoved):
                conn.read_response()
            assert conn._sock is None  # it closed itself: the next use reconnects
        finally:
            conn.disconnect()
    finally:
        client.close()

    async def get_async() -> object:
        aclient = async_redis_client(s)
        try:
            return await aclient.get("{modes}:probe")
        finally:
            await aclient.aclose()

    assert asyncio.run(get_async()) == b"1"


def test_the_cli_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://:pw@127.0.0.1:1/2")  # (the suite's may be unix://)
    for var, value in SENTINEL_ENV.items():
        monkeypatch.setenv(var, value)
    parser = argparse.ArgumentParser()
    add_redis_flags(parser)
    s = settings_from_flags(parser.parse_args(["--sentinels", "h:1", "--sentinel-service", "x"]))
    assert (s.redis_mode, s.sentinels, s.sentinel_service) == ("sentinel", "h:1", "x")
    assert Settings.from_env(redis_env(s)) == s  # what `serve --processes N` hands its children
    s = settings_from_flags(parser.parse_args(["--redis-mode", "standalone"]))
    assert s.redis_mode == "standalone"
    with pytest.raises(SettingsError, match="not host:port"):
        settings_from_flags(parser.parse_args(["--sentinels", "nope"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--redis-mode", "replicated"])


def test_sentinel_mode_takes_db_credentials_and_tls_from_the_url() -> None:
    s = Settings(
        redis_url="rediss://app:secret@ignored-host:1/3?ssl_cert_reqs=none",
        redis_mode="sentinel",
        sentinels="127.0.0.1:1",
        sentinel_service="svc",
        sentinel_password="sentinel-secret",
    )
    client = redis_client(s)  # lazy: nothing connects yet
    kwargs = client.connection_pool.connection_kwargs
    assert issubclass(client.connection_pool.connection_class, PrimarySSLConnection)
    assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (3, "app", "secret")
    assert "host" not in kwargs and kwargs["socket_timeout"] == s.redis_socket_timeout_s
    plain = redis_client(Settings(redis_mode="sentinel", sentinels="h:1", sentinel_service="s"))
    kind = plain.connection_pool.connection_class
    assert issubclass(kind, PrimaryConnection) and not issubclass(kind, redis.SSLConnection)


def test_every_kind_of_connection_reaches_the_primary_the_sentinels_name(
    sentinel_setup: LocalSentinel,
) -> None:
    s = Settings(
        redis_url="redis://127.0.0.1:1/0",
        redis_mode="sentinel",
        sentinels=sentinel_setup.sentinels,
        sentinel_service=sentinel_setup.service,
    )
    primary = sentinel_setup.primary_port()
    client = redis_client(s)
    try:
        assert client.ping()
        conn = dedicated_connection(client)  # outside the pool: the worker's reader, publisher
        try:
            conn.send_command("PING")
            assert conn.read_response() in (b"PONG", "PONG")
            assert conn.port == primary
        finally:
            conn.disconnect()
    finally:
        client.close()

    async def ping_async() -> bool:
        aclient = async_redis_client(s)
        try:
            return bool(await aclient.ping())
        finally:
            await aclient.aclose()

    assert asyncio.run(ping_async())


def test_a_round_trip_no_replica_confirms_counts_as_a_lost_connection(redis_url: str) -> None:
    from tokenfleet.shared.replica_wait import ReplicationLagged
    from tokenfleet.worker.pipelined import ScriptPipeline

    with pytest.raises(SettingsError, match="redis_wait_replicas"):
        Settings(redis_wait_replicas=-1)
    plain = redis_client(Settings(redis_url=redis_url))
    waiting = redis_client(Settings(redis_url=redis_url, redis_wait_replicas=1, redis_wait_ms=50))
    try:
        pipe = ScriptPipeline(plain)
        pipe.command("PING")
        assert pipe.execute() in ([b"PONG"], [True])  # no WAIT asked: the replies as they are
        pipe = ScriptPipeline(waiting)  # the private server has no replica: WAIT answers 0
        pipe.command("PING")
        with pytest.raises(ReplicationLagged, match="0 replicas confirmed"):
            pipe.execute()
        assert waiting.ping()  # the pool is usable again: that connection was dropped
    finally:
        plain.close()
        waiting.close()


def test_a_producer_write_no_replica_confirms_is_not_acknowledged(
    redis_url: str, r: redis.Redis
) -> None:
    """``redis_wait_replicas``: a submit, a bulk submit and a cancel end with ``WAIT``; with no
    replica to confirm (the private server has none) a submit is sent again (the same id, at most
    once in Redis) until ``redis_retry_s``, then fails; the caller is never told it stands."""
    from tokenfleet.producer import Client
    from tokenfleet.shared.errors import RedisUnavailable
    from tokenfleet.shared.replica_wait import ReplicationLagged

    base = Settings(redis_url=redis_url, key_prefix="rw", routing="off")
    lagging = dataclasses.replace(base, redis_wait_replicas=1, redis_wait_ms=20, redis_retry_s=1)
    with Client.from_url(settings=base) as plain:
        kept = plain.submit("queued, never served", request_id="kept")  # unconfirmed: fine
        with Client.from_url(settings=lagging) as client:
            with pytest.raises(RedisUnavailable, match="replicas confirmed"):
                client.submit("a request", request_id="sub-1")
            assert r.xlen(Keys("rw").stream("default", Priority.NORMAL)) == 2  # once, not per try
            with pytest.raises(RedisUnavailable, match="replicas confirmed"):
                client.submit_many(["a", "b"])
            with pytest.raises(ReplicationLagged):
                client.cancel(kept.request_id)
            assert client.status("sub-1").status == "queued"  # written, just not confirmed

    async def the_same_from_asyncio() -> None:
        from tokenfleet.producer import AsyncClient

        async with AsyncClient.from_url(settings=lagging) as aclient:
            with pytest.raises(RedisUnavailable, match="replicas confirmed"):
                await aclient.submit("a request", request_id="sub-2")
            with pytest.raises(RedisUnavailable, match="replicas confirmed"):
                await aclient.submit_many(["c"])
            with pytest.raises(ReplicationLagged):
                await aclient.cancel("sub-2")

    asyncio.run(the_same_from_asyncio())


@pytest.mark.parametrize("unix_socket", [True, False], ids=["unix", "tcp"])
def test_a_write_refused_for_lack_of_replicas_counts_as_a_lost_connection(
    unix_socket: bool,
) -> None:
    """``min-replicas-to-write`` on a server with no replica: every write is refused with
    ``NOREPLICAS``; the factory's clients (sync and asyncio, a one-shot command and a pipeline)
    raise ``ReplicationLagged`` (a ``ConnectionError``: the callers' outage handling) instead of
    the command's own error, and stay usable for reads; the URL's connection kind is kept."""
    from tokenfleet.shared.replica_wait import ReplicationLagged
    from tokenfleet.worker.devtools.local_redis import RedisServer

    with RedisServer(unix_socket=unix_socket) as server:
        settings = Settings(redis_url=server.url, redis_retry_s=0)
        client = redis_client(settings)
        try:
            client.config_set("min-replicas-to-write", 1)
            kind = client.connection_pool.connection_class
            assert issubclass(
                kind, redis.UnixDomainSocketConnection if unix_socket else redis.Connection
            )
            with pytest.raises(ReplicationLagged, match="NOREPLICAS"):
                client.set("k", 1)
            pipe = client.pipeline(transaction=False)
            pipe.get("k")
            pipe.set("k", 1)
            pipe.get("k")
            with pytest.raises(ReplicationLagged):
                pipe.execute()
            assert client.get("k") is None  # reads still answered, nothing was written

            async def refused_async() -> None:
                aclient = async_redis_client(settings)
                try:
                    with pytest.raises(ReplicationLagged, match="NOREPLICAS"):
                        await aclient.set("k", 1)
                    assert await aclient.get("k") is None
                finally:
                    await aclient.aclose()

            asyncio.run(refused_async())
        finally:
            client.close()
