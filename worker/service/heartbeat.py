"""This worker's heartbeat: proof of life for the claimers, and its stats for ``tokenfleet status``.

Heartbeat: hash ``P:worker:NAME`` (stats) with a TTL of ``heartbeat_ttl_s``, rewritten every
``HEARTBEAT_INTERVAL_S`` from the service loop (not a thread: a worker whose loop hangs must look
dead), plus ``ZADD P:workers NAME now`` for ``tokenfleet status``; each beat also drops names
that have not beaten for ``LAPSED_KEEP_S`` (every restart under ``HOST-PID`` adds a name). Other
workers claim the entries of a worker whose heartbeat lapsed (``tokenfleet.worker.intake.claimer``).

While it takes new work, each beat also says which model it serves: ``ZADD P:served GT MODEL
now+TTL`` (``GT``: a peer that beat later, or with a longer TTL, is never cut short), so a model
is served exactly while one of its workers' heartbeats would still be alive; the enqueue script
refuses requests for models neither served nor declared (docs/models.md). Nothing
is removed on exit (peers may serve the same model; the expiry ends it), and entries that lapsed
``LAPSED_KEEP_S`` ago are dropped like names.

Routing (docs/routing.md): a worker that takes routed work also sets its own score in
``P:routers:MODEL`` to its heartbeat's expiry (the enqueue script routes only to workers whose
score is in the future; it stays listed after its death so that stealers and claimers, which
know routed streams only from that set, find its routed stream) and its load, ``running`` and
``max_num_seqs``, in ``P:rload:MODEL`` (what the enqueue script weighs: a producer may write
routing keys, never a worker's heartbeat) with its longest step since the last beat in
milliseconds (stealers wait a few of its steps before they take its routed work: it reads new
work at every step's end) and the levels it serves (it is a routing target only for those), and
publishes the changes of its ``PrefixSet`` to ``P:pfx:NAME``, which expires
with the heartbeat; every ``RESYNC_BEATS``-th beat (and the first) rewrites that set whole.

Forgetting routed workers: every ``FORGET_INTERVAL_S`` (and at the first beat) a worker looks at
up to ``FORGET_BATCH`` names of its model's routers set that lapsed ``LAPSED_KEEP_S`` ago and
forgets those whose routed streams are all empty (``FORGET_ROUTERS``: atomic with the check; it
deletes the streams and the name's ``P:rload`` field too, so keys do not pile up with every
``HOST-PID`` restart). A name whose routed stream still holds an entry, waiting or pending, stays
listed until that entry has been taken and has ended: a request is never orphaned there.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import PRIORITIES
from tokenfleet.shared.record import as_str
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.worker import FORGET_ROUTERS
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.tenants import DEFAULT_TENANT, TenantLabels
from tokenfleet.worker.service.prefix_set import PrefixSet

log = logging.getLogger(__name__)
REGISTRY_BACKOFF_S = 10.0  # after a failed registry write, beats skip it this long
LAPSED_KEEP_S = 3600.0  # a name that has not beaten for this long leaves P:workers (and, once
# its routed streams are empty, its model's routers set)
FORGET_INTERVAL_S = 30.0  # how often a worker looks for lapsed routed workers to forget
FORGET_BATCH = 16  # lapsed routed workers looked at per look
RESYNC_BEATS = 30  # every this many beats the published prefix set is rewritten whole


class Heartbeat:
    """Writes and removes one worker's heartbeat, and says which model it serves."""

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        *,
        worker_name: str,
        model_name: str,
        ttl_s: float,
        fleet_client: redis.Redis | None = None,
    ) -> None:
        self.client = client
        self.fleet_client = fleet_client  # a cluster: the registry's slot (``_register``)
        self._registered: bool | None = None  # the last registry write went through
        self._register_after = 0.0  # monotonic time before which no registry write is tried
        self.keys = Keys.for_settings(settings)
        self.worker_name = worker_name
        self.model_name = model_name
        self.ttl_ms = max(1, math.ceil(ttl_s * 1000))
        self.started_at = time.time()
        self.prefixes: PrefixSet | None = None  # set by a worker that takes routed work
        self.max_num_seqs = 1  # its engine's, with prefixes (the load's denominator)
        self.levels = ""  # the priority labels it serves, comma-separated (a routing target
        # only for those: the load's 4th field)
        self._beats = 0
        self._longest_step_s = 0.0  # since the last beat
        self._forget_at = 0.0  # monotonic time of the next look for lapsed routed workers
        self._forget_offset = 0  # where it starts among them (those kept for their entries
        # are passed over, so that a full batch of them does not hide the others)

    def note_step(self, duration_s: float) -> None:
        """Count one engine step's duration (the longest since the last beat is published)."""
        self._longest_step_s = max(self._longest_step_s, duration_s)

    def beat(self, stats: Mapping[str, str | int | float], *, serving: bool = True) -> None:
        """Refresh the heartbeat hash (with ``stats``) and its TTL in one round trip; while
        ``serving`` (it takes new work: not stopping), extend its model's served expiry, and
        with ``prefixes`` set, its routing target score and published prefix set."""
        now = time.time()
        key = self.keys.worker(self.worker_name)
        pipe = self.client.pipeline(transaction=True)
        fields: Any = {**stats, "started_at": self.started_at, "beat_at": now}
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, self.ttl_ms)
        pipe.zadd(self.keys.workers, {self.worker_name: now})
        pipe.zremrangebyscore(self.keys.workers, "-inf", now - LAPSED_KEEP_S)
        if serving:
            served = self.keys.served
            pipe.zadd(served, {self.model_name: now + self.ttl_ms / 1000}, gt=True)
            pipe.zremrangebyscore(served, "-inf", now - LAPSED_KEEP_S)
        if self.prefixes is not None:
            self._route_beat(pipe, now, serving, int(stats.get("running", 0)))
        try:
            pipe.execute()
        except Exception:
            self._beats = 0  # the prefix changes taken for this beat are lost: rewrite it all
            raise
        self._register(now, serving)
        if time.monotonic() >= self._forget_at:
            self._forget_at = time.monotonic() + FORGET_INTERVAL_S
            self.forget_lapsed_routers(now)

    def _register(self, now: float, serving: bool) -> None:
        """On a cluster, write what the beat said into the fleet's registry too (another slot:
        producers check a model there before they enqueue, and find its lane): the lane, and
        while ``serving`` the model's served expiry. Best effort: the registry is advisory, and
        the next beat writes it again (a lapse only delays a new model's first submit)."""
        if self.fleet_client is None or time.monotonic() < self._register_after:
            return
        fleet = self.keys.fleet
        try:
            pipe = self.fleet_client.pipeline(transaction=True)
            pipe.sadd(fleet.lanes, self.model_name)
            if serving:
                pipe.zadd(fleet.served, {self.model_name: now + self.ttl_ms / 1000}, gt=True)
                pipe.zremrangebyscore(fleet.served, "-inf", now - LAPSED_KEEP_S)
            pipe.execute()
        except redis.RedisError as exc:
            self._register_after = time.monotonic() + REGISTRY_BACKOFF_S  # (the engine waits
            # on each try: a slot that does not answer is not asked again for a while)
            if self._registered is not False:  # (once per lapse)
                log.warning(
                    "worker %s: the fleet registry missed a beat: %s", self.worker_name, exc
                )
            self._registered = False
            return
        self._registered = True

    def _route_beat(self, pipe: Any, now: float, serving: bool, running: int) -> None:
        """Queue the routing part of a beat (module doc) into ``pipe``."""
        assert self.prefixes is not None
        key = self.keys.prefixes(self.worker_name)
        if self._beats % RESYNC_BEATS == 0:
            self.prefixes.changes()  # superseded by the whole set
            pipe.delete(key)
            held = self.prefixes.snapshot()
            if held:
                pipe.sadd(key, *held)
        else:
            added, removed = self.prefixes.changes()
            if added:
                pipe.sadd(key, *added)
            if removed:
                pipe.srem(key, *removed)
        self._beats += 1
        pipe.pexpire(key, self.ttl_ms)
        routers = self.keys.routers(self.model_name)
        if serving:
            pipe.zadd(routers, {self.worker_name: now + self.ttl_ms / 1000})
            step_ms = math.ceil(self._longest_step_s * 1000)
            load = f"{running} {self.max_num_seqs} {step_ms} {self.levels}".rstrip()
            pipe.hset(self.keys.route_load(self.model_name), self.worker_name, load)
        self._longest_step_s = 0.0

    def forget_lapsed_routers(self, now: float) -> list[str]:
        """Forget up to ``FORGET_BATCH`` routed workers of this model that lapsed
        ``LAPSED_KEEP_S`` before ``now`` and whose routed streams are empty (module doc); one
        round trip, two when there are any. Returns the names forgotten."""
        model = self.model_name
        routers = self.keys.routers(model)
        cutoff = now - LAPSED_KEEP_S
        members: Any = self.client.zrangebyscore(
            routers, "-inf", cutoff, start=self._forget_offset, num=FORGET_BATCH
        )
        names = [as_str(m) or "" for m in members]
        if not names:
            self._forget_offset = 0
            return []
        keys = [routers, self.keys.route_load(model)]
        for name in names:
            keys += [self.keys.routed(model, p, name) for p in PRIORITIES]
        args: list[str | int] = [repr(cutoff), CONSUMER_GROUP, len(PRIORITIES), *names]
        forgotten = [
            as_str(n) or "" for n in registry.call(self.client, FORGET_ROUTERS, keys, args)[1:]
        ]
        kept = len(names) - len(forgotten)
        self._forget_offset = self._forget_offset + kept if len(names) == FORGET_BATCH else 0
        return forgotten

    def remove(self) -> None:
        """Delete the heartbeat: this worker's leftover entries become claimable at once. The
        worker's last call: its client of the fleet's slot (a cluster) is closed after it."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.worker(self.worker_name))
        pipe.zrem(self.keys.workers, self.worker_name)
        if self.prefixes is not None:  # no longer a target; stays listed for stealers
            pipe.delete(self.keys.prefixes(self.worker_name))
            pipe.zadd(self.keys.routers(self.model_name), {self.worker_name: time.time()}, xx=True)
        try:
            pipe.execute()
        finally:
            if self.fleet_client is not None:
                self.fleet_client.close()


def worker_stats(
    ws: Any,
    engine: Any,
    *,
    running: int,
    kv_total: int,
    tokens_total: int,
    stopping: bool,
    metrics: Any = None,
) -> dict[str, Any]:
    """The stats a beat carries (``tokenfleet status`` and the console show them): model, the
    engine's device, priorities, running and waiting requests, KV blocks (before the first step
    the engine's free blocks are its total), tokens published and per second (``metrics``' own
    window), whether the worker is stopping, and its last error ("CODE: message", with its
    time) once it met one."""
    cap = engine.capacity()
    used = engine.last_step_stats.num_kv_blocks_used
    device = getattr(getattr(engine, "runner", None), "device", None) or ws.device or ""
    stats: dict[str, Any] = {
        "model": ws.model_name,
        "device": str(device),
        "priorities": ",".join(p.label for p in ws.priorities),
        "running": running,
        "waiting": cap.num_waiting,
        "kv_blocks_used": used,
        "kv_blocks_total": kv_total or used + cap.free_kv_blocks,
        "tokens_total": tokens_total,
        "stopping": int(stopping),
    }
    if metrics is not None:
        stats["tokens_per_s"] = round(metrics.tokens_per_s, 1)
        if metrics.last_error is not None:
            stats["last_error_at"], stats["last_error"] = metrics.last_error
    return stats


TENANTS_IN_BEAT = 32  # tenants a beat names; the rest are summed as "other" (a bounded field)


def tenants_running(tenants: Iterable[str]) -> dict[str, str]:
    """The beat's ``tenants_running`` field ("T=N,..."; docs/fairness.md) for the running
    requests' tenants ("" for one admitted without a tenant queue: the default tenant's); no
    field at all while every running request is the default tenant's (a one-tenant fleet's
    beats stay as they were)."""
    counts = Counter(t or DEFAULT_TENANT for t in tenants)
    if set(counts) <= {DEFAULT_TENANT}:
        return {}
    top = counts.most_common(TENANTS_IN_BEAT)
    rest = sum(counts.values()) - sum(n for _, n in top)
    if rest:
        top.append((TenantLabels.OTHER, rest))
    return {"tenants_running": ",".join(f"{t}={n}" for t, n in top)}
