"""Crash safety: this worker's heartbeat, and claiming entries of workers whose heartbeat lapsed.

Heartbeat: hash ``P:worker:NAME`` (stats) with a TTL of ``heartbeat_ttl_s``, rewritten every
``heartbeat_interval_s`` from the service loop (not a thread: a worker whose loop hangs must look
dead), plus ``ZADD P:workers NAME now`` for ``tokenfleet status``; each beat also drops names
that have not beaten for ``LAPSED_KEEP_S`` (every restart under ``HOST-PID`` adds a name).

Claiming: every ``claim_interval_s`` a worker lists, per stream, up to ``PENDING_SCAN`` pending
entries idle for at least ``claim_idle_s`` (``XPENDING ... IDLE``), checks which of their owners
still have a heartbeat (one pipelined ``EXISTS`` per owner), and ``XCLAIM``s (with the same
min-idle time, so two claimers never both win) only entries of owners without one, at most as
many as its engine can take. Each round's scan starts after the last entry the previous one
looked at (wrapping round at the end), so however many long generations live workers hold, a
dead worker's entries further down are reached. ``XAUTOCLAIM`` is not used: it would take
entries of live workers running long generations too, which would then have to be given back.

Inheriting: a worker process that starts under a name an earlier process used (a restarted
container keeps its ``HOST-PID`` name, a supervisor restarts ``--name gpu-0``) finds that
process's entries still pending under its own name. No other worker claims them (the name's
heartbeat is alive again), so the new process takes them over itself (:meth:`Claimer.inherit`,
before its first read) and resumes them like any claimed entry; each counts as a lost worker
for the poison guard, as a claim would.

Invariant: an entry whose owner has a live heartbeat is never claimed, except by that owner's
own name, for entries pending from before the process started.
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
LAPSED_KEEP_S = 3600.0  # a name that has not beaten for this long leaves P:workers


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
        pipe.zremrangebyscore(self.keys.workers, "-inf", now - LAPSED_KEEP_S)
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
        self._inherited: dict[str, list[str]] = {}  # stream -> ids an earlier process left
        self._cursor: dict[str, str] = {}  # stream -> where the next scan starts ("(ID")

    @property
    def num_inherited(self) -> int:
        """Entries inherited from an earlier process of this name and not yet taken over."""
        return sum(len(ids) for ids in self._inherited.values())

    def inherit(self) -> int:
        """Note the entries pending under this worker's own name (call once, before the first
        read: they can only be an earlier process's); :meth:`claim` takes them over first.
        Returns how many there are."""
        for p in self.intake.priorities:
            stream = self.intake.streams[p]
            ids: list[str] = []
            start = "-"
            while True:
                try:
                    pending: Any = self.client.xpending_range(
                        stream,
                        CONSUMER_GROUP,
                        min=start,
                        max="+",
                        count=PENDING_SCAN,
                        consumername=self.worker_name,
                    )
                except redis.ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    break
                ids += [as_str(e["message_id"]) or "" for e in pending]
                if len(pending) < PENDING_SCAN:
                    break
                start = "(" + ids[-1]
            if ids:
                self._inherited[stream] = ids
        return self.num_inherited

    def claim(self, budget: int) -> list[Entry]:
        """Claim up to ``budget`` entries of dead owners, most urgent stream first (inherited
        entries before others)."""
        if budget <= 0:
            return []
        out: list[Entry] = []
        for p in self.intake.priorities:
            stream = self.intake.streams[p]
            inherited = self._inherited.get(stream)
            if inherited:
                take = inherited[: budget - len(out)]
                del inherited[: len(take)]
                out += self._xclaim(stream, take, min_idle_ms=0)  # ours already: no race
                if len(out) >= budget:
                    break
            start = self._cursor.get(stream, "-")
            try:
                pending: Any = self.client.xpending_range(
                    stream,
                    CONSUMER_GROUP,
                    min=start,
                    max="+",
                    count=PENDING_SCAN,
                    idle=self.min_idle_ms,
                )
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                continue
            # the next round looks further down, unless this one leaves dead entries unclaimed
            if len(pending) < PENDING_SCAN:
                self._cursor.pop(stream, None)
            else:
                self._cursor[stream] = "(" + (as_str(pending[-1]["message_id"]) or "")
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
            dead = [mid for mid, owner in candidates if owner not in alive]
            ids = dead[: budget - len(out)]
            if len(ids) < len(dead):
                self._cursor[stream] = start  # come back for the rest
            if not ids:
                continue
            out += self._xclaim(stream, ids, min_idle_ms=self.min_idle_ms)
            if len(out) >= budget:
                break
        return out

    def _xclaim(self, stream: str, ids: list[str], *, min_idle_ms: int) -> list[Entry]:
        if not ids:
            return []
        claimed: Any = self.client.xclaim(
            stream, CONSUMER_GROUP, self.worker_name, min_idle_ms, list(ids)
        )
        out: list[Entry] = []
        for entry_id, fields in claimed:
            if fields is None:  # deleted meanwhile (finished by someone): drop it from the PEL
                self.client.xack(stream, CONSUMER_GROUP, entry_id)
                continue
            out.append(self.intake.make_entry(stream, entry_id, fields))
        return out
