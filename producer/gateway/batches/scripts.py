"""The batch runner's Lua scripts (see each file's header)."""

from __future__ import annotations

from tokenfleet.shared.scripts.registry import load_lua

_PACKAGE = "tokenfleet.producer.gateway.batches"
RECORD = load_lua(_PACKAGE, "batch_record.lua")
LEASE = load_lua(_PACKAGE, "batch_lease.lua", ok_codes=("lost",))
ADVANCE = load_lua(_PACKAGE, "batch_advance.lua")
CANCEL = load_lua(_PACKAGE, "batch_cancel.lua")
