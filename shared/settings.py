"""Settings every tokenfleet process shares, read from the environment or given explicitly.

``Settings.from_env()`` reads ``REDIS_URL`` and ``TOKENFLEET_*``; a ``TOKENFLEET_`` variable this
module does not know is an error rather than silently ignored (a misspelt setting should fail
loudly).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import urlparse

from tokenfleet.shared.errors import SettingsError

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_URL_SCHEMES = ("redis", "rediss", "unix")
# prefix: by cached prefix and session; session: by session only (no tokenizing); off: none
ROUTING_MODES = ("prefix", "session", "off")
_LANE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")  # a model name (shared.keys)
_NOT_FROM_ENV = frozenset({"lane"})  # set by code (a worker: its model)


@dataclass(frozen=True, slots=True)
class Settings:
    """Connection and protocol settings.

    Attributes:
        redis_url: where the fleet's Redis lives (``redis://``, ``rediss://`` or ``unix://``).
        key_prefix: first segment of every key and channel, so several fleets share one Redis.
        record_ttl_s: lifetime of a request's durable record after it was last written.
        max_payload_bytes: largest encoded request accepted; checked before parsing.
        max_tokens_limit: largest ``max_tokens`` a request may ask for.
        redis_socket_timeout_s: a Redis reply that takes longer than this counts as a lost
            connection (the caller reconnects and retries; see ``redis_retry_s``). Longer than
            any command tokenfleet sends (blocking reads wait 1 s), short enough to notice a
            stalled or unreachable server.
        redis_connect_timeout_s: how long one connection attempt may take.
        redis_health_check_s: a pooled connection idle this long is PINGed before it is used
            again (a connection a restarted Redis dropped is replaced before a command fails).
        redis_retry_s: how long a process rides out an outage (Redis restarting, stalled or
            unreachable) before it gives up: a handle raises ``RedisUnavailable``, a worker exits
            with status 5; 0 keeps trying forever.
        redis_max_connections: connections one client's pool opens at most (redis-py 8 caps
            a pool at 100 and then fails commands with ``MaxConnectionsError``; a gateway or a
            batch runner with hundreds of requests in flight needs more). An asyncio client
            waits for a free connection (up to ``redis_socket_timeout_s``) instead of failing.
        redis_mode: how clients reach Redis (``shared.redis_connect`` builds them all):
            ``standalone`` (``redis_url``), ``sentinel`` (the primary of ``sentinel_service`` as
            ``sentinels`` name it; ``redis_url`` still gives db, credentials and TLS) or
            ``cluster`` (the primaries owning the fleet's hash slots: one per model's lane,
            one for the fleet; ``redis_url`` names any node, db 0: docs/redis-modes.md).
        sentinels: ``host:port,host:port,...`` of the Sentinel processes (sentinel mode).
        sentinel_service: the service (master) name the sentinels monitor (sentinel mode).
        sentinel_username: ACL user for the sentinels themselves, if they require auth.
        sentinel_password: password for the sentinels themselves, if they require auth.
        sentinel_tls: 1: reach the sentinels themselves over TLS, with the ``ssl_*`` options of
            ``redis_url``'s query (its CA, client certificate, checks); 0 (default): plain TCP.
        redis_wait_replicas: 0 (default) or N: every round trip of a worker's pipelines (reads,
            starts, token and finish publishes) must be confirmed by N replicas (``WAIT``) or it
            counts as a lost connection and is sent again after reconnecting; a producer's
            submits and cancels likewise (``shared.replica_wait``; docs/redis-modes.md: what
            a failover may lose).
        redis_wait_ms: how long one ``WAIT`` may take before the round trip counts as lost.
        routing: ``prefix`` (the default): a producer routes a request to the live worker
            holding its longest cached prefix, or its session's worker (docs/routing.md);
            ``session``: by session only (the producer tokenizes nothing: a cheaper submit);
            ``off``: every request goes to its queue's shared stream. A worker with ``off``
            publishes nothing and is never a routing target (it still steals).
        session_ttl_s: how long a session stays pinned to its worker after its last request.
        lane: the model whose lane (hash slot) this process's clients serve in cluster mode
            (``shared.keys.Keys``; a worker sets its model); empty: the fleet's own slot. Set
            by code, not by the environment; ignored off a cluster.
    """

    redis_url: str = DEFAULT_REDIS_URL
    key_prefix: str = "tokenfleet"
    record_ttl_s: int = 86_400
    max_payload_bytes: int = 1_048_576
    max_tokens_limit: int = 32_768
    redis_socket_timeout_s: int = 10
    redis_connect_timeout_s: int = 5
    redis_health_check_s: int = 30
    redis_retry_s: int = 300
    redis_max_connections: int = 2000
    redis_mode: str = "standalone"
    sentinels: str = ""
    sentinel_service: str = ""
    sentinel_username: str = ""
    sentinel_password: str = ""
    sentinel_tls: int = 0
    redis_wait_replicas: int = 0
    redis_wait_ms: int = 500
    routing: str = "prefix"
    session_ttl_s: int = 600
    lane: str = ""

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_MODES:
            raise SettingsError(
                f"routing must be one of {', '.join(ROUTING_MODES)}, got {self.routing!r}"
            )
        validate_redis_url(self.redis_url)
        validate_mode(self)
        if self.lane and not _LANE_RE.match(self.lane):
            raise SettingsError(f"lane {self.lane!r} is not a model name")
        if not _PREFIX_RE.match(self.key_prefix):
            raise SettingsError(
                f"key prefix {self.key_prefix!r} must be 1-64 characters of letters, digits, "
                "'_', '.' or '-'"
            )
        for name in (
            "record_ttl_s",
            "max_payload_bytes",
            "max_tokens_limit",
            "redis_socket_timeout_s",
            "redis_connect_timeout_s",
            "redis_health_check_s",
            "redis_wait_ms",
            "redis_max_connections",
            "session_ttl_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SettingsError(f"{name} must be a positive integer, got {value!r}")
        for name in ("redis_retry_s", "redis_wait_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SettingsError(f"{name} must be an integer >= 0, got {value!r}")
        if self.sentinel_tls not in (0, 1) or isinstance(self.sentinel_tls, bool):
            raise SettingsError(
                f"sentinel_tls (TOKENFLEET_SENTINEL_TLS) must be 0 or 1, got {self.sentinel_tls!r}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``REDIS_URL`` and ``TOKENFLEET_<FIELD>``; ``overrides`` win.

        Raises:
            SettingsError: an unknown ``TOKENFLEET_`` variable, or a value that does not parse.
        """
        env = os.environ if env is None else env
        known = {f.name for f in fields(cls)} - _NOT_FROM_ENV
        values: dict[str, Any] = {}
        if env.get("REDIS_URL"):
            values["redis_url"] = env["REDIS_URL"]
        for var, raw in env.items():
            if not var.startswith("TOKENFLEET_"):
                continue
            name = var[len("TOKENFLEET_") :].lower()
            if name not in known:
                if name in _ENV_OWNED_ELSEWHERE or name.startswith(_ENV_PREFIXES_OWNED_ELSEWHERE):
                    continue
                raise SettingsError(
                    f"unknown setting {var}; known: "
                    + ", ".join("TOKENFLEET_" + k.upper() for k in sorted(known))
                )
            values[name] = _parse(name, raw, var)
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - known
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    def redis_options(self) -> dict[str, Any]:
        """Connection pool options (sync or asyncio; ``shared.redis_connect`` adds the URL's):
        the timeouts above.
        redis-py's own retries are left at their default; riding out an outage is the caller's
        (the worker's loop, a handle's reads), which knows what is safe to repeat."""
        return {
            "socket_timeout": self.redis_socket_timeout_s,
            "socket_connect_timeout": self.redis_connect_timeout_s,
            "health_check_interval": self.redis_health_check_s,
            "max_connections": self.redis_max_connections,
        }

    def with_url(self, redis_url: str | None) -> Settings:
        """A copy with ``redis_url`` replaced when one is given (CLI ``--redis-url``)."""
        return self if not redis_url else replace(self, redis_url=redis_url)

    def with_redis(
        self,
        *,
        redis_url: str | None = None,
        redis_mode: str | None = None,
        sentinels: str | None = None,
        sentinel_service: str | None = None,
    ) -> Settings:
        """A copy with the given connection settings replaced (the CLI's Redis flags); ``None``
        keeps the current value. Validated again as a whole."""
        given: dict[str, str | None] = {
            "redis_url": redis_url,
            "redis_mode": redis_mode,
            "sentinels": sentinels,
            "sentinel_service": sentinel_service,
        }
        changes: dict[str, Any] = {k: v for k, v in given.items() if v}
        return replace(self, **changes) if changes else self

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """``sentinels`` as ``(host, port)`` pairs (validated in ``__post_init__``)."""
        return parse_sentinels(self.sentinels)


