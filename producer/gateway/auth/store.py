"""Authenticating callers and enforcing their quotas: the asyncio face the gateway uses."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tokenfleet.producer.gateway.auth.model import (
    ApiKey,
    decode_record,
    digest_matches,
    parse_presented,
)
from tokenfleet.producer.gateway.auth.quota import MAX_TOKENS, RateDecision, decide
from tokenfleet.producer.gateway.auth.scripts import API_KEY_ADMIT, API_KEY_SETTLE
from tokenfleet.shared.errors import AuthError, InvalidRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.scripts.registry import acall
from tokenfleet.shared.settings import Settings

MISSING_KEY = (
    "missing API key: send it as 'Authorization: Bearer tf-...' (create one with "
    "'tokenfleet keys create')"
)
INVALID_KEY = "invalid or revoked API key"
DEFAULT_CACHE_S = 2.0
DEFAULT_MAX_CACHED = 10_000


class ApiKeyStore:
    """Looks up, checks and charges API keys for one fleet through an asyncio client.

    A key's record is read from Redis at most once per ``cache_s`` seconds per process (a small
    TTL cache, misses included, so garbage keys do not each cost a round trip). **Revoke
    bound:** a revoked key is refused by ``authenticate`` at most ``cache_s`` seconds (default
    2) after the revoke, on every gateway process; ``admit`` refuses it at once (its script
    reads the record itself).

    Invariants: a cache entry is never used after ``cache_s`` from its read (``monotonic``
    clock); the cache holds at most ``max_cached`` entries (oldest dropped first); no secret or
    digest leaves this object (``ApiKey`` holds neither).

    Keyword-only arguments:
        cache_s: the TTL of a cached record: the revoke bound above.
        max_cached: bound of the cache's entries.
        monotonic: the cache's clock (tests pass a fake one).
        clock_ms: for tests and simulations only: a clock (epoch ms) handed to the quota
            scripts instead of Redis ``TIME``. Production leaves it ``None``, so every gateway
            process charges against the one Redis clock.
    """

    def __init__(
        self,
        redis: Any,
        settings: Settings,
        *,
        cache_s: float = DEFAULT_CACHE_S,
        max_cached: int = DEFAULT_MAX_CACHED,
        monotonic: Callable[[], float] = time.monotonic,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        if cache_s < 0 or max_cached < 1:
            raise InvalidRequest("cache_s must be >= 0 and max_cached >= 1")
        self._redis = redis
        self._keys = Keys.for_settings(settings)
        self._cache_s = cache_s
        self._max_cached = max_cached
        self._monotonic = monotonic
        self._clock_ms = clock_ms
        # key id -> (read at, (key, digest) or None when there was no record)
        self._cache: dict[str, tuple[float, tuple[ApiKey, str | None] | None]] = {}

    @property
    def cache_s(self) -> float:
        """How long a revoked key may still authenticate on this process (seconds)."""
        return self._cache_s

    async def authenticate(self, presented: str | None) -> ApiKey:
        """The live key ``presented`` (the bearer token) names, else ``AuthError``: one message
        for a missing key, one for a malformed, unknown, wrong or revoked one."""
        if presented is None or not presented.strip():
            raise AuthError(MISSING_KEY)
        presented = presented.strip()
        key_id = parse_presented(presented)
        if key_id is None:
            raise AuthError(INVALID_KEY)
        found = await self._lookup(key_id)
        key, digest = found if found is not None else (None, None)
        # Hash and compare even for an unknown id, so that path costs what a wrong secret does.
        if not digest_matches(presented, digest) or key is None or key.revoked:
            raise AuthError(INVALID_KEY)
        return key

    async def admit(self, key: ApiKey, tokens: int) -> RateDecision:
        """Charge one request and ``tokens`` tokens against ``key``'s limits, both or neither,
        in one atomic script: refused when either limit would be exceeded (then nothing is
        charged). ``AuthError`` if the key was revoked meanwhile."""
        _check_tokens("tokens", tokens)
        reply = await acall(
            self._redis, API_KEY_ADMIT, [self._keys.api_key(key.key_id)], [tokens, self._now()]
        )
        if reply[0] == "revoked":
            self.forget(key.key_id)
            raise AuthError(INVALID_KEY)
        rpm, tpm, rq, tk = (int(x) for x in reply[1:5])
        return decide(reply[0] == "ok", rpm, tpm, rq, tk, tokens)

    async def settle(self, key: ApiKey, charged: int, used: int) -> None:
        """Correct the token charge of an admitted request once its real usage is known:
        ``charged - used`` tokens go back (or, if negative, are taken). The bucket never exceeds
        its capacity and its debt never exceeds one capacity (``quota``'s docstring). A no-op
        for a key without a token limit, or one revoked since."""
        _check_tokens("charged", charged)
        _check_tokens("used", used)
        if key.tpm == 0 or charged == used:
            return
        await acall(
            self._redis,
            API_KEY_SETTLE,
            [self._keys.api_key(key.key_id)],
            [charged, used, self._now()],
        )

    def forget(self, key_id: str) -> None:
        """Drop ``key_id`` from this process's cache (its next use reads Redis)."""
        self._cache.pop(key_id, None)

    async def _lookup(self, key_id: str) -> tuple[ApiKey, str | None] | None:
        now = self._monotonic()
        cached = self._cache.get(key_id)
        if cached is not None and now - cached[0] < self._cache_s:
            return cached[1]
        raw = await self._redis.hgetall(self._keys.api_key(key_id))
        found = decode_record(key_id, raw)
        self._remember(key_id, now, found)
        return found

    def _remember(self, key_id: str, now: float, found: tuple[ApiKey, str | None] | None) -> None:
        self._cache.pop(key_id, None)  # re-inserted last: dict order is read order
        if len(self._cache) >= self._max_cached:
            stale = [k for k, (at, _) in self._cache.items() if now - at >= self._cache_s]
            for k in stale:
                del self._cache[k]
            while len(self._cache) >= self._max_cached:
                del self._cache[next(iter(self._cache))]
        self._cache[key_id] = (now, found)

    def _now(self) -> int | str:
        return "" if self._clock_ms is None else int(self._clock_ms())


def _check_tokens(what: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKENS:
        raise InvalidRequest(f"{what} must be an integer from 0 to {MAX_TOKENS}")
