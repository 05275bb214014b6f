"""Tenants: who submitted a request, for fair admission between them (docs/fairness.md).

A tenant is a name (``Keys``' name rule: 1-64 of ``[A-Za-z0-9._-]``); a request without one is
the ``default`` tenant's. Its weight (default 1) scales the service it is due: admission takes
next from the backlogged tenant with the least *virtual time*, the tokens it was served divided
by its weight (shared/scripts/tf_tenants.lua keeps the counters, in Redis).

What the producer charges for a prompt is :func:`prompt_tokens`, counted without a tokenizer
(the worker's own count may differ a little; both tenants of a comparison are counted alike).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import check_name

DEFAULT_TENANT = "default"
CHARS_PER_TOKEN = 4  # a text prompt's charge: its characters / 4, about a BPE tokenizer's rate


def check_tenant(tenant: Any) -> str:
    """``tenant`` if it is a valid tenant name, else ``InvalidRequest`` naming the field."""
    if not isinstance(tenant, str):
        raise InvalidRequest(f"tenant must be a string, got {type(tenant).__name__}")
    return check_name("tenant", tenant)


def check_weight(weight: Any) -> float:
    """``weight`` as a float if it is a positive, finite number, else ``InvalidRequest``."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise InvalidRequest(f"weight must be a number, got {weight!r}")
    value = float(weight)
    if not math.isfinite(value) or value <= 0 or value > 1e6:
        raise InvalidRequest(f"weight must be a number above 0 and at most 1e6, got {weight!r}")
    return value


def prompt_tokens(
    prompt: str | bytes | None,
    messages: Sequence[Mapping[str, Any]] | None,
    token_ids: Sequence[int] | None,
) -> int:
    """A request's prompt tokens as admission charges them: the token ids' count, else the
    text's (or the messages' contents') characters / ``CHARS_PER_TOKEN``, at least 1 (no
    tokenizer on the producer's hot path; characters, not bytes: ``len`` costs nothing)."""
    if token_ids:
        return len(token_ids)
    size = len(prompt) if isinstance(prompt, str | bytes | bytearray) else 0
    for message in messages or ():
        content = message.get("content")
        if isinstance(content, str):
            size += len(content)
    return max(1, -(-size // CHARS_PER_TOKEN))


@dataclass(frozen=True, slots=True)
class TenantSettings:
    """One tenant's settings as ``tokenfleet tenants set`` stores them (``Keys.tenants``):
    ``weight`` (> 0), ``max_waiting`` (its own bound per queue; None: only the queue's) and
    ``at``, when they were set (epoch seconds, the setter's clock; 0: unknown): a model's book
    keeps the ``at`` of the settings it holds, and older ones never replace newer ones there."""

    weight: float = 1.0
    max_waiting: int | None = None
    at: float = 0.0

    def encode(self) -> bytes:
        """The JSON kept in ``Keys.tenants``."""
        return orjson.dumps({"weight": self.weight, "max_waiting": self.max_waiting, "at": self.at})

    @classmethod
    def decode(cls, raw: bytes | str | None) -> TenantSettings:
        """Parse what :meth:`encode` wrote (defaults for anything missing or unreadable)."""
        try:
            data = orjson.loads(raw or b"{}")
        except orjson.JSONDecodeError:
            return cls()
        if not isinstance(data, dict):
            return cls()
        weight = data.get("weight")
        bound = data.get("max_waiting")
        at = data.get("at")
        return cls(
            float(weight) if isinstance(weight, int | float) and weight > 0 else 1.0,
            bound if isinstance(bound, int) and bound >= 0 else None,
            float(at) if isinstance(at, int | float) and not isinstance(at, bool) else 0.0,
        )


class TenantLabels:
    """Bounded label values for per-tenant metrics: the first ``limit`` tenants seen keep their
    name, every later one is reported as ``other`` (a metric's series stay at most
    ``limit + 1``, whatever names clients send). Invariant: ``len(self.named) <= limit``."""

    OTHER = "other"

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.named: set[str] = set()

    def label(self, tenant: str) -> str:
        """The label value for ``tenant``."""
        if tenant in self.named:
            return tenant
        if len(self.named) < self.limit:
            self.named.add(tenant)
            return tenant
        return self.OTHER
