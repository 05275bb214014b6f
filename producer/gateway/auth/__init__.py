"""PLACEHOLDER until the API-key branch lands (issue 17 item 6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.priority import Priority


class AuthError(Exception):
    """Missing, unknown or revoked key."""


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    name: str
    priority_ceiling: Priority


@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    retry_after_s: float
    headers: dict[str, str]


class ApiKeyStore:
    def __init__(self, redis: Any, settings: Any) -> None:
        self.redis = redis

    async def authenticate(self, presented: str | None) -> ApiKey:
        raise AuthError("keys are not built yet")

    async def admit(self, key: ApiKey, tokens: int) -> RateDecision:
        return RateDecision(True, 0.0, {})

    async def settle(self, key: ApiKey, charged: int, used: int) -> None:
        return None
