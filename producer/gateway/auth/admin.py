"""Creating, listing and revoking API keys: the synchronous face ``tokenfleet keys`` uses."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from tokenfleet.producer.gateway.auth.model import (
    ApiKey,
    Role,
    check_limit,
    decode_record,
    digest_of,
    encode_record,
    is_key_id,
    new_key_id,
    new_presented_key,
)
from tokenfleet.producer.gateway.auth.scripts import (
    API_KEY_CREATE,
    API_KEY_REVOKE,
    create_keys,
    revoke_keys,
)
from tokenfleet.producer.tenants import set_tenant
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys, check_name
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.scripts.registry import call
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.tenants import DEFAULT_TENANT

# Draws of a fresh key id before giving up; a clash among 36**10 ids is already rare.
_ID_ATTEMPTS = 8


class ApiKeyAdmin:
    """Administers the API keys of one fleet (one key prefix) through a sync client.

    Invariants (kept by the create and revoke scripts, each one atomic step): every id in
    ``Keys.api_keys`` has a record; ``Keys.api_key_names`` maps each live key's name to its id,
    so no two live keys share a name; Redis holds a key's SHA-256 digest only while it is live,
    and never the key itself.

    ``clock`` gives ``created_at`` / ``revoked_at`` (epoch seconds; tests may fix it).
    """

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = client
        self._keys = Keys.for_settings(settings)
        self._clock = clock

    def create(
        self,
        name: str,
        *,
        priority_ceiling: Priority | str = Priority.NORMAL,
        rpm: int = 0,
        tpm: int = 0,
        role: Role | str = Role.USER,
        tenant: str = DEFAULT_TENANT,
        weight: float | None = None,
    ) -> tuple[str, ApiKey]:
        """Create a key; returns ``(presented key, ApiKey)``. The presented key exists only in
        this return value: show it once. Refuses (``InvalidRequest``) a name a live key has.
        ``role``: ``viewer`` or ``admin`` also open the fleet console (``Role``).
        ``tenant`` / ``weight``: whose requests the key's are, with what share weight
        (docs/fairness.md)."""
        check_name("API key", name)
        role = Role.parse(role)
        ceiling = Priority.parse(priority_ceiling)
        check_limit("rpm", rpm)
        check_limit("tpm", tpm)
        for _ in range(_ID_ATTEMPTS):
            key = ApiKey(
                key_id=new_key_id(),
                name=name,
                priority_ceiling=ceiling,
                rpm=rpm,
                tpm=tpm,
                created_at=self._clock(),
                role=role,
                tenant=tenant,
                weight=weight,
            )
            presented = new_presented_key(key.key_id)
            fields = [x for pair in encode_record(key, digest_of(presented)).items() for x in pair]
            code, *_ = call(
                self._redis,
                API_KEY_CREATE,
                create_keys(self._keys, key.key_id),
                [key.key_id, name, *fields],
            )
            if code == "ok":
                if weight is not None:  # the key's weight is its tenant's (docs/fairness.md)
                    set_tenant(self._redis, self._keys, tenant, weight=weight)
                return presented, key
        raise InvalidRequest(f"no free API key id after {_ID_ATTEMPTS} draws")  # pragma: no cover

    def list(self) -> list[ApiKey]:
        """Every key, live and revoked, oldest first (``ApiKey`` holds nothing secret)."""
        ids = sorted(_text(x) for x in self._redis.smembers(self._keys.api_keys))
        pipe = self._redis.pipeline(transaction=False)
        for key_id in ids:
            pipe.hgetall(self._keys.api_key(key_id))
        out = []
        for key_id, raw in zip(ids, pipe.execute(), strict=True):
            decoded = decode_record(key_id, raw)
            if decoded is not None:
                out.append(decoded[0])
        return sorted(out, key=lambda k: (k.created_at, k.key_id))

    def get(self, key_id_or_name: str) -> ApiKey:
        """The key with this id (live or revoked) or this live name; ``InvalidRequest`` when
        there is none. An id wins over a name that happens to look like it."""
        key_id = self._resolve(key_id_or_name)
        decoded = decode_record(key_id, self._redis.hgetall(self._keys.api_key(key_id)))  # type: ignore[arg-type]
        if decoded is None:
            raise InvalidRequest(f"no API key with id {key_id}")
        return decoded[0]

    def revoke(self, key_id_or_name: str) -> ApiKey:
        """Revoke a key by id or live name; returns it as revoked (revoking twice is a no-op that
        returns the first revoke's time). Gateways refuse it within their cache bound
        (``ApiKeyStore``'s ``cache_s``) and their quota checks at once."""
        key_id = self._resolve(key_id_or_name)
        call(
            self._redis,
            API_KEY_REVOKE,
            revoke_keys(self._keys, key_id),
            [key_id, repr(self._clock())],
        )
        return self.get(key_id)

    def _resolve(self, key_id_or_name: str) -> str:
        text = key_id_or_name.strip() if isinstance(key_id_or_name, str) else ""
        if is_key_id(text) and self._redis.sismember(self._keys.api_keys, text):
            return text
        key_id: Any = self._redis.hget(self._keys.api_key_names, text) if text else None
        if key_id is None:
            raise InvalidRequest(f"no live API key with id or name {key_id_or_name!r}")
        return _text(key_id)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value
