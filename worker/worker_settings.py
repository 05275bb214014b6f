"""A worker's own settings: CLI flags first, then ``TOKENFLEET_*`` environment variables.

Connection settings (``REDIS_URL``, ``TOKENFLEET_KEY_PREFIX``) live in
:class:`tokenfleet.shared.settings.Settings`; this module holds what only a worker needs: the
model, the engine's limits, which priorities it serves, its name, and the crash-safety timers.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.keys import DEFAULT_MODEL, check_model_name, check_name
from tokenfleet.shared.priority import BACKGROUND, PRIORITIES, Priority
from tokenfleet.worker.pool.config import weight_milli

# Environment variable -> (field name, parser name). Every name here is whitelisted in
# tokenfleet.shared.settings._ENV_OWNED_ELSEWHERE so Settings.from_env does not reject it.
ENV_VARS: dict[str, str] = {
    "TOKENFLEET_MODEL": "model",
    "TOKENFLEET_MODEL_NAME": "model_name",
    "TOKENFLEET_DEVICE": "device",
    "TOKENFLEET_DTYPE": "dtype",
    "TOKENFLEET_MAX_NUM_SEQS": "max_num_seqs",
    "TOKENFLEET_MAX_BATCHED_TOKENS": "max_batched_tokens",
    "TOKENFLEET_KV_BLOCKS": "kv_blocks",
    "TOKENFLEET_KV_MEMORY": "kv_memory",
    "TOKENFLEET_BLOCK_SIZE": "block_size",
    "TOKENFLEET_MAX_MODEL_LEN": "max_model_len",
    "TOKENFLEET_PRIORITIES": "priorities",
    "TOKENFLEET_NAME": "name",
    "TOKENFLEET_METRICS_PORT": "metrics_port",
    "TOKENFLEET_THREADS": "threads",
    "TOKENFLEET_GRACE_S": "grace_s",
    "TOKENFLEET_KV_POOL": "kv_pool",
    "TOKENFLEET_SHARE_WEIGHT": "share_weight",
    "TOKENFLEET_URGENT_SLOTS": "urgent_slots",
    "TOKENFLEET_BATCH_YIELDS": "batch_yields",
    "TOKENFLEET_STEAL_AFTER_S": "steal_after_s",
    "TOKENFLEET_OVERFLOW_FOR": "overflow_for",
    "TOKENFLEET_OVERFLOW_AFTER_S": "overflow_after_s",
}

_INT_FIELDS = frozenset(
    {
        "max_num_seqs",
        "max_batched_tokens",
        "kv_blocks",
        "block_size",
        "max_model_len",
        "metrics_port",
        "threads",
        "urgent_slots",
    }
)
_BOOL_FIELDS = frozenset({"batch_yields"})
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})
_FLOAT_FIELDS = frozenset(
    {
        "grace_s",
        "heartbeat_interval_s",
        "heartbeat_ttl_s",
        "claim_interval_s",
        "claim_idle_s",
        "share_weight",
        "steal_after_s",
        "overflow_after_s",
    }
)
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_MEMORY_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_memory(text: str) -> int:
    """Parse ``"512M"``, ``"2GiB"``, ``"1.5G"`` or a plain byte count into bytes (binary units)."""
    m = _MEMORY_RE.match(str(text))
    if not m:
        raise SettingsError(f"memory amount {text!r} must look like 512M, 2GiB or 1073741824")
    value = float(m.group(1)) * _MEMORY_UNITS[m.group(2).upper()]
    if value <= 0:
        raise SettingsError(f"memory amount {text!r} must be positive")
    return int(value)


def parse_priorities(text: str | None) -> tuple[Priority, ...]:
    """``"critical,normal"`` -> those priorities, most urgent first; empty/None = all three."""
    if text is None or not str(text).strip():
        return PRIORITIES
    try:
        found = {Priority.parse(part) for part in str(text).split(",") if part.strip()}
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    return tuple(sorted(found))


def default_worker_name() -> str:
    """``HOST-PID`` sanitised to the worker-name alphabet (unique per process on one host)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:40].strip("-.") or "worker"
    return f"{host}-{os.getpid()}"


