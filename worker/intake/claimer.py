"""Crash safety on the intake side: claiming entries of workers whose heartbeat lapsed (the
heartbeat itself: ``tokenfleet.worker.service.heartbeat``).

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
after its first heartbeat and before its first read) and resumes them like any claimed entry;
each counts as a lost worker for the poison guard, as a claim would. Each is claimed with the
idle time it had when listed as the min idle, so one that another worker claimed in between
(the earlier process's heartbeat had lapsed) stays with that worker. Worker names must be
unique among live processes: a second live process under one name takes over the first's work.

Orphans: an entry pending under this worker's own name that it neither runs nor is starting
was read or started by a round trip whose connection was lost (Redis restarted, or stalled past
the socket timeout, between executing the command and answering it). Nobody else would claim it
(this worker's heartbeat is alive), so the worker takes it again itself: at once after an outage
(:meth:`Claimer.orphans`, all of them) and in every claim round (entries idle for
``claim_idle_s``, when the caller says what it runs), and starts it; ``START`` resumes it from
its token list, or ends it if it ended meanwhile.

Routed streams (docs/routing.md): every stream of a served level is scanned, the shared one, this
worker's routed one and every other routed worker's (``Keys.routers``): a dead worker's pending
routed entries, and what a dead stealer took from anyone's, are claimed like shared ones.

Overflow workers (``--overflow-for``, docs/routing.md, "Overflow pool"): such a worker takes only
work that has waited past its threshold, and a dead worker's entry waits from its owner's death on.
So with ``dead_for_s`` set (its overflow threshold) it claims an entry only once it has found the
owner without a heartbeat for that long (``_dead_since``, its own observation: heartbeat TTLs may
differ between workers); regular workers, which claim at once, take such entries first whenever they
have room, and with no regular worker alive the overflow worker still ends them.

Invariant: an entry whose owner has a live heartbeat is never claimed, except by a process of
the owner's own name, for entries pending from before that process started, or for orphans;
with ``dead_for_s``, neither is one whose owner this worker has not found dead for that long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.worker.intake.jobs import Entry
from tokenfleet.worker.intake.streams import PriorityStreams

log = logging.getLogger(__name__)

PENDING_SCAN = 100  # pending entries looked at per stream and claim round


class Claimer:
    """Finds and claims entries whose owner is dead, for one worker's streams."""

    def __init__(
        self, client: redis.Redis, streams: PriorityStreams, *, claim_idle_s: float
    ) -> None:
        self.client = client
        self.streams = streams
        self.keys = streams.keys
        self.worker_name = streams.worker_name
        self.min_idle_ms = max(0, int(claim_idle_s * 1000))
        # stream -> (entry id, idle ms when listed) of what an earlier process of this name left
        self._inherited: dict[str, list[tuple[str, int]]] = {}
        self._cursor: dict[str, str] = {}  # stream -> where the next scan starts ("(ID")
        # an overflow worker's threshold (routing_wiring): how long an owner must have been
        # found dead before its entries are claimed; 0: at once
        self.dead_for_s = 0.0
        # owner -> monotonic time this worker first found it dead (kept while it stays dead)
        self._dead_since: dict[str, float] = {}

    def claim_streams(self) -> list[str]:
        """Every stream of the served levels, most urgent level first: shared, this worker's
        routed one, the other routed workers' (each noted in ``streams`` for parsing)."""
        s = self.streams
        members: Any = self.client.zrange(self.keys.routers(s.model_name), 0, -1)
        others = sorted({as_str(m) or "" for m in members} - {"", s.worker_name})
        out: list[str] = []
        for p in s.priorities:
            out += [s.stream_of[p], s.routed_of[p]]
            for worker in others:
                stream = self.keys.routed(s.model_name, p, worker)
                s.note_stream(stream, p)
                out.append(stream)
        return out

    @property
    def num_inherited(self) -> int:
        """Entries inherited from an earlier process of this name and not yet taken over."""
        return sum(len(found) for found in self._inherited.values())

    @property
    def inheriting(self) -> bool:
        """Inherited entries are still waiting (O(1): emptied streams leave the dict)."""
        return bool(self._inherited)

    def inherit(self) -> int:
        """Note the entries pending under this worker's own name, which can only be an earlier
        process's (call once, after the first heartbeat and before the first read); :meth:`claim`
        takes them over first. Entries in streams this process does not serve (its model name or
        priorities changed) are passed on to a consumer that never beats, ``NAME~gone``, with
        their idle time kept, for the workers that serve them to claim. Returns how many this
        process will take over."""
        served = set(self.claim_streams())
        for stream in served:
            found = self._own_pending(stream)
            if found:
                self._inherited[stream] = found
        for member in self.client.smembers(self.keys.queues):
            model, _, label = (as_str(member) or "").rpartition("|")
            try:
                stream = self.keys.stream(model, Priority.parse(label))
            except ValueError:
                continue
            if stream not in served:
                self._pass_on(stream, self._own_pending(stream))
        return self.num_inherited

    def _own_pending(self, stream: str) -> list[tuple[str, int]]:
        """(entry id, idle ms) of every entry pending under this worker's name in ``stream``."""
        found: list[tuple[str, int]] = []
        start = "-"
        while True:
            pending = self._pending(stream, start, consumername=self.worker_name)
            if pending is None:
                return found
            found += [
                (as_str(e["message_id"]) or "", int(e["time_since_delivered"])) for e in pending
            ]
            if len(pending) < PENDING_SCAN:
                return found
            start = "(" + found[-1][0]

    def _pending(self, stream: str, start: str, **filters: Any) -> list[Any] | None:
        """Up to ``PENDING_SCAN`` pending entries of ``stream`` from ``start`` on (XPENDING's
        extended form with ``filters``); None if the stream or its group is gone."""
        try:
            pending: Any = self.client.xpending_range(
                stream, CONSUMER_GROUP, min=start, max="+", count=PENDING_SCAN, **filters
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return None
        return list(pending)

    def _claim_each(
        self, stream: str, found: list[tuple[str, int]], consumer: str, *, keep_idle: bool = False
    ) -> list[Any]:
        """One XCLAIM per inherited entry for ``consumer``, each with the idle time it had when
        listed as its min idle: an entry another worker claimed meanwhile (the earlier process's
        heartbeat had lapsed) has been idle for less since, so it stays that worker's.
        ``keep_idle``: ids only, idle time unchanged (entries passed on, for others to claim).
        Returns the replies."""
        pipe = self.client.pipeline(transaction=False)
        for entry_id, idle_ms in found:
            extra: dict[str, Any] = {"idle": idle_ms, "justid": True} if keep_idle else {}
            pipe.xclaim(stream, CONSUMER_GROUP, consumer, idle_ms, [entry_id], **extra)
        return list(pipe.execute())

    def _pass_on(self, stream: str, found: list[tuple[str, int]]) -> None:
        if not found:
            return
        self._claim_each(stream, found, f"{self.worker_name}~gone", keep_idle=True)
        log.warning(
            "worker %s: %d entries pending under this name in %s, which it does not serve, "
            "are left for the workers that do",
            self.worker_name,
            len(found),
            stream,
        )

    def orphans(self, known: Collection[tuple[str, str]]) -> list[Entry]:
        """Every orphan (module doc), claimed again to this worker for the caller to start:
        entries pending under its own name whose (stream, entry id) is not in ``known``
        (what it runs or is starting). Inherited entries are left to :meth:`claim`."""
        out: list[Entry] = []
        for stream in self.claim_streams():
            inherited = {mid for mid, _ in self._inherited.get(stream, ())}
            found = [
                (mid, idle)
                for mid, idle in self._own_pending(stream)
                if (stream, mid) not in known and mid not in inherited
            ]
            if found:
                replies = self._claim_each(stream, found, self.worker_name)
                out += self._entries(stream, [e for reply in replies for e in reply])
        return out

    def claim(self, budget: int, known: Collection[tuple[str, str]] | None = None) -> list[Entry]:
        """Claim up to ``budget`` entries of dead owners, most urgent stream first (inherited
        entries before others). ``known``: the (stream, entry id) of what this worker runs or is
        starting; with it, its own orphans found idle are taken too (None: never)."""
        if budget <= 0:
            return []
        out: list[Entry] = []
        now = time.monotonic()
        found_dead: set[str] = set()  # owners found dead this round (with dead_for_s)
        for stream in self.claim_streams():
            out += self._take_inherited(stream, budget - len(out))
            if len(out) >= budget:
                break
            start = self._cursor.get(stream, "-")
            pending = self._pending(stream, start, idle=self.min_idle_ms)
            if pending is None:
                continue
            # the next round looks further down, unless this one leaves dead entries unclaimed
            if len(pending) < PENDING_SCAN:
                self._cursor.pop(stream, None)
            else:
                self._cursor[stream] = "(" + (as_str(pending[-1]["message_id"]) or "")
            me = self.worker_name
            candidates = [
                (as_str(e["message_id"]) or "", as_str(e["consumer"]) or "") for e in pending
            ]
            skip: set[str] = set()
            if known is not None:  # own entries: orphans unless run, inherited or just taken
                skip = {mid for mid, _ in self._inherited.get(stream, ())}
                skip |= {e.entry_id for e in out if e.stream == stream}
                skip |= {mid for s_, mid in known if s_ == stream}
            candidates = [
                (mid, owner)
                for mid, owner in candidates
                if owner != me or (known is not None and mid not in skip)
            ]
            if not candidates:
                continue
            owners = sorted({owner for _, owner in candidates if owner != me})
            alive = {me} | self._alive(owners)
            dead = [mid for mid, owner in candidates if owner == me or owner not in alive]
            if self.dead_for_s > 0:
                ripe = self._dead_long_enough([o for o in owners if o not in alive], now)
                found_dead.update(o for o in owners if o not in alive)
                ready = [mid for mid, o in candidates if o == me or o in ripe]
                if len(ready) < len(dead):
                    self._cursor[stream] = start  # come back once they have waited enough
                dead = ready
            ids = dead[: budget - len(out)]
            if len(ids) < len(dead):
                self._cursor[stream] = start  # come back for the rest
            if not ids:
                continue
            out += self._xclaim(stream, ids, min_idle_ms=self.min_idle_ms)
            if len(out) >= budget:
                break
        else:  # a whole round: forget owners no longer found dead (taken over, or back)
            self._dead_since = {o: t for o, t in self._dead_since.items() if o in found_dead}
        return out

    def _take_inherited(self, stream: str, room: int) -> list[Entry]:
        """Claim up to ``room`` of the entries inherited on ``stream`` (forgotten once taken)."""
        inherited = self._inherited.get(stream)
        if not inherited:
            return []
        take = inherited[:room]
        del inherited[: len(take)]
        if not inherited:
            del self._inherited[stream]
        replies = self._claim_each(stream, take, self.worker_name)
        return self._entries(stream, [e for reply in replies for e in reply])

    def _alive(self, owners: list[str]) -> set[str]:
        """Those of ``owners`` whose heartbeat key exists (one round trip)."""
        if not owners:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for owner in owners:
            pipe.exists(self.keys.worker(owner))
        return {o for o, n in zip(owners, pipe.execute(), strict=True) if n}

    def _dead_long_enough(self, dead: list[str], now: float) -> set[str]:
        """Of the owners found ``dead`` now, those found dead ``dead_for_s`` ago or earlier."""
        since = self._dead_since
        return {o for o in dead if now - since.setdefault(o, now) >= self.dead_for_s}

    def _xclaim(self, stream: str, ids: list[str], *, min_idle_ms: int) -> list[Entry]:
        if not ids:
            return []
        claimed: Any = self.client.xclaim(
            stream, CONSUMER_GROUP, self.worker_name, min_idle_ms, list(ids)
        )
        return self._entries(stream, claimed)

    def _entries(self, stream: str, claimed: Any) -> list[Entry]:
        out: list[Entry] = []
        for entry_id, fields in claimed:
            if entry_id is None:  # Redis 6.2 answers nil for an entry deleted meanwhile
                continue
            if fields is None:  # deleted meanwhile (finished by someone): drop it from the PEL
                self.client.xack(stream, CONSUMER_GROUP, entry_id)
                continue
            out.append(self.streams.make_entry(stream, entry_id, fields))
        return out
