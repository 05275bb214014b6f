"""The fleet at a glance, as one plan: what ``tokenfleet status --json`` prints
(``Client.fleet_status()``) and what the console shows (``AsyncClient.fleet_status()``), so the
two cannot disagree: one reading, two faces.

The snapshot (a dict of plain data; docs/workers.md shows the table form):

* ``at``: the epoch seconds the snapshot was taken (ages below are at that moment);
* ``workers``: each live worker's heartbeat (``service.heartbeat``): model, device, beat age,
  running and waiting requests, KV blocks, tokens published and tokens/s, its Redis state and
  outages, its last error; ``lapsed_workers``: names left without a heartbeat;
* ``queues``: ``Client.queue_stats()``'s rows, each with its shared stream's ``lag`` and
  ``pending`` as KEDA's redis-streams scaler reads them (``XINFO GROUPS``: ``lag`` is None when
  Redis cannot compute it, e.g. after a drop-oldest eviction), its tenant backlog's name and
  length (``tenant_backlog``, ``tenant_backlog_length``: what KEDA's redis list trigger reads
  and adds to the lag, docs/deployment.md) and its terminal ends
  (``shared.tally``: total and per minute, per status);
* ``routed``: per (model, priority, routed worker), the waiting and running entries of that
  worker's routed stream (docs/routing.md); ``models``: ``Client.models()``;
  ``waiting_on_models``: models with waiting requests and no live worker;
* ``tenants``: per (model, tenant) of the tenant books (docs/fairness.md): weight, own bound,
  waiting in its tenant queues, running (from the heartbeats), admitted, served tokens;
* ``dead_letters``: the dead-letter streams' lengths, summed; ``pools``: each shared KV pool as
  its read-only inspect script sees it (docs/kv_pools.md).

Reads only, each bounded by the fleet's shape (queues, workers, routed workers, pools), never by
how many requests wait: lengths come from ``XLEN`` and ``XINFO``, the oldest waiting entry from
one ``XRANGE ... COUNT 1`` per stream (``queue_stats.lua``); no ``KEYS``, no ``SCAN``. On a
cluster it goes lane by lane (``core.lanes``), every effect inside one lane's slot.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.commands.core import (
    HashCommands,
    ListCommands,
    SetCommands,
    SortedSetCommands,
    StreamCommands,
)

from tokenfleet.producer.core.client_core import ClientCore
from tokenfleet.producer.core.effects import Command, Plan, RunScript, Transaction
from tokenfleet.shared.errors import PoolError
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.pool.scripts import POOL_INSPECT, pool_keys
from tokenfleet.shared.pool.view import pool_view
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.tally import no_ends, queue_ends


def fleet_status(views: ClientCore[Any]) -> Plan[dict[str, Any]]:
    """The snapshot described in the module docstring."""
    now = time.time()
    queues = [q.to_dict() for q in (yield from views._queue_stats())]
    models = [m.to_dict() for m in (yield from views._models())]
    workers: list[dict[str, Any]] = []
    lapsed: list[str] = []
    routed: list[dict[str, Any]] = []
    dead = 0
    tenants: list[dict[str, Any]] = []
    for keys in (yield from views._lane_keys()):
        mine = [q for q in queues if not keys.laned or q["model"] == keys.lane]
        yield from _lane_workers(keys, now, workers, lapsed)
        yield from _lane_queues(keys, mine, now)
        routed += yield from _routed_rows(keys, mine, now)
        dead += yield Command(StreamCommands.xlen, (keys.dead_letter,))
        tenants += yield from lane_tenants(keys, mine)
    running = running_by_tenant(workers)
    for row in tenants:
        row["running"] = running.get((row["model"], row["tenant"]), 0)
    return {
        "prefix": views._keys.prefix,
        "at": now,
        "workers": workers,
        "lapsed_workers": lapsed,
        "queues": queues,
        "routed": routed,
        "models": models,
        "waiting_on_models": waiting_on_models(queues, models),
        "tenants": tenants,
        "dead_letters": dead,
        "pools": (yield from _pools(views._keys.fleet)),
    }


def tenant_stats(views: ClientCore[Any]) -> Plan[list[dict[str, Any]]]:
    """Only the snapshot's ``tenants`` rows (``Client.tenant_stats()``; /v1/models' extension)."""
    now = time.time()
    queues = [q.to_dict() for q in (yield from views._queue_stats())]
    workers: list[dict[str, Any]] = []
    tenants: list[dict[str, Any]] = []
    for keys in (yield from views._lane_keys()):
        mine = [q for q in queues if not keys.laned or q["model"] == keys.lane]
        yield from _lane_workers(keys, now, workers, [])
        tenants += yield from lane_tenants(keys, mine)
    running = running_by_tenant(workers)
    for row in tenants:
        row["running"] = running.get((row["model"], row["tenant"]), 0)
    return tenants


def worker_row(name: str, raw: dict[Any, Any], now: float) -> dict[str, Any]:
    """One worker's heartbeat hash as a status row (fields: ``service.heartbeat``)."""
    h = {as_str(k): as_str(v) for k, v in raw.items()}
    used, total = int(h.get("kv_blocks_used") or 0), int(h.get("kv_blocks_total") or 0)
    return {
        "name": name,
        "model": h.get("model", ""),
        "device": h.get("device") or "",
        "priorities": h.get("priorities", ""),
        "beat_age_s": round(now - float(h.get("beat_at") or now), 2),
        "up_s": round(now - float(h.get("started_at") or now), 1),
        "running": int(h.get("running") or 0),
        "waiting": int(h.get("waiting") or 0),
        "kv_blocks_used": used,
        "kv_blocks_total": total,
        "kv_usage": round(used / total, 3) if total else 0.0,
        "tokens_total": int(h.get("tokens_total") or 0),
        "tokens_per_s": round(float(h.get("tokens_per_s") or 0.0), 1),
        "stopping": h.get("stopping") == "1",
        "redis_state": h.get("redis_state") or "ok",
        "redis_outages": int(h.get("redis_outages") or 0),
        "redis_outage_s": float(h.get("redis_outage_s") or 0.0),
        "last_error": h.get("last_error") or "",
        "last_error_at": float(h.get("last_error_at") or 0) or None,
        "pool": h.get("pool_name") or "",
        "tenants_running": _tenant_counts(h.get("tenants_running") or ""),
    }