@dataclass(slots=True)
class WorkerSettings:
    """Everything a worker process needs besides the Redis connection.

    Attributes:
        model: local folder or hub id given to ``from_pretrained``.
        model_name: served-model name: the queues read are ``P:q:<model_name>:<priority>``.
        device, dtype: passed to the engine (None / "auto" = its defaults).
        max_num_seqs, max_batched_tokens: engine limits per step.
        kv_blocks / kv_memory_bytes: KV cache size (at most one; neither = engine default).
        block_size: tokens per KV block.
        max_model_len: prompt + output tokens per request at most (None: the model's context,
            capped by the KV cache, with a warning at start when the cache caps it).
        priorities: the levels this worker serves, most urgent first.
        name: consumer name in every group and heartbeat key; unique in the fleet.
        metrics_port: Prometheus endpoint port; None = no endpoint.
        threads: ``torch.set_num_threads`` (None = torch's default).
        grace_s: on SIGTERM, how long running requests may take before being handed back.
        heartbeat_interval_s / heartbeat_ttl_s: how often the worker beats, and how long its
            heartbeat lives without a new beat (a worker is dead once it lapses).
        claim_interval_s: how often a worker looks for entries of dead workers.
        claim_idle_s: an entry must have been idle this long before it can be claimed.
        poison_limit: a request taken by more than this many workers ends ``worker_lost``.
        starvation_pulls: a waiting lower priority is read at least every this many pulls.
        block_ms: how long one blocking XREADGROUP waits in Redis before it is sent again (the
            loop never waits on it: it checks for its reply between steps, or sleeps on it with
            its own timers' timeout when idle).
        kv_pool: shared KV pool to join (docs/kv-pools.md); None: the engine's whole cache.
        share_weight: this worker's weight in the pool (0.001 to 100).
        urgent_slots: how many more urgent requests a read may take beyond the free sequence
            slots, each taking a running ``batch`` request's slot (preempted, recomputed mostly
            from the prefix cache) — batch work may fill every slot, interactive work takes
            them back (None: an eighth of ``max_num_seqs``, at least 1; 0: none). Only applies
            to a worker serving ``batch`` and a more urgent level, with ``batch_yields``.
        batch_yields: ``batch`` work sits out engine steps that prefill more urgent work, and
            more urgent work arriving in Redis cuts a batch-only step short (docs/workers.md,
            "Batch work yields"); False runs batch steps through like any other.
        steal_after_s: routed work waiting this long in another worker's routed stream may be
            stolen by this worker when it has room (docs/routing.md).
        overflow_for: this worker is an overflow worker for that model (its ``model_name``):
            it takes only that model's work that has waited ``overflow_after_s`` or more, from
            the shared and routed streams alike, and is never a routing target.
        overflow_after_s: the overflow threshold (seconds).
    """

    model: str
    model_name: str = DEFAULT_MODEL
    device: str | None = None
    dtype: str = "auto"
    max_num_seqs: int = 32
    max_batched_tokens: int = 512
    kv_blocks: int | None = None
    kv_memory_bytes: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    priorities: tuple[Priority, ...] = PRIORITIES
    name: str = field(default_factory=default_worker_name)
    metrics_port: int | None = None
    threads: int | None = None
    grace_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 10.0
    claim_interval_s: float = 2.0
    claim_idle_s: float = 5.0
    poison_limit: int = 3
    starvation_pulls: int = 8
    block_ms: int = 1000
    kv_pool: str | None = None
    share_weight: float = 1.0
    urgent_slots: int | None = None
    batch_yields: bool = True
    steal_after_s: float = 0.5
    overflow_for: str | None = None
    overflow_after_s: float = 5.0

    def __post_init__(self) -> None:
        if self.overflow_for is not None:
            self.model_name = self.overflow_for
        if self.steal_after_s < 0 or self.overflow_after_s < 0:
            raise SettingsError("steal_after_s and overflow_after_s must be >= 0")
        if not self.model:
            raise SettingsError("no model given: pass --model PATH|HUB_ID or set TOKENFLEET_MODEL")
        try:
            check_model_name(self.model_name)
            check_name("worker", self.name)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if self.kv_blocks is not None and self.kv_memory_bytes is not None:
            raise SettingsError(
                "give either --kv-blocks or --kv-memory (TOKENFLEET_KV_BLOCKS or "
                "TOKENFLEET_KV_MEMORY), not both"
            )
        for name in ("max_num_seqs", "max_batched_tokens", "block_size", "poison_limit"):
            _check_positive(name, getattr(self, name))
        for name in ("kv_blocks", "kv_memory_bytes", "max_model_len", "threads"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise SettingsError(f"metrics port must be in 0..65535, got {self.metrics_port}")
        if not self.priorities:
            raise SettingsError("a worker must serve at least one priority")
        self.priorities = tuple(sorted(set(self.priorities)))
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise SettingsError("heartbeat TTL must be longer than the heartbeat interval")
        for name in ("grace_s", "claim_interval_s", "claim_idle_s", "heartbeat_interval_s"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0")
        _check_positive("starvation_pulls", self.starvation_pulls)
        try:
            if self.kv_pool is not None:
                check_name("pool", self.kv_pool)
            weight_milli(self.share_weight)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        _check_positive("block_ms", self.block_ms)
        if self.urgent_slots is not None and not 0 <= self.urgent_slots <= self.max_num_seqs:
            raise SettingsError(
                f"urgent_slots must be in 0..{self.max_num_seqs} (max_num_seqs), "
                f"got {self.urgent_slots}"
            )

    @property
    def slots_from_batch(self) -> int | None:
        """How many more urgent requests a read may take beyond the free slots, each from a
        running batch request, or None (the worker does not serve both ``batch`` and a more
        urgent level, batch work does not yield, or ``urgent_slots`` is 0)."""
        if not self.batch_yields or BACKGROUND not in self.priorities or len(self.priorities) < 2:
            return None
        slots = self.urgent_slots
        if slots is None:
            slots = max(1, self.max_num_seqs // 8)
        return slots or None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> WorkerSettings:
        """Build from ``TOKENFLEET_*`` variables; non-None ``overrides`` (CLI flags) win."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for var, name in ENV_VARS.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            values[name] = _parse(name, raw, var)
        flags = {k: v for k, v in overrides.items() if v is not None}
        if {"kv_blocks", "kv_memory"} & flags.keys():  # one KV size given two ways: the flag's
            values.pop("kv_blocks", None)
            values.pop("kv_memory", None)
        values.update(flags)
        if "kv_memory" in values:
            mem = values.pop("kv_memory")
            values["kv_memory_bytes"] = mem if isinstance(mem, int) else parse_memory(mem)
        if isinstance(values.get("priorities"), str):
            values["priorities"] = parse_priorities(values["priorities"])
        if "model" not in values:
            raise SettingsError("no model given: pass --model PATH|HUB_ID or set TOKENFLEET_MODEL")
        return cls(**values)

    def engine_overrides(self) -> dict[str, Any]:
        """Keyword arguments for ``EngineConfig`` (only what was set)."""
        out: dict[str, Any] = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_batched_tokens,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "background_yields": self.batch_yields,
        }
        if self.device:
            out["device"] = self.device
        if self.kv_blocks is not None:
            out["num_kv_blocks"] = self.kv_blocks
        if self.kv_memory_bytes is not None:
            out["kv_memory_bytes"] = self.kv_memory_bytes
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        return out


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SettingsError(f"{name} must be a positive integer, got {value!r}")


def _parse(name: str, raw: str, var: str) -> Any:
    if name in _BOOL_FIELDS:
        if raw.strip().lower() not in _TRUE | _FALSE:
            raise SettingsError(f"{var} must be 1/0, true/false, yes/no or on/off, got {raw!r}")
        return raw.strip().lower() in _TRUE
    try:
        if name in _INT_FIELDS:
            return int(raw)
        if name in _FLOAT_FIELDS:
            return float(raw)
    except ValueError:
        raise SettingsError(f"{var} must be a number, got {raw!r}") from None
    return raw
