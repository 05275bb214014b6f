"""The one place every tokenfleet process builds its Redis clients (sync and asyncio).

``redis_client(settings)`` / ``async_redis_client(settings)`` read ``Settings.redis_mode``:

- ``standalone``: the server ``settings.redis_url`` names, with the pool options
  ``Redis.from_url(settings.redis_url, **settings.redis_options())`` would give (built here:
  the connection class is one of ``replica_wait.refusing``'s).
- ``sentinel``: the primary of ``settings.sentinel_service`` as the ``settings.sentinels`` report
  it (redis-py's ``Sentinel.master_for``). ``redis_url`` still gives the database number, the
  username and password, and TLS (``rediss://`` and its ``ssl_*`` query options); its host and
  port are ignored. The client's pool is a ``SentinelConnectionPool``: each new connection asks
  the sentinels where the primary is, and a connection that gets ``READONLY`` (a demoted primary)
  is closed and raised as a ``ConnectionError``, so the callers' outage handling (the worker's
  loop, a handle's retries) reconnects to the new primary. A connection built from the pool's
  ``connection_class`` and ``connection_kwargs`` (``worker.pipelined.dedicated_connection``,
  the producer's pub/sub connection) resolves the primary the same way
  (``shared.sentinel_connection``).
- ``cluster``: the primary that owns one hash slot: the lane's ``{prefix|model}`` when
  ``settings.lane`` names one, else the fleet's ``{prefix}``, or the slot of the ``root`` given
  (``shared.keys.Keys``). A process that touches several slots holds one client per slot (the
  producer's ``core.slot_clients``, the worker's fleet client). ``redis_url`` names any node
  of the cluster (the seed; the client then remembers every node the cluster reports), with
  credentials and TLS; its db must be 0. Each new connection asks a node which primary owns the slot
  (``CLUSTER SLOTS``), and a redirection reply (``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``,
  ``READONLY``) closes it and is raised as a ``ConnectionError``, so the callers' outage handling
  reconnects to the slot's owner after a failover or a migration (``shared.cluster_connection``;
  dedicated and pub/sub connections resolve it the same way).

Every client also carries ``Settings.redis_wait_replicas`` (``shared.replica_wait``): the
worker's pipelines then end each round trip with ``WAIT``, and the producer its writes (submits,
bulk submits, cancels). In every mode its connections take a ``NOREPLICAS`` reply (a primary
with ``min-replicas-to-write`` that lacks replicas) as a lost connection
(``replica_wait.refusing``).

Invariant: every client a tokenfleet process uses for the fleet's data comes from here, so one
setting switches all of them (tests/ha checks the full path in sentinel and in cluster mode).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.connection
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.connection
import redis.retry
import redis.sentinel
from redis.backoff import NoBackoff
from redis.connection import parse_url

from tokenfleet.shared import replica_wait
from tokenfleet.shared.cluster_connection import (
    AsyncSlotConnection,
    AsyncSlotOwner,
    AsyncSlotSSLConnection,
    SlotConnection,
    SlotOwner,
    SlotSSLConnection,
    fleet_slot,
    slot_retry,
)
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.sentinel_connection import (
    AsyncPrimaryConnection,
    AsyncPrimarySSLConnection,
    AsyncSentinelRedis,
    PrimaryConnection,
    PrimarySSLConnection,
    SentinelRedis,
)
from tokenfleet.shared.settings import Settings


def redis_client(settings: Settings, *, root: str | None = None) -> redis.Redis:
    """A sync client with its own connection pool, in the settings' mode. On a cluster it
    reaches the primary of the slot of ``root`` (a hash tag such as ``Keys.pool_root``), by
    default of ``Keys.for_settings(settings).root`` (the lane ``settings.lane``, or the
    fleet's slot)."""
    if settings.redis_mode == "sentinel":
        sentinel = redis.sentinel.Sentinel(
            settings.sentinel_addresses(), sentinel_kwargs=_sentinel_kwargs(settings, redis)
        )
        kwargs = _primary_kwargs(settings, PrimaryConnection, PrimarySSLConnection)
        client = sentinel.master_for(settings.sentinel_service, redis_class=SentinelRedis, **kwargs)
    elif settings.redis_mode == "cluster":
        kwargs = _slot_kwargs(settings, root, SlotOwner, SlotConnection, SlotSSLConnection, redis)
        client = redis.Redis.from_pool(redis.ConnectionPool(**kwargs))
    else:
        kwargs = _url_kwargs(settings, redis.connection.parse_url, redis.Connection)
        client = redis.Redis.from_pool(redis.ConnectionPool(**kwargs))
    return replica_wait.attach(client, _wait(settings))


def async_redis_client(settings: Settings, *, root: str | None = None) -> redis.asyncio.Redis:
    """An asyncio client with its own connection pool, in the settings' mode (``root``: as
    for :func:`redis_client`)."""
    client: redis.asyncio.Redis
    if settings.redis_mode == "sentinel":
        sentinel = redis.asyncio.sentinel.Sentinel(
            settings.sentinel_addresses(), sentinel_kwargs=_sentinel_kwargs(settings, redis.asyncio)
        )
        kwargs = _primary_kwargs(settings, AsyncPrimaryConnection, AsyncPrimarySSLConnection)
        client = sentinel.master_for(
            settings.sentinel_service, redis_class=AsyncSentinelRedis, **kwargs
        )
    elif settings.redis_mode == "cluster":
        kwargs = _slot_kwargs(
            settings,
            root,
            AsyncSlotOwner,
            AsyncSlotConnection,
            AsyncSlotSSLConnection,
            redis.asyncio,
        )
        pool = redis.asyncio.BlockingConnectionPool(
            timeout=settings.redis_socket_timeout_s, **kwargs
        )
        client = redis.asyncio.Redis.from_pool(pool)
    else:
        kwargs = _url_kwargs(settings, redis.asyncio.connection.parse_url, redis.asyncio.Connection)
        kwargs = {"timeout": settings.redis_socket_timeout_s, **kwargs}  # (a URL's ?timeout= wins)
        pool = redis.asyncio.BlockingConnectionPool(**kwargs)  # at its max: wait, don't fail
        client = redis.asyncio.Redis.from_pool(pool)  # the client owns (and closes) its pool
    return replica_wait.attach(client, _wait(settings))


def _url_kwargs(settings: Settings, parse: Any, default: type) -> dict[str, Any]:
    """Pool options for standalone mode: what the URL says (``parse``: redis-py's sync or asyncio
    ``parse_url``), the timeouts, and the URL's kind of connection (TCP, TLS or Unix socket)
    taking ``NOREPLICAS`` as a lost connection. (Built here, not by ``from_url``: the asyncio
    ``from_url`` lets the URL's connection class win over the one given.)"""
    options = parse(settings.redis_url)
    options["connection_class"] = replica_wait.refusing(options.get("connection_class", default))
    return {**settings.redis_options(), **options}


def _wait(settings: Settings) -> replica_wait.ReplicaWait | None:
    if settings.redis_wait_replicas <= 0:
        return None
    return replica_wait.ReplicaWait(settings.redis_wait_replicas, settings.redis_wait_ms)


def _slot_kwargs(
    settings: Settings, root: str | None, owner_class: type, plain: type, tls: type, module: Any
) -> dict[str, Any]:
    """Pool options for cluster mode: connections of class ``plain`` (``tls`` for
    ``rediss://``) sharing one slot owner, which asks the URL's node first (``module``: ``redis``
    or ``redis.asyncio``, for the owner's own query connections)."""
    from_url = parse_url(settings.redis_url)
    url_class = from_url.pop("connection_class", None)
    seed = (from_url.pop("host"), int(from_url.pop("port", 6379)))
    from_url.pop("db", None)  # a cluster has db 0 only (Settings checks the URL asks no other)
    is_tls = url_class is not None and issubclass(url_class, (redis.SSLConnection,))
    is_tls = is_tls or settings.redis_url.startswith("rediss://")
    query = {
        **from_url,
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_connect_timeout_s,
    }
    query_class = module.SSLConnection if is_tls else module.Connection
    slot = fleet_slot(root if root is not None else Keys.for_settings(settings).root)
    owner = owner_class([seed], slot, query_class, query)
    connection_class = replica_wait.refusing(tls if is_tls else plain)
    return {
        **from_url,
        **settings.redis_options(),
        "connection_class": connection_class,
        "slot_owner": owner,
        "retry": slot_retry(module),  # a refused command did not run: resend it at once
    }


def _primary_kwargs(settings: Settings, plain: type, tls: type) -> dict[str, Any]:
    """Connection options for the primary: the URL's db, credentials and TLS (``tls`` as the
    connection class for ``rediss://``, else ``plain``), and the timeouts. The URL's host and
    port are dropped (the sentinels name the primary)."""
    from_url = parse_url(settings.redis_url)
    url_class = from_url.pop("connection_class", None)
    for name in ("host", "port", "path"):
        from_url.pop(name, None)
    is_tls = url_class is not None and issubclass(url_class, redis.SSLConnection)
    from_url["connection_class"] = replica_wait.refusing(tls if is_tls else plain)
    return {**from_url, **settings.redis_options()}


def _sentinel_kwargs(settings: Settings, module: Any) -> dict[str, Any]:
    """Options for the connections to the sentinels themselves (``module``: ``redis`` or
    ``redis.asyncio``): timeouts, their own auth, TLS (``sentinel_tls``), and no retries of
    one sentinel — asking for the primary already goes on to the next sentinel, and redis-py's
    default (backoff of up to seconds per retry) made each reconnect wait about 13 s on a
    sentinel that is down or refuses us (one that died with the primary, in a failover)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_connect_timeout_s,
        "retry": module.retry.Retry(NoBackoff(), 0),
    }
    if settings.sentinel_username:
        kwargs["username"] = settings.sentinel_username
    if settings.sentinel_password:
        kwargs["password"] = settings.sentinel_password
    if settings.sentinel_tls:  # the URL's ssl_* query options (CA, client cert, checks) too
        ssl_options = {k: v for k, v in parse_url(settings.redis_url).items() if k[:4] == "ssl_"}
        kwargs.update(ssl=True, **ssl_options)
    return kwargs