def _tenant_counts(text: str) -> dict[str, int]:
    """A heartbeat's ``tenants_running`` ("T=N,T2=M") as a dict (bad pairs skipped)."""
    out: dict[str, int] = {}
    for pair in text.split(","):
        name, _, n = pair.partition("=")
        if name and n.isdigit():
            out[name] = int(n)
    return out


def running_by_tenant(workers: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    """(model, tenant) -> requests running, summed over the live workers' heartbeats."""
    out: dict[tuple[str, str], int] = {}
    for w in workers:
        for tenant, n in w.get("tenants_running", {}).items():
            key = (w["model"], tenant)
            out[key] = out.get(key, 0) + n
    return out


def lane_tenants(keys: Keys, queues: list[dict[str, Any]]) -> Plan[list[dict[str, Any]]]:
    """Per (model, tenant) of one lane: weight, own bound, waiting (in its tenant queues),
    admitted, served tokens and virtual time (docs/fairness.md); "running" is added from the
    heartbeats. Bounded by the tenants in the books: one HGETALL per model, one ZRANGE per
    queue and one XLEN per active tenant's queue."""
    if not queues:  # (a lane listed before its queues were read: a transaction needs a key)
        return []
    models = sorted({q["model"] for q in queues})
    levels = [(q["model"], Priority.parse(q["priority"])) for q in queues]
    reads = yield Transaction(
        tuple(Command(HashCommands.hgetall, (keys.tenant_book(m),)) for m in models)
        + tuple(
            Command(SortedSetCommands.zrange, (keys.tenants_active(m, p), 0, -1)) for m, p in levels
        )
    )
    books = dict(zip(models, reads[: len(models)], strict=True))
    active = [
        (m, p, [as_str(t) or "" for t in ts])
        for (m, p), ts in zip(levels, reads[len(models) :], strict=True)
    ]
    lengths: list[int] = []
    queued = [(m, p, t) for m, p, ts in active for t in ts]
    if queued:
        lengths = yield Transaction(
            tuple(Command(StreamCommands.xlen, (keys.tenant_queue(m, p, t),)) for m, p, t in queued)
        )
    waiting: dict[tuple[str, str], int] = {}
    for (m, _, t), n in zip(queued, lengths, strict=True):
        waiting[(m, t)] = waiting.get((m, t), 0) + int(n)
    rows = []
    for m in models:
        raw = {as_str(k) or "": as_str(v) or "" for k, v in (books[m] or {}).items()}
        names = sorted(
            {k.partition("|")[2] for k in raw if "|" in k} | {t for mm, t in waiting if mm == m}
        )
        for t in names:
            bound = raw.get(f"max|{t}")
            rows.append(
                {
                    "model": m,
                    "tenant": t,
                    "weight": float(raw.get(f"w|{t}") or 1),
                    "max_waiting": int(bound) if bound else None,
                    "waiting": waiting.get((m, t), 0),
                    "admitted": int(raw.get(f"admitted|{t}") or 0),
                    "served_tokens": int(raw.get(f"served|{t}") or 0),
                    "virtual_time": float(raw.get(f"vt|{t}") or 0),
                }
            )
    return rows


def _lane_workers(
    keys: Keys, now: float, workers: list[dict[str, Any]], lapsed: list[str]
) -> Plan[None]:
    """Add the workers of one lane (live ones as rows, lapsed ones by name)."""
    listed = yield Command(SortedSetCommands.zrange, (keys.workers, 0, -1))
    names = [as_str(n) or "" for n in listed]
    if not names:
        return
    beats = yield Transaction(
        tuple(Command(HashCommands.hgetall, (keys.worker(n),)) for n in names)
    )
    for name, raw in zip(names, beats, strict=True):
        if raw:
            workers.append(worker_row(name, raw, now))
        else:
            lapsed.append(name)


def _lane_queues(keys: Keys, queues: list[dict[str, Any]], now: float) -> Plan[None]:
    """Add each queue's lag and pending (``XINFO GROUPS`` of its shared stream), its tenant
    backlog's name and length (``LLEN``; together with the lag: KEDA's figures) and its ends
    (``Keys.tally``) to its row."""
    streams = [keys.stream(q["model"], Priority.parse(q["priority"])) for q in queues]
    backlogs = [keys.tenant_backlog(q["model"], Priority.parse(q["priority"])) for q in queues]
    reads = [Command(StreamCommands.xinfo_groups, (s,)) for s in streams]
    lengths = [Command(ListCommands.llen, (b,)) for b in backlogs]
    replies = yield Transaction(
        (Command(HashCommands.hgetall, (keys.tally,)), *reads, *lengths), raise_on_error=False
    )
    ends = queue_ends(replies[0] if isinstance(replies[0], dict) else {}, now)
    backlog_lengths = replies[1 + len(queues) :]
    rows = zip(queues, streams, replies[1 : 1 + len(queues)], strict=True)
    for (q, stream, groups), backlog, length in zip(rows, backlogs, backlog_lengths, strict=True):
        lag: int | None = 0
        pending = 0
        if not isinstance(groups, redis.ResponseError):  # no such stream yet: nothing queued
            for group in groups:
                info = {as_str(k): v for k, v in group.items()}
                if as_str(info.get("name")) == CONSUMER_GROUP:
                    raw = info.get("lag")
                    lag = None if raw is None else int(raw)
                    pending = int(info.get("pending") or 0)
        q.update(stream=stream, consumer_group=CONSUMER_GROUP, lag=lag, pending=pending)
        q.update(tenant_backlog=backlog, tenant_backlog_length=int(length or 0))
        q["ended"] = ends.get((q["model"], q["priority"])) or no_ends()


def _routed_rows(keys: Keys, queues: list[dict[str, Any]], now: float) -> Plan[list[Any]]:
    """One row per (model, priority, routed worker): ``waiting`` (undelivered) and ``running``
    (pending) entries of that worker's routed stream; ``live``: a routing target now. Every
    worker in the model's routers set counts, live or lapsed: a lapsed worker's routed entries
    still wait there until another worker steals or claims them."""
    models = sorted({q["model"] for q in queues})
    if not models:
        return []
    listed = yield Transaction(
        tuple(
            Command(SortedSetCommands.zrange, (keys.routers(m), 0, -1, False, True)) for m in models
        )
    )
    routers = dict(zip(models, listed, strict=True))
    wanted = [
        (q["model"], Priority.parse(q["priority"]), as_str(name) or "", float(score) > now)
        for q in queues
        for name, score in routers[q["model"]]
    ]
    if not wanted:
        return []
    reads: list[Command] = []
    for model, p, name, _ in wanted:
        stream = keys.routed(model, p, name)
        reads += [
            Command(StreamCommands.xlen, (stream,)),
            Command(StreamCommands.xpending, (stream, CONSUMER_GROUP)),
        ]
    replies = yield Transaction(tuple(reads), raise_on_error=False)
    rows = []
    for i, (model, p, name, live) in enumerate(wanted):
        length, pending = replies[2 * i], replies[2 * i + 1]
        length = length if isinstance(length, int) else 0
        running = int(pending.get("pending", 0)) if isinstance(pending, dict) else 0
        rows.append(
            {
                "model": model,
                "priority": p.label,
                "worker": name,
                "live": live,
                "waiting": length - running,
                "running": running,
            }
        )
    return rows


def waiting_on_models(
    queues: list[dict[str, Any]], models: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Models with waiting requests and no live worker: ``{model, waiting, declared}`` each,
    by name (from the queue stats and ``Client.models()``, both as dicts)."""
    served = {m["name"] for m in models if m["served"]}
    declared = {m["name"] for m in models if m["declared"]}
    waiting: dict[str, int] = {}
    for q in queues:
        if q["waiting"] > 0 and q["model"] not in served:
            waiting[q["model"]] = waiting.get(q["model"], 0) + q["waiting"]
    return [
        {"model": name, "waiting": n, "declared": name in declared}
        for name, n in sorted(waiting.items())
    ]


def _pools(keys: Keys) -> Plan[list[dict[str, Any]]]:
    """Every shared KV pool as its inspect script sees it (members, weights, holdings, caps).

    The accounting rules live once, in the pool's Lua (``tokenfleet.shared.pool``); this reader
    runs its read-only inspect script and the parse of its reply that ``tokenfleet pool show``
    also uses, rather than restating either."""
    names = sorted(as_str(n) or "" for n in (yield Command(SetCommands.smembers, (keys.pools,))))
    views = []
    for name in names:
        try:
            reply = yield RunScript(POOL_INSPECT, pool_keys(keys, name), [])
        except PoolError:  # listed but deleted since
            continue
        views.append(pool_view(name, reply))
    return views
