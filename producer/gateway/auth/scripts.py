"""The API-key scripts, loaded once from ``lua/``; each file's header lists what it touches.

``api_key_admit``, ``api_key_settle`` and ``api_key_peek`` (read-only: the console's usage)
take ``KEYS[1] = Keys.api_key(key_id)`` only (the record and its buckets live in one hash, so a
quota check touches one key);
``api_key_create`` and ``api_key_revoke`` also keep the id set and the live-name index.
"""

from __future__ import annotations

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.scripts.registry import load_lua

_LUA = "tokenfleet.producer.gateway.auth.lua"

API_KEY_ADMIT = load_lua(_LUA, "api_key_admit.lua", ok_codes=("limited", "revoked"))
API_KEY_SETTLE = load_lua(_LUA, "api_key_settle.lua", ok_codes=("revoked",))
API_KEY_CREATE = load_lua(_LUA, "api_key_create.lua", ok_codes=("taken",))
API_KEY_REVOKE = load_lua(_LUA, "api_key_revoke.lua", ok_codes=("already",))
API_KEY_PEEK = load_lua(_LUA, "api_key_peek.lua", ok_codes=("revoked",))


def create_keys(keys: Keys, key_id: str) -> list[str]:
    """``KEYS[1..3]`` of ``api_key_create``."""
    return [keys.api_key_names, keys.api_keys, keys.api_key(key_id)]


def revoke_keys(keys: Keys, key_id: str) -> list[str]:
    """``KEYS[1..2]`` of ``api_key_revoke``."""
    return [keys.api_key_names, keys.api_key(key_id)]
