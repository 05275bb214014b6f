"""Crash safety: this worker's heartbeat, and claiming entries of workers whose heartbeat lapsed.

Heartbeat: hash ``P:worker:NAME`` (stats) with a TTL of ``heartbeat_ttl_s``, rewritten every
``heartbeat_interval_s`` from the service loop (not a thread: a worker whose loop hangs must look
dead), plus ``ZADD P:workers NAME now`` for ``tokenfleet status``.

Claiming: every ``claim_interval_s`` a worker lists, per stream, the pending entries idle for at
least ``claim_idle_s`` (``XPENDING ... IDLE``), checks which of their owners still have a
heartbeat (one pipelined ``EXISTS`` per owner), and ``XCLAIM``s (with the same min-idle time, so
two claimers never both win) only entries of owners without one, at most as many as its engine
can take. ``XAUTOCLAIM`` is not used: it would take entries of live workers running long
generations too, which would then have to be given back.

Invariant: an entry whose owner has a live heartbeat is never claimed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake import Entry, Intake

PENDING_SCAN = 100  # pending entries looked at per stream and claim round


class Heartbeat:
    """Writes and removes one worker's heartbeat."""

    def __init__(
        self, client: redis.Redis, settings: Settings, *, worker_name: str, ttl_s: float
    ) -> None:
        self.client = client
        self.keys = Keys(settings.key_prefix)
        self.worker_name = worker_name
        self.ttl_ms = max(1, math.ceil(ttl_s * 1000))
        self.started_at = time.time()

    def beat(self, stats: Mapping[str, str | int | float]) -> None:
        """Refresh the heartbeat hash (with ``stats``) and its TTL in one round trip."""
        now = time.time()
        key = self.keys.worker(self.worker_name)
        pipe = self.client.pipeline(transaction=True)
        fields: Any = {**stats, "started_at": self.started_at, "beat_at": now}
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, self.ttl_ms)
        pipe.zadd(self.keys.workers, {self.worker_name: now})
        pipe.execute()

    def remove(self) -> None:
        """Delete the heartbeat: this worker's leftover entries become claimable at once."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.worker(self.worker_name))
        pipe.zrem(self.keys.workers, self.worker_name)
        pipe.execute()


class Claimer:
    """Finds and claims entries whose owner is dead, for one worker's streams."""

    def __init__(self, client: redis.Redis, intake: Intake, *, claim_idle_s: float) -> None:
        self.client = client
        self.intake = intake
        self.keys = intake.keys
        self.worker_name = intake.worker_name
        self.min_idle_ms = max(0, int(claim_idle_s * 1000))

    def claim(self, budget: int) -> list[Entry]:
        """Claim up to ``budget`` entries of dead owners, most urgent stream first."""
        if budget <= 0:
            return []
        out: list[Entry] = []
        for p in self.intake.priorities:
            stream = self.intake.streams[p]
            try:
                pending: Any = self.client.xpending_range(
                    stream,
                    CONSUMER_GROUP,
                    min="-",
                    max="+",
                    count=PENDING_SCAN,
                    idle=self.min_idle_ms,
                )
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                continue
            candidates = [
                (as_str(e["message_id"]) or "", as_str(e["consumer"]) or "")
                for e in pending
                if as_str(e["consumer"]) != self.worker_name
            ]
            if not candidates:
                continue
            owners = sorted({owner for _, owner in candidates})
            pipe = self.client.pipeline(transaction=False)
            for owner in owners:
                pipe.exists(self.keys.worker(owner))
            alive = {o for o, n in zip(owners, pipe.execute(), strict=True) if n}
            ids: list[Any] = [mid for mid, owner in candidates if owner not in alive]
            ids = ids[: budget - len(out)]
            if not ids:
                continue
            claimed: Any = self.client.xclaim(
                stream, CONSUMER_GROUP, self.worker_name, self.min_idle_ms, ids
            )
            for entry_id, fields in claimed:
                if fields is None:  # deleted meanwhile (finished by someone): drop it from the PEL
                    self.client.xack(stream, CONSUMER_GROUP, entry_id)
                    continue
                out.append(self.intake.make_entry(stream, entry_id, fields))
            if len(out) >= budget:
                break
        return out
