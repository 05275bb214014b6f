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
    """One process kind's settings: for the docs a title, its anchor and who reads them (one
    paragraph of Markdown); and the class."""

    title: str
    anchor: str  # the docs section's anchor (other pages link to it)
    readers: str
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
        "Every process",
        "every-process",
        "Read by producers (`Client`, `AsyncClient`, the `tokenfleet` commands), gateways, "
        "workers, batch runners and the cron process: the Redis connection and the protocol. "
        "The flags are on every command that talks to Redis. `TOKENFLEET_ROUTING` and "
        "`TOKENFLEET_SESSION_TTL_S` are read by producers (how they route) and workers (whether "
        "they publish their prefixes and take routed work): [Routing](routing.md).",
        "tokenfleet.shared.settings:Settings",
    ),
    ProcessKind(
        "Worker",
        "worker",
        "Read by `tokenfleet worker` (compose and Kubernetes set the variables). A KV size given "
        "as a flag (`--kv-blocks` or `--kv-memory`) replaces either one from the environment.",
        "tokenfleet.worker.worker_settings:WorkerSettings",
    ),
    ProcessKind(
        "Model cache",
        "model-cache",
        "Read by `tokenfleet worker`, `tokenfleet models` and the demo, where a `.gguf` file is "
        "converted once into a Hugging Face folder ([Models](models.md)).",
        "tokenfleet.worker.models.gguf_cache:ModelCacheSettings",
    ),
    ProcessKind(
        "Gateway",
        "gateway",
        "Read by `tokenfleet serve` and each of its `--processes`.",
        "tokenfleet.producer.gateway.settings:GatewaySettings",
    ),
    ProcessKind(
        "Batch runner",
        "batch-runner",
        "Read by `python -m tokenfleet.producer.gateway.batches.runner`, a batch runner in a "
        "process of its own (every gateway also drives batches: [Batches](batches.md)).",
        "tokenfleet.producer.gateway.settings:BatchRunnerSettings",
    ),
    ProcessKind(
        "Cron",
        "cron",
        "Read by `python -m tokenfleet.producer.cron`, which enqueues rq jobs on a schedule; its "
        "Redis mode, sentinels and timeouts are the connection's above.",
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
