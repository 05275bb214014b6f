"""The CLI's Redis connection flags, declared and read in one place for every command.

``add_redis_flags(parser)`` adds ``--redis-url``, ``--redis-mode``, ``--sentinels`` and
``--sentinel-service``; ``settings_from_flags(args)`` is ``Settings.from_env()`` with the given
flags on top (a flag wins over its environment variable; one left out keeps the environment's
value). ``redis_env(settings)`` is the reverse: the environment variables that carry the
connection settings to a child process (``tokenfleet serve --processes N``).
"""

from __future__ import annotations

import argparse
from typing import Any

from tokenfleet.shared.settings import REDIS_MODES, Settings


def add_redis_flags(parser: argparse.ArgumentParser) -> None:
    """Add the connection flags to ``parser`` (each defaults to its environment variable)."""
    parser.add_argument(
        "--redis-url",
        default=None,
        help="default: $REDIS_URL, else redis://localhost:6379/0 (in sentinel mode: the db, "
        "credentials and TLS only)",
    )
    parser.add_argument(
        "--redis-mode",
        default=None,
        choices=REDIS_MODES,
        help="default: $TOKENFLEET_REDIS_MODE, else standalone (cluster: REDIS_URL names any node)",
    )
    parser.add_argument(
        "--sentinels",
        default=None,
        metavar="HOST:PORT,...",
        help="sentinel mode: the sentinels (default: $TOKENFLEET_SENTINELS)",
    )
    parser.add_argument(
        "--sentinel-service",
        default=None,
        metavar="NAME",
        help="sentinel mode: the monitored service (default: $TOKENFLEET_SENTINEL_SERVICE)",
    )


def settings_from_flags(args: argparse.Namespace, **overrides: Any) -> Settings:
    """``Settings.from_env(**overrides)`` with the connection flags in ``args`` on top.

    Raises:
        SettingsError: a bad environment variable or flag value (e.g. a malformed sentinel list).
    """
    return Settings.from_env(**overrides).with_redis(
        redis_url=getattr(args, "redis_url", None),
        redis_mode=getattr(args, "redis_mode", None),
        sentinels=getattr(args, "sentinels", None),
        sentinel_service=getattr(args, "sentinel_service", None),
    )


def redis_env(settings: Settings) -> dict[str, str]:
    """Environment variables that give a child process the same connection settings."""
    env = {"REDIS_URL": settings.redis_url, "TOKENFLEET_REDIS_MODE": settings.redis_mode}
    if settings.redis_mode == "sentinel":
        env["TOKENFLEET_SENTINELS"] = settings.sentinels
        env["TOKENFLEET_SENTINEL_SERVICE"] = settings.sentinel_service
    return env
