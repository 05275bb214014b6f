"""Gateway API keys with per-key quotas, stored in Redis (issue 17, item 6).

Imports no web framework: the gateway calls it, and it is tested on its own.

* :class:`ApiKeyAdmin` (sync; ``tokenfleet keys create|list|revoke``) creates a key
  ``tf-<key_id>-<secret>`` and shows it once; Redis keeps only its SHA-256 digest
  (:mod:`.model` has the format and the record's layout).
* :class:`ApiKeyStore` (asyncio; the gateway) authenticates a presented key (``AuthError``,
  code ``invalid_api_key``, on a missing, malformed, unknown or revoked one), admits a request
  against the key's limits and settles its token charge once the usage is known. A revoked key
  is refused by ``authenticate`` within ``cache_s`` seconds (2 by default) on every gateway,
  and by ``admit`` at once.
* Quotas (:mod:`.quota`): two token buckets per key, requests (capacity ``rpm``) and tokens
  (capacity ``tpm``), each refilling its limit per minute; check-and-charge of both is one Lua
  script (``lua/api_key_admit.lua``) on Redis ``TIME``, so the limits hold exactly across
  gateway processes. :class:`RateDecision` carries OpenAI's ``x-ratelimit-*`` headers and a
  ``Retry-After`` derived from the refill.

A key's ``Role`` (``user``, ``viewer``, ``admin``) says whether it may also read the fleet
console (viewer) and act there (admin); a ``user`` key never sees other keys' requests.

Isolation between keys is the gateway's: it prefixes each request id with ``ApiKey.key_id``
(10 of ``[a-z0-9]``), so a key only ever names its own requests.
"""

from __future__ import annotations

from tokenfleet.producer.gateway.auth.admin import ApiKeyAdmin
from tokenfleet.producer.gateway.auth.model import ApiKey, Role
from tokenfleet.producer.gateway.auth.quota import RateDecision, format_duration
from tokenfleet.producer.gateway.auth.store import ApiKeyStore
from tokenfleet.shared.errors import AuthError

__all__ = [
    "ApiKey",
    "ApiKeyAdmin",
    "ApiKeyStore",
    "AuthError",
    "RateDecision",
    "Role",
    "format_duration",
]
