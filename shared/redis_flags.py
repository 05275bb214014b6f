"""The CLI's Redis connection flags, generated from ``Settings``' declaration for every command.

``add_redis_flags(parser)`` adds the connection fields that declare a flag (``--redis-url``,
``--redis-mode``, ``--sentinels``, ``--sentinel-service``); ``settings_from_flags(args)`` is
``Settings.from_env()`` with the given flags on top (a flag wins over its environment variable;
one left out keeps the environment's value). ``redis_env(settings)`` is the reverse: the
environment variables that carry those settings to a child process (``tokenfleet serve
--processes N``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from tokenfleet.shared.declared_settings import by_key, env_of
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.settings_flags import add_flags, flag_values

CONNECTION_TITLE = "Redis connection (a flag wins over its variable)"


def add_redis_flags(parser: Any, *, exclude: Iterable[str] = ()) -> None:
    """Add the connection flags to ``parser`` (an argparse parser), but those in ``exclude``."""
    add_flags(parser, Settings, exclude=exclude, title=CONNECTION_TITLE)


def settings_from_flags(args: argparse.Namespace, **overrides: Any) -> Settings:
    """``Settings.from_env(**overrides)`` with the connection flags in ``args`` on top.

    Raises:
        SettingsError: a bad environment variable or flag value (e.g. a malformed sentinel list).
    """
    return Settings.from_env(**{**overrides, **flag_values(args, Settings)})


def redis_env(settings: Settings) -> dict[str, str]:
    """Environment variables that give a child process the same connection settings (those the
    flags can set; the child inherits the rest of the environment)."""
    return env_of(settings, [key for key, d in by_key(Settings).items() if d.spec.flags])
