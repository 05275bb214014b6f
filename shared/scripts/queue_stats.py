"""Read every queue's length, running count, bound and policy in one consistent snapshot."""

from __future__ import annotations

from tokenfleet.shared.scripts.registry import load_lua

QUEUE_STATS = load_lua("tokenfleet.shared.scripts", "queue_stats.lua")