# Variables read by other components (the worker's own settings); Settings must not reject them.
_ENV_OWNED_ELSEWHERE = frozenset(
    {
        "model",
        "model_name",
        "device",
        "dtype",
        "max_num_seqs",
        "max_batched_tokens",
        "kv_blocks",
        "kv_memory",
        "block_size",
        "max_model_len",
        "model_cache",
        "priorities",
        "name",
        "metrics_port",
        "kv_pool",
        "share_weight",
        "threads",
        "grace_s",
        "num_workers",
        "urgent_slots",
        "batch_yields",
        "steal_after_s",
        "overflow_for",
        "overflow_after_s",
    }
)
# The gateway's settings (``TOKENFLEET_GATEWAY_*``, producer/gateway/settings.py).
_ENV_PREFIXES_OWNED_ELSEWHERE = ("gateway_",)


_STRING_SETTINGS = frozenset(
    {
        "redis_url",
        "key_prefix",
        "redis_mode",
        "sentinels",
        "sentinel_service",
        "sentinel_username",
        "sentinel_password",
        "routing",
    }
)
REDIS_MODES = ("standalone", "sentinel", "cluster")


def _parse(name: str, raw: str, var: str) -> Any:
    if name in _STRING_SETTINGS:
        return raw
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{var} must be an integer, got {raw!r}") from None


