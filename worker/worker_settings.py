"""A worker's own settings, declared once: CLI flags first, then ``TOKENFLEET_*`` variables.

Connection settings (``REDIS_URL``, ``TOKENFLEET_KEY_PREFIX``) live in
:class:`tokenfleet.shared.settings.Settings`; this module holds what only a worker needs: the
model, the engine's limits, which priorities it serves, its name, and the crash-safety timers.
Each field's ``setting(...)`` is its one declaration (variable, flag, help); ``tokenfleet
worker``'s flags and docs/configuration.md are generated from it.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared import declared_settings
from tokenfleet.shared.declared_settings import env_names, label, setting
from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.keys import DEFAULT_MODEL, check_model_name, check_name
from tokenfleet.shared.priority import BACKGROUND, PRIORITIES, Priority
from tokenfleet.worker.engine.config import (
    KV_DTYPES,
    QUANTIZATION_MODES,
    check_kv_dtype,
    check_quantization,
)
from tokenfleet.worker.pool.config import weight_milli

# Fixed on purpose, not settings (nobody running a fleet has a reason to turn them):
# how often a worker beats: 1 s keeps the failure detection within heartbeat_ttl_s's 10 s
# default at one small write a second; a test shortens heartbeat_ttl_s, never this.
HEARTBEAT_INTERVAL_S = 1.0
# a waiting lower priority is read at least every this many pulls: the anti-starvation ratio
# is part of the scheduling policy, not of a deployment.
STARVATION_PULLS = 8
# how long one blocking XREADGROUP waits in Redis before it is sent again; the loop never
# waits on it (it sleeps on its own timers), so no value changes what a user sees.
READ_BLOCK_MS = 1000

# settings that must be positive integers
_COUNTS: tuple[str, ...] = ("max_num_seqs", "max_batched_tokens", "kv_tokens_per_seq")
_COUNTS += ("block_size", "poison_limit")
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
    """Everything a worker needs besides the Redis connection (each declaration says what).

    Invariants (checked at construction): a model is given; at most one of ``kv_blocks`` and
    ``kv_memory_bytes``; counts are positive and timers >= 0; ``heartbeat_ttl_s`` is longer than
    ``HEARTBEAT_INTERVAL_S``; ``priorities`` is sorted, most urgent first, and not empty;
    ``overflow_for``, when set, is also ``model_name``; ``quantization`` is a known mode."""

    model: str = setting(
        env="TOKENFLEET_MODEL",
        flag="--model",
        metavar="PATH|HUB_ID",
        help="what to serve: a bundled name (smollm2), a .gguf file, a model folder, or a hub id "
        "already in the local cache",
        see=("Models", "models.md"),
    )
    model_name: str = setting(
        DEFAULT_MODEL,
        env="TOKENFLEET_MODEL_NAME",
        flag="--model-name",
        help="served model name: the queues read are P:q:NAME:{critical,normal,batch}",
    )
    device: str | None = setting(
        None,
        env="TOKENFLEET_DEVICE",
        flag="--device",
        shown_default="cuda if available, else cpu",
        help="torch device, e.g. cpu, cuda, cuda:1",
    )
    dtype: str = setting(
        "auto",
        env="TOKENFLEET_DTYPE",
        flag="--dtype",
        help="auto, float32, bfloat16 or float16; auto follows the model's dtype on CUDA "
        "(bfloat16 becomes float16 where unsupported) and runs float32 on a CPU (16-bit CPU "
        "matmuls are slower)",
    )
    quantization: str = setting(
        "auto",
        env="TOKENFLEET_QUANTIZATION",
        flag="--quantization",
        choices=QUANTIZATION_MODES,
        help="linear weights on a CPU: auto keeps a GGUF file's own precision (Q4_x -> int4, "
        "Q8_0 -> int8; a float model, or a CUDA device, runs as loaded); none runs as loaded; "
        "int8 or int4 quantize at load (weight-only)",
        see=("Quantization", "quantization.md"),
    )
    max_num_seqs: int = setting(
        32,
        env="TOKENFLEET_MAX_NUM_SEQS",
        flag="--max-num-seqs",
        help="sequences (requests) running at once, per engine step",
    )
    max_batched_tokens: int = setting(
        512,
        env="TOKENFLEET_MAX_BATCHED_TOKENS",
        flag="--max-batched-tokens",
        help="tokens computed per engine step (chunked prefill)",
    )
    kv_blocks: int | None = setting(
        None,
        env="TOKENFLEET_KV_BLOCKS",
        flag="--kv-blocks",
        group="kv_size",
        shown_default="max-num-seqs x kv-tokens-per-seq tokens",
        help="KV cache size in blocks (give this or the KV memory, not both)",
    )
    kv_memory_bytes: int | None = setting(
        None,
        env="TOKENFLEET_KV_MEMORY",
        flag="--kv-memory",
        key="kv_memory",
        group="kv_size",
        parse=parse_memory,
        syntax="memory: 512M, 4GiB, 1.5G or bytes",
        shown_default="max-num-seqs x kv-tokens-per-seq tokens",
        help="KV cache size in memory, e.g. 512M or 4GiB (binary units)",
    )
    kv_dtype: str = setting(
        "auto",
        env="TOKENFLEET_KV_DTYPE",
        flag="--kv-dtype",
        choices=KV_DTYPES,
        help="KV cache storage: auto, float32, bfloat16 or float16 (attention computes in the "
        "model's dtype); auto stores float16 on a CPU under float32 compute (twice the tokens "
        "per byte; greedy output equal but for near-ties) and the model's dtype on CUDA",
        see=("KV cache storage", "engine.md#kv-cache-storage"),
    )
    kv_tokens_per_seq: int = setting(
        512,
        env="TOKENFLEET_KV_TOKENS_PER_SEQ",
        flag="--kv-tokens-per-seq",
        help="without a KV size, the KV cache holds max-num-seqs x this many tokens (at most "
        "half the memory free at start)",
    )
    block_size: int = setting(
        16, env="TOKENFLEET_BLOCK_SIZE", flag="--block-size", help="tokens per KV block"
    )
    max_model_len: int | None = setting(
        None,
        env="TOKENFLEET_MAX_MODEL_LEN",
        flag="--max-model-len",
        shown_default="the model's context, capped by the KV cache (with a warning)",
        help="prompt + output tokens per request at most",
    )
    priorities: tuple[Priority, ...] = setting(
        PRIORITIES,
        env="TOKENFLEET_PRIORITIES",
        flag="--priorities",
        parse=parse_priorities,
        syntax="list: critical,normal,batch (any of them)",
        shown_default="all three",
        help="the levels this worker serves, e.g. critical,normal",
    )
    name: str = setting(
        env="TOKENFLEET_NAME",
        flag="--name",
        default_factory=default_worker_name,
        shown_default="HOST-PID",
        help="worker name, unique in the fleet: its consumer name in every group and its "
        "heartbeat key",
    )
    metrics_port: int | None = setting(
        None,
        env="TOKENFLEET_METRICS_PORT",
        flag="--metrics-port",
        help="serve Prometheus metrics on 0.0.0.0:PORT/metrics; none: no endpoint",
    )
    metrics_tenants: int = setting(
        16,
        env="TOKENFLEET_METRICS_TENANTS",
        flag="--metrics-tenants",
        help="tenants named in the per-tenant metrics' labels (the first seen); later ones are "
        "counted as tenant 'other', so a metric has at most this many + 1 series per model",
        see=("Fair shares between tenants", "fairness.md"),
    )
    threads: int | None = setting(
        None,
        env="TOKENFLEET_THREADS",
        flag="--threads",
        shown_default="the CPUs it may use",
        help="torch CPU threads (torch.set_num_threads); by default the CPUs this process may "
        "use: its affinity mask, capped by a container's CPU quota (cgroup cpu.max). Several "
        "workers on one machine: cores / workers each",
        see=("Workers", "workers.md"),
    )
    grace_s: float = setting(
        30.0,
        env="TOKENFLEET_GRACE_S",
        flag="--grace-s",
        help="on SIGTERM, how long running requests may take before they are handed back (seconds)",
    )
    heartbeat_ttl_s: float = setting(
        10.0,
        flag="--heartbeat-ttl-s",
        help="heartbeat lifetime: a worker whose heartbeat is this old is dead (seconds)",
        see=("Crash safety", "workers.md#crash-safety"),
    )
    claim_interval_s: float = setting(
        2.0,
        flag="--claim-interval-s",
        help="how often a live worker looks for a dead worker's entries (seconds)",
    )
    claim_idle_s: float = setting(
        5.0,
        flag="--claim-idle-s",
        help="a dead worker's entry must have been idle this long before it is claimed (seconds)",
    )
    repair_window_s: float = setting(
        300.0,
        env="TOKENFLEET_REPAIR_WINDOW_S",
        flag="--repair-window-s",
        help="how long the worker keeps what it published for a request it ended, to put it back "
        "after a Redis rollback (failover, restart from an older snapshot); running requests are "
        "always kept; 0 turns the repair off (a rolled-back request then ends error / "
        "corrupt_state) (seconds)",
        see=("Failover", "redis-modes.md#failover-nothing-lost"),
    )
    poison_limit: int = setting(
        3,
        flag="--poison-limit",
        help="workers a request may outlive before it ends worker_lost",
    )
    kv_pool: str | None = setting(
        None,
        env="TOKENFLEET_KV_POOL",
        flag="--kv-pool",
        help="shared KV pool to join; none: the engine's whole cache",
        see=("KV pools", "kv-pools.md"),
    )
    share_weight: float = setting(
        1.0,
        env="TOKENFLEET_SHARE_WEIGHT",
        flag="--share-weight",
        help="this worker's weight in the KV pool (0.001 to 100)",
    )
    urgent_slots: int | None = setting(
        None,
        env="TOKENFLEET_URGENT_SLOTS",
        flag="--urgent-slots",
        shown_default="max-num-seqs/8, at least 1",
        help="more urgent requests a read may take beyond the free sequence slots, each "
        "preempting a running batch request (recomputed mostly from the prefix cache); 0: none. "
        "Applies to a worker serving batch and a more urgent level, with batch yielding",
        see=("Batch work yields", "workers.md#batch-work-yields-to-interactive-work"),
    )
    batch_yields: bool = setting(
        True,
        env="TOKENFLEET_BATCH_YIELDS",
        flag="--no-batch-yield",
        help="batch work sits out engine steps that prefill more urgent work, more urgent work "
        "arriving in Redis cuts a batch-only step short, and urgent reads take slots from it; "
        "off (the flag, or 0) runs batch work like any other",
        see=("Batch work yields", "workers.md#batch-work-yields-to-interactive-work"),
    )
    share_prefill: bool = setting(
        True,
        env="TOKENFLEET_SHARE_PREFILL",
        flag="--no-share-prefill",
        help="a request whose prompt's next blocks another running request is prefilling now "
        "waits for them and reads them from the prefix cache (the n choices of a request, or "
        "requests sent together with one long prompt, prefill it once); off (the flag, or 0): "
        "each computes its own",
        see=("Prefix caching", "engine.md#prefix-caching"),
    )
    steal_after_s: float = setting(
        0.5,
        env="TOKENFLEET_STEAL_AFTER_S",
        flag="--steal-after-s",
        help="routed work waiting this long in another worker's routed stream (or two of that "
        "worker's longest recent steps, at most 10 times this) may be stolen by this worker "
        "when it has room (seconds)",
        see=("Routing", "routing.md"),
    )
    overflow_for: str | None = setting(
        None,
        env="TOKENFLEET_OVERFLOW_FOR",
        flag="--overflow-for",
        metavar="MODEL",
        help="serve MODEL as an overflow worker: take only its work that has waited "
        "overflow-after-s or more, from the shared and routed streams alike; never a routing "
        "target",
        see=("Routing", "routing.md"),
    )
    overflow_after_s: float = setting(
        5.0,
        env="TOKENFLEET_OVERFLOW_AFTER_S",
        flag="--overflow-after-s",
        help="the overflow threshold (seconds)",
    )
    log_level: str = setting("INFO", flag="--log-level", help="logging level (logs go to stderr)")

    def __post_init__(self) -> None:
        cls = WorkerSettings
        if self.overflow_for is not None:
            self.model_name = self.overflow_for
        for name in ("steal_after_s", "overflow_after_s"):
            _check_at_least_0(name, getattr(self, name))
        _check("quantization", check_quantization, self.quantization)
        _check("kv_dtype", check_kv_dtype, self.kv_dtype)
        if not self.model:
            raise SettingsError("no model given: pass --model PATH|HUB_ID or set TOKENFLEET_MODEL")
        named = "overflow_for" if self.overflow_for is not None else "model_name"
        _check(named, check_model_name, self.model_name)
        _check("name", lambda name: check_name("worker", name), self.name)
        if self.kv_blocks is not None and self.kv_memory_bytes is not None:
            raise SettingsError(
                "give either --kv-blocks or --kv-memory (TOKENFLEET_KV_BLOCKS or "
                "TOKENFLEET_KV_MEMORY), not both"
            )
        for name in _COUNTS:
            _check_positive(name, getattr(self, name))
        for name in ("kv_blocks", "kv_memory_bytes", "max_model_len", "threads"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        _check_at_least_0("metrics_tenants", self.metrics_tenants)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise SettingsError(
                f"{label(cls, 'metrics_port')} must be in 0..65535, got {self.metrics_port}"
            )
        if not self.priorities:
            raise SettingsError(
                f"a worker must serve at least one priority ({label(cls, 'priorities')})"
            )
        self.priorities = tuple(sorted(set(self.priorities)))
        if self.heartbeat_ttl_s <= HEARTBEAT_INTERVAL_S:
            raise SettingsError(
                f"{label(cls, 'heartbeat_ttl_s')} must be longer than the heartbeat interval "
                f"({HEARTBEAT_INTERVAL_S} s), got {self.heartbeat_ttl_s}"
            )
        for name in ("grace_s", "claim_interval_s", "claim_idle_s", "repair_window_s"):
            _check_at_least_0(name, getattr(self, name))
        if self.kv_pool is not None:
            _check("kv_pool", lambda pool: check_name("pool", pool), self.kv_pool)
        _check("share_weight", weight_milli, self.share_weight)
        if self.urgent_slots is not None and not 0 <= self.urgent_slots <= self.max_num_seqs:
            raise SettingsError(
                f"{label(cls, 'urgent_slots')} must be in 0..{self.max_num_seqs} "
                f"(max_num_seqs), got {self.urgent_slots}"
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
        """Build from ``TOKENFLEET_*`` variables (default: ``os.environ``); non-None
        ``overrides`` (CLI flags, by key: ``kv_memory`` for ``kv_memory_bytes``) win. A KV size
        flag replaces the environment's other KV size (one size given two ways: the flag's).

        Raises:
            SettingsError: no model, a value that does not parse, or one the worker refuses.
        """
        return declared_settings.from_env(cls, env, overrides)

    def engine_overrides(self) -> dict[str, Any]:
        """Keyword arguments for ``EngineConfig`` (only what was set)."""
        out: dict[str, Any] = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_batched_tokens,
            "kv_tokens_per_seq": self.kv_tokens_per_seq,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "quantization": self.quantization,
            "background_yields": self.batch_yields,
            "share_prefill": self.share_prefill,
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


# Environment variable -> setting key, for everything above that a variable sets.
ENV_VARS: dict[str, str] = env_names(WorkerSettings)


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SettingsError(
            f"{label(WorkerSettings, name)} must be a positive integer, got {value!r}"
        )


def _check_at_least_0(name: str, value: float) -> None:
    if value < 0:
        raise SettingsError(f"{label(WorkerSettings, name)} must be >= 0, got {value}")


def _check(name: str, check: Callable[[Any], object], value: Any) -> None:
    """``check(value)``; its ``ValueError`` as a ``SettingsError`` naming the setting."""
    try:
        check(value)
    except ValueError as exc:
        raise SettingsError(f"{label(WorkerSettings, name)}: {exc}") from None
