"""What an API key is, how it is presented, and how its record is stored: pure functions.

A presented key reads ``tf-<key_id>-<secret>``: ``key_id`` is 10 characters of ``[a-z0-9]``
(public: it names the key in listings and prefixes the request ids the gateway makes for it),
``secret`` is ``secrets.token_urlsafe(24)``, 192 random bits in 32 characters of
``[A-Za-z0-9_-]``. Redis stores only the SHA-256 digest of the whole presented key: the key is
high-entropy, so a plain hash is enough (a slow password hash buys nothing against guessing 192
bits) and costs the gateway microseconds per request. Digests are compared with
:func:`hmac.compare_digest`.

Record layout (the hash at ``Keys.api_key(key_id)``; all values are strings)::

    name              unique among live keys (check_name: 1-64 of [A-Za-z0-9._-])
    digest            hex SHA-256 of the presented key; removed on revoke
    priority_ceiling  critical | normal | batch: the most urgent priority the key may use
    rpm, tpm          requests / tokens per minute; 0 = unlimited
    role              user | viewer | admin (absent: user): what the key may do besides
                      the OpenAI API (``Role``: the fleet console)
    tenant, weight    whose requests the key's are, and that tenant's share weight
                      (absent: the default tenant, and the tenant's weight as it is stored;
                      docs/fairness.md)
    created_at        epoch seconds (the creating machine's clock)
    revoked_at        epoch seconds; absent while the key is live
    rq, tk, ts        quota buckets, owned by the Lua scripts (see :mod:`.quota`)
    refused           requests the quota refused so far (a counter: api_key_admit.lua)
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import check_name
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.tenants import DEFAULT_TENANT, check_tenant, check_weight

KEY_ID_LENGTH = 10
KEY_ID_ALPHABET = string.ascii_lowercase + string.digits
SECRET_BYTES = 24  # 192 bits, above the 128 a guess-proof bearer token needs
PRESENTED_PREFIX = "tf"
# Bound of rpm and tpm: the scripts count in units of 1/60_000 (quota.SCALE), and
# 1e9 * 60_000 * 3 stays far below 2**53, so every bucket level is an exact integer in Lua.
MAX_LIMIT = 1_000_000_000
# A presented key is exactly this long; anything longer is refused before it is hashed.
PRESENTED_LENGTH = len(PRESENTED_PREFIX) + 1 + KEY_ID_LENGTH + 1 + 32

_KEY_ID_RE = re.compile(rf"^[a-z0-9]{{{KEY_ID_LENGTH}}}$")
_PRESENTED_RE = re.compile(
    rf"^{PRESENTED_PREFIX}-([a-z0-9]{{{KEY_ID_LENGTH}}})-[A-Za-z0-9_-]{{32}}$"
)
RECORD_FIELDS = (
    "name",
    "digest",
    "priority_ceiling",
    "rpm",
    "tpm",
    "created_at",
    "revoked_at",
    "role",
    "tenant",
    "weight",
)


class Role(StrEnum):
    """What a key may do besides the OpenAI API, each role all the one before it may.

    ``user``: the OpenAI API only (its own requests, nothing of other keys'); ``viewer``: also
    read the fleet console (every queue, worker and request: an operator's view, read-only);
    ``admin``: also act there (cancel, requeue, discard).
    """

    USER = "user"
    VIEWER = "viewer"
    ADMIN = "admin"

    @classmethod
    def parse(cls, value: str | Role) -> Role:
        """A role or its name; ``InvalidRequest`` naming the choices."""
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            names = ", ".join(r.value for r in cls)
            raise InvalidRequest(f"unknown role {value!r}; expected one of: {names}") from None

    def allows(self, needed: Role) -> bool:
        """Whether this role may do what ``needed`` may."""
        order = list(Role)
        return order.index(self) >= order.index(needed)


def check_limit(what: str, value: int) -> int:
    """Return ``value`` if it is a valid per-minute limit (an int in 0..MAX_LIMIT; 0 means
    unlimited), else raise ``InvalidRequest`` naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LIMIT:
        raise InvalidRequest(f"{what} must be an integer from 0 (unlimited) to {MAX_LIMIT}")
    return value


def is_key_id(text: str) -> bool:
    """Whether ``text`` has the shape of a key id (10 of ``[a-z0-9]``)."""
    return bool(_KEY_ID_RE.match(text))


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One API key as the gateway sees it: never its secret nor its digest.

    Attributes:
        key_id: 10 characters of ``[a-z0-9]``; safe inside a request id.
        name: a label for people, unique among live keys.
        priority_ceiling: the most urgent priority the key may submit at (``NORMAL`` allows
            normal and batch, not critical).
        rpm: requests per minute (0: unlimited).
        tpm: tokens per minute (0: unlimited).
        created_at: epoch seconds.
        revoked_at: epoch seconds of the revoke; ``None`` while live.
        role: what the key may do besides the OpenAI API (``Role``; default ``user``).
        tenant: whose requests the key's are (docs/fairness.md; default ``default``).
        weight: the tenant's share weight its requests record; ``None``: as stored.
    """

    key_id: str
    name: str
    priority_ceiling: Priority
    rpm: int
    tpm: int
    created_at: float
    revoked_at: float | None = None
    role: Role = Role.USER
    tenant: str = DEFAULT_TENANT
    weight: float | None = None

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        if self.weight is not None:
            object.__setattr__(self, "weight", check_weight(self.weight))
        if not isinstance(self.key_id, str) or not is_key_id(self.key_id):
            raise InvalidRequest(f"API key id {self.key_id!r} must be 10 of [a-z0-9]")
        check_name("API key", self.name)
        check_limit("rpm", self.rpm)
        check_limit("tpm", self.tpm)
        if not isinstance(self.priority_ceiling, Priority):
            raise InvalidRequest("priority_ceiling must be a Priority")
        object.__setattr__(self, "role", Role.parse(self.role))

    @property
    def revoked(self) -> bool:
        """Whether the key was revoked."""
        return self.revoked_at is not None

    def permits(self, priority: Priority) -> bool:
        """Whether the key may submit at ``priority`` (no more urgent than its ceiling)."""
        return priority >= self.priority_ceiling

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``tokenfleet keys list --json``); holds nothing secret."""
        return {
            "key_id": self.key_id,
            "name": self.name,
            "priority_ceiling": self.priority_ceiling.label,
            "rpm": self.rpm,
            "tpm": self.tpm,
            "created_at": self.created_at,
            "revoked_at": self.revoked_at,
            "role": self.role.value,
            "tenant": self.tenant,
            "weight": self.weight,
        }


def new_key_id() -> str:
    """A random key id (36**10, about 3.7e15 values; a collision at create draws again)."""
    return "".join(secrets.choice(KEY_ID_ALPHABET) for _ in range(KEY_ID_LENGTH))


def new_presented_key(key_id: str) -> str:
    """A fresh presented key for ``key_id``: ``tf-<key_id>-<secret>``."""
    return f"{PRESENTED_PREFIX}-{key_id}-{secrets.token_urlsafe(SECRET_BYTES)}"


def parse_presented(presented: str) -> str | None:
    """The key id of a well-formed presented key, else ``None`` (nothing else is told)."""
    if len(presented) != PRESENTED_LENGTH:
        return None
    match = _PRESENTED_RE.match(presented)
    return match.group(1) if match else None


def digest_of(presented: str) -> str:
    """The stored form of a presented key: its hex SHA-256."""
    return hashlib.sha256(presented.encode("ascii")).hexdigest()


# Compared against when a key id is unknown, so that path does the same work as a wrong secret.
DUMMY_DIGEST = "0" * 64


def digest_matches(presented: str, stored: str | None) -> bool:
    """Whether ``presented`` hashes to ``stored`` (constant-time; ``None`` never matches)."""
    ok = hmac.compare_digest(digest_of(presented), stored or DUMMY_DIGEST)
    return ok and stored is not None


def encode_record(key: ApiKey, digest: str) -> dict[str, str]:
    """The hash fields of a new key's record (``revoked_at`` only once revoked)."""
    out = {
        "name": key.name,
        "digest": digest,
        "priority_ceiling": key.priority_ceiling.label,
        "rpm": str(key.rpm),
        "tpm": str(key.tpm),
        "created_at": repr(key.created_at),
    }
    if key.revoked_at is not None:
        out["revoked_at"] = repr(key.revoked_at)
    if key.role is not Role.USER:  # (absent reads as user: records made before roles)
        out["role"] = key.role.value
    if key.tenant != DEFAULT_TENANT:  # (absent reads as the default tenant)
        out["tenant"] = key.tenant
    if key.weight is not None:
        out["weight"] = repr(key.weight)
    return out


def _text(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def decode_record(
    key_id: str, raw: Mapping[str, str] | Mapping[bytes, bytes]
) -> tuple[ApiKey, str | None] | None:
    """``(key, digest)`` from a record read with HGETALL, ``None`` when there is no record.
    ``digest`` is ``None`` for a revoked key. Fields other than the record's (the quota
    buckets) are ignored. A record that does not decode raises ``InvalidRequest``."""
    if not raw:
        return None
    fields = {_text(k): _text(v) for k, v in raw.items()}
    try:
        revoked = fields.get("revoked_at")
        key = ApiKey(
            key_id=key_id,
            name=fields["name"],
            priority_ceiling=Priority.parse(fields["priority_ceiling"]),
            rpm=int(fields["rpm"]),
            tpm=int(fields["tpm"]),
            created_at=float(fields["created_at"]),
            revoked_at=float(revoked) if revoked else None,
            role=Role.parse(fields.get("role") or Role.USER),
            tenant=fields.get("tenant") or DEFAULT_TENANT,
            weight=float(fields["weight"]) if fields.get("weight") else None,
        )
    except (KeyError, ValueError, InvalidRequest) as exc:
        raise InvalidRequest(f"API key {key_id}: its record does not decode ({exc})") from exc
    return key, (None if key.revoked else fields.get("digest"))