def validate_redis_url(url: str) -> str:
    """Return ``url`` unchanged if it is a Redis URL; raise ``SettingsError`` naming the fault."""
    if not isinstance(url, str) or not url:
        raise SettingsError("redis URL is empty; set REDIS_URL or pass --redis-url")
    parsed = urlparse(url)
    if parsed.scheme not in _URL_SCHEMES:
        raise SettingsError(
            f"redis URL {url!r} must start with redis://, rediss:// or unix:// "
            f"(got scheme {parsed.scheme!r})"
        )
    if parsed.scheme == "unix" and not parsed.path:
        raise SettingsError(f"redis URL {url!r} names no socket path")
    if parsed.scheme != "unix" and not parsed.hostname:
        raise SettingsError(f"redis URL {url!r} names no host")
    return url


def parse_sentinels(text: str) -> list[tuple[str, int]]:
    """``host:port,host:port,...`` as pairs; raise ``SettingsError`` naming the bad entry.
    An IPv6 host is written in brackets (``[::1]:26379``)."""
    pairs: list[tuple[str, int]] = []
    for entry in (part.strip() for part in text.split(",")):
        host, sep, port = entry.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not entry or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SettingsError(
                f"sentinel list {text!r}: entry {entry!r} is not host:port "
                "(TOKENFLEET_SENTINELS / --sentinels take host:port,host:port,...)"
            )
        pairs.append((host, int(port)))
    return pairs


def validate_mode(settings: Settings) -> None:
    """Check ``redis_mode`` and, in sentinel mode, the sentinel list and service name."""
    mode = settings.redis_mode
    if mode not in REDIS_MODES:
        raise SettingsError(
            f"redis mode {mode!r} is not one of {', '.join(REDIS_MODES)} "
            "(TOKENFLEET_REDIS_MODE / --redis-mode)"
        )
    if mode == "cluster":
        _validate_cluster_url(settings.redis_url)
    if mode != "sentinel":
        return
    if not settings.sentinels:
        raise SettingsError(
            "sentinel mode needs the sentinels: set TOKENFLEET_SENTINELS or pass --sentinels "
            "host:port,host:port,..."
        )
    parse_sentinels(settings.sentinels)
    if not settings.sentinel_service:
        raise SettingsError(
            "sentinel mode needs the monitored service's name: set TOKENFLEET_SENTINEL_SERVICE "
            "or pass --sentinel-service"
        )
    if urlparse(settings.redis_url).scheme == "unix":
        raise SettingsError(
            "sentinel mode reaches the primary over TCP: REDIS_URL may give db, credentials "
            "and TLS (redis:// or rediss://) but not a unix socket"
        )


def _validate_cluster_url(url: str) -> None:
    """Cluster mode: ``url`` names a node over TCP and asks for db 0 (a cluster has no other)."""
    parsed = urlparse(url)
    if parsed.scheme == "unix":
        raise SettingsError(
            "cluster mode reaches the nodes over TCP: REDIS_URL names any node of the cluster "
            "(redis://host:port or rediss://), not a unix socket"
        )
    db = parsed.path.strip("/")
    if db not in ("", "0"):
        raise SettingsError(
            f"cluster mode: REDIS_URL {url!r} asks for db {db}; a cluster has db 0 only"
        )
