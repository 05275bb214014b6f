"""Where every process kind declares its settings: the one list of settings classes.

The refusal of an undeclared ``TOKENFLEET_*`` variable and docs/configuration.md both read the
classes listed here. They are named by import path, not imported: ``shared`` depends on nothing
above it, and a process that reads only its own settings imports nobody else's. A settings class
that is not listed is caught by tests/test_settings_declaration.py.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

from tokenfleet.shared.declared_settings import env_names


@dataclass(frozen=True, slots=True)
class ProcessKind:
    """One process kind's settings: a title and who reads them (for the docs), and the class."""

    title: str
    readers: str  # who reads them, one line of Markdown
    path: str  # "module:Class"

    def load(self) -> type:
        """The settings class."""
        module, _, name = self.path.partition(":")
        cls = getattr(importlib.import_module(module), name)
        if not isinstance(cls, type):
            raise TypeError(f"{self.path} is not a class")
        return cls


PROCESS_KINDS: tuple[ProcessKind, ...] = (
    ProcessKind(
        "Every process: Redis connection and protocol",
        "every command, the worker, the gateway, the batch runner, the cron process and the "
        "client library (`Settings.from_env()`); the flags are on every command that talks to "
        "Redis",
        "tokenfleet.shared.settings:Settings",
    ),
    ProcessKind(
        "Worker (`tokenfleet worker`)",
        "`tokenfleet worker`",
        "tokenfleet.worker.worker_settings:WorkerSettings",
    ),
    ProcessKind(
        "Model cache",
        "`tokenfleet worker`, `tokenfleet models` and the demo, where a `.gguf` file is converted "
        "once into a folder",
        "tokenfleet.worker.models.gguf_cache:ModelCacheSettings",
    ),
    ProcessKind(
        "Gateway (`tokenfleet serve`)",
        "`tokenfleet serve` (and each of its `--processes`)",
        "tokenfleet.producer.gateway.settings:GatewaySettings",
    ),
    ProcessKind(
        "Batch runner (`python -m tokenfleet.producer.gateway.batches.runner`)",
        "a batch runner in a process of its own (every gateway also drives batches)",
        "tokenfleet.producer.gateway.settings:BatchRunnerSettings",
    ),
    ProcessKind(
        "Cron (`python -m tokenfleet.producer.cron`)",
        "the cron process that enqueues rq jobs (its Redis-mode flags are the connection's)",
        "tokenfleet.producer.cron_settings:CronSettings",
    ),
)


@dataclass(frozen=True, slots=True)
class FixedKnob:
    """A constant that was a setting once, or could look like one: listed in the docs with why."""

    what: str
    path: str  # "module:CONSTANT", read for the docs' value
    unit: str
    why: str

    def value(self) -> object:
        """The constant's value."""
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)


FIXED_KNOBS: tuple[FixedKnob, ...] = (
    FixedKnob(
        "a worker's heartbeat interval",
        "tokenfleet.worker.worker_settings:HEARTBEAT_INTERVAL_S",
        "s",
        "failure detection is set by the heartbeat TTL (`--heartbeat-ttl-s`); one small write a "
        "second keeps it well within that",
    ),
    FixedKnob(
        "a worker's anti-starvation ratio",
        "tokenfleet.worker.worker_settings:STARVATION_PULLS",
        "pulls",
        "a waiting lower priority is read at least this often: part of the scheduling policy, "
        "not of a deployment",
    ),
    FixedKnob(
        "a worker's blocking read",
        "tokenfleet.worker.worker_settings:READ_BLOCK_MS",
        "ms",
        "how long one `XREADGROUP` waits in Redis before it is sent again; the loop never waits "
        "on it",
    ),
    FixedKnob(
        "the gateway's model-list refresh",
        "tokenfleet.producer.gateway.settings:MODELS_REFRESH_S",
        "s",
        "requests check models against a copy refreshed in the background; one small read each "
        "time",
    ),
    FixedKnob(
        "the Redis health check",
        "tokenfleet.shared.settings:REDIS_HEALTH_CHECK_S",
        "s",
        "a pooled connection idle this long is PINGed before reuse: far below any proxy's idle "
        "timeout",
    ),
)


@functools.cache
def known_env_names() -> frozenset[str]:
    """Every environment variable some process kind declares."""
    return frozenset(var for kind in PROCESS_KINDS for var in env_names(kind.load()))
