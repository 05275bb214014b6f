"""A queue's bound on waiting requests and its overflow policy, as stored in ``P:qcfg:M:L``.

Every producer reads the same hash inside the enqueue script, so all of them obey one rule.
A queue with no stored config uses :data:`DEFAULT_QUEUE_CONFIG` (10,000 waiting, drop_newest):
a new request is refused rather than silently pushing out work somebody already waits on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.record import as_str

MAX_WAITING_LIMIT = 10_000_000


class OverflowPolicy(StrEnum):
    """What a full queue does with one more request."""

    DROP_NEWEST = "drop_newest"  # refuse the new request (Overloaded); nothing is stored
    DROP_OLDEST = "drop_oldest"  # accept it; the oldest waiting request ends ``dropped``
    BLOCK = "block"  # submit() waits for room up to its timeout; try_submit() refuses

    @classmethod
    def parse(cls, value: str | OverflowPolicy) -> OverflowPolicy:
        """Accept a policy or its wire name; else ``InvalidRequest`` listing the choices."""
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise InvalidRequest(f"unknown policy {value!r}; expected one of: {names}") from None


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """A queue's bound and policy. ``max_waiting`` counts waiting requests only (>= 0)."""

    max_waiting: int = 10_000
    policy: OverflowPolicy = OverflowPolicy.DROP_NEWEST

    def __post_init__(self) -> None:
        value = self.max_waiting
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequest(f"max_waiting must be an integer >= 0, got {value!r}")
        if value > MAX_WAITING_LIMIT:
            raise InvalidRequest(f"max_waiting must be at most {MAX_WAITING_LIMIT}, got {value}")
        object.__setattr__(self, "policy", OverflowPolicy.parse(self.policy))

    def to_hash(self) -> dict[str, str]:
        """Fields of the ``P:qcfg`` hash."""
        return {"max_waiting": str(self.max_waiting), "policy": self.policy.value}

    @classmethod
    def from_hash(cls, raw: Mapping[bytes | str, bytes | str]) -> QueueConfig:
        """Parse the hash; missing or malformed fields fall back to the defaults."""
        h = {as_str(k): as_str(v) for k, v in raw.items()}
        max_waiting = DEFAULT_QUEUE_CONFIG.max_waiting
        policy = DEFAULT_QUEUE_CONFIG.policy
        with contextlib.suppress(ValueError):
            max_waiting = max(0, int(h.get("max_waiting") or max_waiting))
        with contextlib.suppress(InvalidRequest):
            policy = OverflowPolicy.parse(h.get("policy") or policy)
        return cls(max_waiting=max_waiting, policy=policy)


DEFAULT_QUEUE_CONFIG = QueueConfig()


@dataclass(frozen=True, slots=True)
class QueueStats:
    """One queue's state as ``client.queue_stats()`` reports it.

    ``length`` = entries in the stream; ``running`` = delivered to a worker and not yet finished
    (the group's pending count); ``waiting`` = ``length - running``, what ``max_waiting`` bounds.
    ``configured`` is False when the queue runs on the defaults. ``oldest_waiting_at``: epoch
    seconds at which the oldest waiting request entered the queue's streams (its stream entry's
    id: Redis's clock; a handed-back request re-enters at the tail), None when none waits.
    """

    model: str
    priority: str
    length: int
    running: int
    waiting: int
    max_waiting: int
    policy: OverflowPolicy
    configured: bool
    oldest_waiting_at: float | None = None

    def oldest_waiting_s(self, now: float) -> float:
        """How long the oldest waiting request has waited at ``now`` (0 when none waits)."""
        at = self.oldest_waiting_at
        return max(0.0, now - at) if at is not None else 0.0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "model": self.model,
            "priority": self.priority,
            "length": self.length,
            "running": self.running,
            "waiting": self.waiting,
            "max_waiting": self.max_waiting,
            "policy": self.policy.value,
            "configured": self.configured,
            "oldest_waiting_at": self.oldest_waiting_at,
        }
