"""How much of its limits each API key uses now, for the fleet console: its buckets as the next
admit would find them (``lua/api_key_peek.lua``, read-only, the same refill arithmetic as admit)
and the requests its quota refused so far (the record's ``refused`` counter).

Bounded: the live keys' names (``Keys.api_key_names``, one ``HGETALL``; revoked keys, which only
accumulate, are never read), then at most ``limit`` of them, by name: one pipelined ``HGETALL``
and one ``EVALSHA`` each. ``tokenfleet keys list`` lists every key, revoked ones too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet.producer.gateway.auth.model import ApiKey, decode_record
from tokenfleet.producer.gateway.auth.quota import SCALE
from tokenfleet.producer.gateway.auth.scripts import API_KEY_PEEK
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.scripts.registry import aqueue, check_reply


@dataclass(frozen=True, slots=True)
class KeyUsage:
    """One key and its use: ``requests_used`` / ``tokens_used`` of ``rpm`` / ``tpm`` are what
    its buckets miss now (0 for an unlimited dimension); ``refused`` counts admit's refusals."""

    key: ApiKey
    requests_used: int
    tokens_used: int
    refused: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (nothing secret: ``ApiKey`` holds no key or digest)."""
        return {
            **self.key.to_dict(),
            "requests_used": self.requests_used,
            "tokens_used": self.tokens_used,
            "refused": self.refused,
        }


async def key_usage(redis: Any, keys: Keys, limit: int = 50) -> list[KeyUsage]:
    """The use of at most ``limit`` live keys, by name (a key revoked meanwhile is left out)."""
    names = await redis.hgetall(keys.api_key_names)
    ids = [as_str(i) or "" for _, i in sorted((as_str(n) or "", i) for n, i in names.items())]
    ids = ids[:limit]
    pipe = redis.pipeline(transaction=False)
    for key_id in ids:
        pipe.hgetall(keys.api_key(key_id))
    found: list[ApiKey] = []
    refused: dict[str, int] = {}
    for key_id, raw in zip(ids, await pipe.execute(), strict=True):
        decoded = decode_record(key_id, raw)
        if decoded is not None and not decoded[0].revoked:
            found.append(decoded[0])
            count = as_str(raw.get(b"refused") or raw.get("refused")) or "0"
            refused[key_id] = int(count) if count.isdigit() else 0
    pipe = redis.pipeline(transaction=False)
    for key in found:
        await aqueue(redis, pipe, API_KEY_PEEK, [keys.api_key(key.key_id)], [""])
    out = []
    for key, reply in zip(found, await pipe.execute(), strict=True):
        values = check_reply(API_KEY_PEEK, reply)
        if values[0] != "ok":  # revoked: nothing in use
            out.append(KeyUsage(key, 0, 0, refused[key.key_id]))
            continue
        rpm, tpm, rq, tk = (int(v) for v in values[1:5])
        out.append(
            KeyUsage(
                key,
                requests_used=max(0, rpm - rq // SCALE) if rpm else 0,
                tokens_used=max(0, tpm - tk // SCALE) if tpm else 0,
                refused=refused[key.key_id],
            )
        )
    return out
