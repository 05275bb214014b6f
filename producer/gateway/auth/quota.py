"""Per-key quotas: the token-bucket arithmetic's units, and the decision a gateway acts on.

**Algorithm: two token buckets per key**, one counting requests (capacity ``rpm``), one counting
tokens (capacity ``tpm``), each refilling continuously at its limit per 60 s (``rpm / 60`` per
second), starting full. ``admit`` (``lua/api_key_admit.lua``) refills both to now, then admits
only if the request bucket holds one request *and* the token bucket holds the tokens asked; then
it takes both, otherwise it writes nothing. A 0 limit is unlimited: that bucket is neither
checked nor charged. One script reads, decides and writes, so the limits hold exactly across
any number of gateway processes; its clock is Redis ``TIME``, one clock for all of them.

Units: a bucket level is an integer count of ``1 / SCALE`` of a request (or token); a limit
``L`` refills exactly ``L`` units per millisecond, so the scripts' arithmetic is integer and
exact (levels stay below 2**53, see ``model.MAX_LIMIT``).

**Settling.** The token charge at admit is the gateway's estimate (its prompt length estimate
plus ``max_tokens``); ``settle`` (``lua/api_key_settle.lua``) corrects it once the usage is
known: unused tokens go back (the bucket never exceeds its capacity), tokens used beyond the
estimate are taken, down to a debt of at most one bucket (``-tpm``; anything beyond is
forgiven). A key in debt is refused until refill repays it: at most 60 s to repay, 120 s until
the bucket is full again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCALE = 60_000  # bucket units per request or token: a per-minute limit L refills L units per ms
# The per-minute limit's period; mirrored by the scripts (a full refill of an empty bucket).
PERIOD_MS = 60_000
MAX_TOKENS = 2**31  # largest single charge or settle amount (keeps levels exact in Lua)


@dataclass(frozen=True, slots=True)
class RateDecision:
    """The outcome of one ``admit``.

    Attributes:
        allowed: the request was admitted and its request and token charges taken.
        retry_after_s: 0 when allowed; else the seconds until every refused part could pass at
            the limits' refill rate (rounded up to the millisecond): a ``Retry-After``.
            0 as well when ``too_large`` (no wait helps).
        headers: OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, for the
            limited dimensions only (an unlimited one has none). ``remaining`` is what is left
            after this request's charge (before it, when refused), floored; ``reset`` is the
            time until that bucket is full again, written like ``20ms``, ``1.5s``, ``6m0s``.
        limited_by: the dimensions that refused: ``"requests"`` and/or ``"tokens"``.
        too_large: the tokens asked exceed ``tpm`` itself: the request can never pass as it is
            (the gateway should say so, not ask the client to retry).
    """

    allowed: bool
    retry_after_s: float
    headers: dict[str, str] = field(default_factory=dict)
    limited_by: tuple[str, ...] = ()
    too_large: bool = False

    @property
    def message(self) -> str:
        """A sentence for the error body of a refused request ("" when allowed)."""
        if self.allowed:
            return ""
        if self.too_large:
            limit = self.headers.get("x-ratelimit-limit-tokens", "?")
            return (
                f"request too large: it asks for more tokens than this API key's limit of "
                f"{limit} tokens per minute; lower max_tokens or the prompt"
            )
        parts = []
        for dim in self.limited_by:
            limit = self.headers.get(f"x-ratelimit-limit-{dim}", "?")
            parts.append(f"{dim} per minute (limit {limit})")
        return (
            f"rate limit reached for {' and '.join(parts)}; "
            f"try again in {format_duration(round(self.retry_after_s * 1000))}"
        )


def format_duration(ms: int) -> str:
    """A duration the way OpenAI's reset headers write it (Go's style): ``0s``, ``20ms``,
    ``1s``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    if not minutes:
        return f"{seconds}s"
    hours, minutes = divmod(minutes, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{seconds}s"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One dimension's state as a script saw it: ``limit`` per minute, ``level`` in units."""

    name: str  # "requests" | "tokens"
    limit: int
    level: int

    def remaining(self) -> int:
        """Whole requests (tokens) in the bucket, never negative."""
        return max(0, self.level // SCALE)

    def wait_ms(self, need: int) -> int:
        """Milliseconds of refill until ``need`` whole units are in the bucket."""
        return max(0, _ceil_div(need * SCALE - self.level, self.limit))

    def reset_ms(self) -> int:
        """Milliseconds of refill until the bucket is full."""
        return self.wait_ms(self.limit)

    def headers(self) -> dict[str, str]:
        """This dimension's three ``x-ratelimit-*`` headers."""
        return {
            f"x-ratelimit-limit-{self.name}": str(self.limit),
            f"x-ratelimit-remaining-{self.name}": str(self.remaining()),
            f"x-ratelimit-reset-{self.name}": format_duration(self.reset_ms()),
        }


def decide(allowed: bool, rpm: int, tpm: int, rq: int, tk: int, tokens: int) -> RateDecision:
    """The decision from the admit script's reply: its verdict, the key's limits and the
    bucket levels it left (after the charge when admitted, as found when refused)."""
    buckets = {
        "requests": (Bucket("requests", rpm, rq), 1),
        "tokens": (Bucket("tokens", tpm, tk), tokens),
    }
    limited = {name: pair for name, pair in buckets.items() if pair[0].limit > 0}
    headers: dict[str, str] = {}
    for bucket, _ in limited.values():
        headers.update(bucket.headers())
    if allowed:
        return RateDecision(allowed=True, retry_after_s=0.0, headers=headers)
    refused = tuple(n for n, (b, need) in limited.items() if b.level < need * SCALE)
    too_large = tpm > 0 and tokens > tpm
    wait = (
        0 if too_large else max((limited[n][0].wait_ms(limited[n][1]) for n in refused), default=0)
    )
    return RateDecision(
        allowed=False,
        retry_after_s=wait / 1000,
        headers=headers,
        limited_by=refused,
        too_large=too_large,
    )
