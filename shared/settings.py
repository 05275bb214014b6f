"""Settings every tokenfleet process shares, read from the environment or given explicitly.

``Settings.from_env()`` reads ``REDIS_URL`` and ``TOKENFLEET_*`` as each field declares them
(``tokenfleet.shared.declared_settings``); a ``TOKENFLEET_`` variable that no process declares is
an error rather than silently ignored (a misspelt setting should fail loudly). Every setting, of
every process kind: docs/configuration.md, generated from the declarations.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlparse

from tokenfleet.shared import declared_settings
from tokenfleet.shared.declared_settings import label, setting
from tokenfleet.shared.errors import SettingsError

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# A pooled connection idle this long is PINGed before it is used again, so one a restarted Redis
# dropped is replaced before a command fails. A constant: far below any proxy's idle timeout,
# and it costs one PING per idle connection only.
REDIS_HEALTH_CHECK_S = 30
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_URL_SCHEMES = ("redis", "rediss", "unix")
# prefix: by cached prefix and session; session: by session only (no tokenizing); off: none
ROUTING_MODES = ("prefix", "session", "off")
REDIS_MODES = ("standalone", "sentinel", "cluster")
_LANE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")  # a model name (shared.keys)


@dataclass(frozen=True, slots=True)
class Settings:
    """Connection and protocol settings; each field's declaration says what it does.

    Invariants (checked at construction): ``redis_url`` is a Redis URL that ``redis_mode`` can
    use; in sentinel mode ``sentinels`` parses and ``sentinel_service`` is given; ``key_prefix``
    is 1-64 safe characters; every count and duration is a positive integer except
    ``redis_retry_s`` and ``redis_wait_replicas`` (0 allowed).
    """

    redis_url: str = setting(
        DEFAULT_REDIS_URL,
        env="REDIS_URL",
        flag="--redis-url",
        help="where the fleet's Redis lives (redis://, rediss:// or unix://); in sentinel mode "
        "it gives only the db, credentials and TLS, in cluster mode it names any node (db 0)",
    )
    key_prefix: str = setting(
        "tokenfleet",
        env="TOKENFLEET_KEY_PREFIX",
        help="first segment of every key and channel, so several fleets share one Redis",
    )
    record_ttl_s: int = setting(
        86_400,
        env="TOKENFLEET_RECORD_TTL_S",
        help="lifetime of a request's durable record after it was last written (seconds)",
    )
    max_payload_bytes: int = setting(
        1_048_576,
        env="TOKENFLEET_MAX_PAYLOAD_BYTES",
        help="largest encoded request accepted; checked before parsing",
    )
    max_tokens_limit: int = setting(
        32_768,
        env="TOKENFLEET_MAX_TOKENS_LIMIT",
        help="largest max_tokens a request may ask for",
    )
    redis_socket_timeout_s: int = setting(
        10,
        env="TOKENFLEET_REDIS_SOCKET_TIMEOUT_S",
        help="a Redis reply later than this (seconds) counts as a lost connection: the caller "
        "reconnects and retries (see TOKENFLEET_REDIS_RETRY_S); longer than any command "
        "tokenfleet sends (blocking reads wait 1 s), short enough to notice a stalled server",
        see=("Redis outages", "redis-modes.md#redis-outages"),
    )
    redis_connect_timeout_s: int = setting(
        5,
        env="TOKENFLEET_REDIS_CONNECT_TIMEOUT_S",
        help="how long one connection attempt may take (seconds)",
    )
    redis_retry_s: int = setting(
        300,
        env="TOKENFLEET_REDIS_RETRY_S",
        help="how long a process rides out a Redis outage (restarting, stalled or unreachable) "
        "before it gives up: a handle raises RedisUnavailable, a worker exits with status 5; "
        "0 keeps trying forever (seconds)",
        see=("Redis outages", "redis-modes.md#redis-outages"),
    )
    resubmit_lost: bool = setting(
        True,
        env="TOKENFLEET_RESUBMIT_LOST",
        help="a handle (and the gateway, and the Batch API runner) whose accepted request Redis "
        "lost (record and entry gone: a failover, a restart from an older snapshot) submits it "
        "again with the same id and parameters, once per loss; 0: raise RequestLost instead",
        see=("Failover", "redis-modes.md#failover-nothing-lost"),
    )
    redis_max_connections: int = setting(
        2000,
        env="TOKENFLEET_REDIS_MAX_CONNECTIONS",
        help="connections one client's pool opens at most; an asyncio client at the limit "
        "waits for a free one (up to the socket timeout) instead of failing (redis-py's own "
        "cap, 100, failed a gateway or batch runner with more requests in flight)",
    )
    redis_mode: str = setting(
        "standalone",
        env="TOKENFLEET_REDIS_MODE",
        flag="--redis-mode",
        choices=REDIS_MODES,
        help="how clients reach Redis: standalone (the server REDIS_URL names), sentinel (the "
        "primary the sentinels name for the service) or cluster (the primaries owning the "
        "fleet's hash slots: one per model's lane, one for the fleet)",
        see=("Redis modes", "redis-modes.md"),
    )
    sentinels: str = setting(
        "",
        env="TOKENFLEET_SENTINELS",
        flag="--sentinels",
        metavar="HOST:PORT,...",
        help="sentinel mode: the Sentinel processes, host:port,host:port,... (an IPv6 host in "
        "brackets)",
    )
    sentinel_service: str = setting(
        "",
        env="TOKENFLEET_SENTINEL_SERVICE",
        flag="--sentinel-service",
        metavar="NAME",
        help="sentinel mode: the service (master) name the sentinels monitor",
    )
    sentinel_username: str = setting(
        "",
        env="TOKENFLEET_SENTINEL_USERNAME",
        help="ACL user for the sentinels themselves, if they require auth",
    )
    sentinel_password: str = setting(
        "",
        env="TOKENFLEET_SENTINEL_PASSWORD",
        help="password for the sentinels themselves, if they require auth",
    )
    sentinel_tls: bool = setting(
        False,
        env="TOKENFLEET_SENTINEL_TLS",
        help="reach the sentinels themselves over TLS, with the ssl_* options of REDIS_URL's "
        "query (its CA, client certificate, checks); off: plain TCP",
        see=("Redis modes", "redis-modes.md"),
    )
    redis_wait_replicas: int = setting(
        0,
        env="TOKENFLEET_REDIS_WAIT_REPLICAS",
        help="N > 0: every round trip of a worker's pipelines (reads, starts, token and finish "
        "publishes), and a producer's submits and cancels, must be confirmed by N replicas "
        "(WAIT) or it counts as a lost connection and is sent again after reconnecting",
        see=("What a failover may lose", "redis-modes.md#what-a-failover-may-lose"),
    )
    redis_wait_ms: int = setting(
        500,
        env="TOKENFLEET_REDIS_WAIT_MS",
        help="how long one WAIT may take before the round trip counts as lost (milliseconds)",
    )
    routing: str = setting(
        "prefix",
        env="TOKENFLEET_ROUTING",
        choices=ROUTING_MODES,
        help="prefix: a producer routes a request to the live worker holding its longest cached "
        "prefix, or its session's worker; session: by session only (nothing tokenized: a "
        "cheaper submit); off: every request goes to its queue's shared stream. A worker with "
        "off publishes nothing and is never a routing target (it still steals)",
        see=("Routing", "routing.md"),
    )
    session_ttl_s: int = setting(
        600,
        env="TOKENFLEET_SESSION_TTL_S",
        help="how long a session stays pinned to its worker after its last request (seconds)",
    )
    lane: str = setting(
        "",
        help="set by code, not by the environment: the model whose lane (hash slot) this "
        "process's clients serve in cluster mode (a worker sets its model); empty: the fleet's "
        "own slot; ignored off a cluster",
    )

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_MODES:
            raise SettingsError(
                f"{label(Settings, 'routing')} must be one of {', '.join(ROUTING_MODES)}, "
                f"got {self.routing!r}"
            )
        validate_redis_url(self.redis_url)
        validate_mode(self)
        if self.lane and not _LANE_RE.match(self.lane):
            raise SettingsError(f"lane {self.lane!r} is not a model name")
        if not _PREFIX_RE.match(self.key_prefix):
            raise SettingsError(
                f"{label(Settings, 'key_prefix')} must be 1-64 characters of letters, digits, "
                f"'_', '.' or '-', got {self.key_prefix!r}"
            )
        for name in (
            "record_ttl_s",
            "max_payload_bytes",
            "max_tokens_limit",
            "redis_socket_timeout_s",
            "redis_connect_timeout_s",
            "redis_wait_ms",
            "redis_max_connections",
            "session_ttl_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SettingsError(
                    f"{label(Settings, name)} must be a positive integer, got {value!r}"
                )
        for name in ("redis_retry_s", "redis_wait_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SettingsError(
                    f"{label(Settings, name)} must be an integer >= 0, got {value!r}"
                )
        if self.sentinel_tls not in (0, 1):  # a bool; 0 and 1 are accepted as they equal one
            raise SettingsError(
                f"{label(Settings, 'sentinel_tls')} must be 0 or 1, got {self.sentinel_tls!r}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``REDIS_URL`` and ``TOKENFLEET_*`` (default: ``os.environ``);
        non-None ``overrides`` win.

        Raises:
            SettingsError: an unknown ``TOKENFLEET_`` variable, or a value that does not parse.
        """
        return declared_settings.from_env(cls, env, overrides)

    def redis_options(self) -> dict[str, Any]:
        """Connection pool options (sync or asyncio; ``shared.redis_connect`` adds the URL's):
        the timeouts above.
        redis-py's own retries are left at their default; riding out an outage is the caller's
        (the worker's loop, a handle's reads), which knows what is safe to repeat."""
        return {
            "socket_timeout": self.redis_socket_timeout_s,
            "socket_connect_timeout": self.redis_connect_timeout_s,
            "health_check_interval": REDIS_HEALTH_CHECK_S,
            "max_connections": self.redis_max_connections,
        }

    def with_url(self, redis_url: str | None) -> Settings:
        """A copy with ``redis_url`` replaced when one is given (CLI ``--redis-url``)."""
        return self if not redis_url else replace(self, redis_url=redis_url)

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """``sentinels`` as ``(host, port)`` pairs (validated in ``__post_init__``)."""
        return parse_sentinels(self.sentinels)


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
