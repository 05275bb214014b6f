"""``tokenfleet status``: live workers (heartbeat, running, KV use) and queues at a glance.

Models (docs/models.md): a model with waiting requests and no live worker is named
on a line of its own ("waiting on model X: N requests, no live worker").

A worker is listed when its heartbeat hash exists (it expires when the worker stops beating);
names left in the ``P:workers`` sorted set without a heartbeat are shown as ``lapsed`` until
live workers drop them (an hour after their last beat, ``service.heartbeat.LAPSED_KEEP_S``).
``--json`` prints one JSON object (``Client.fleet_status()``: its module,
``producer.core.fleet_status``, lists the fields); ``--watch SECONDS`` redraws until
interrupted. Each queue in it carries its stream's name, consumer group, ``lag`` and ``pending``
from ``XINFO GROUPS``: the figure KEDA's redis-streams scaler reads (deploy/k8s).
Routing (docs/routing.md): each model with a queue or a live worker gets a line with its workers
and its waiting requests, shared and routed (``routed_status``); ``--json`` has the routed
streams under ``routed`` and each model's live workers under ``models``.

Redis outages (docs/redis-modes.md, "Redis outages"): a worker cut off from Redis cannot write its
heartbeat, so it shows as silent (its last beat ages: "waiting for Redis?") and then lapses; once it
is back it beats with ``redis_state`` = ``recovering`` until it has restored its state, and every
beat counts its outages and the seconds it waited.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags

SILENT_AFTER_S = 3.0  # a heartbeat older than this (beats come every second) is silent


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="show workers and queues",
        description="Show live workers (heartbeat age, running and "
        "waiting requests, KV use) and every queue's length.",
    )
    add_redis_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--watch",
        type=float,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS until interrupted",
    )
    p.set_defaults(func=func)


def snapshot(client: Any, settings: Any) -> dict[str, Any]:
    """Workers, queues, routed streams, models, dead letters and pools as plain data: the one
    reading ``Client.fleet_status()`` makes (``producer.core.fleet_status``), which the console
    shows too."""
    from tokenfleet.producer import Client

    producer = Client(client, settings=settings)
    try:
        return producer.fleet_status()
    finally:
        producer.close()


def render(snap: dict[str, Any]) -> str:
    """The snapshot as two plain-text tables."""
    lines = [f"workers (prefix {snap['prefix']}): {len(snap['workers'])} live"]
    if snap["workers"]:
        lines.append(
            f"  {'name':<28} {'model':<12} {'beat':>6} {'run':>4} {'wait':>4} "
            f"{'KV used':>13} {'tokens':>9}  priorities"
        )
        for w in snap["workers"]:
            kv = f"{w['kv_blocks_used']}/{w['kv_blocks_total']} {w['kv_usage'] * 100:3.0f}%"
            flag = " (stopping)" if w["stopping"] else ""
            flag += _redis_flag(w)
            lines.append(
                f"  {w['name'][:28]:<28} {w['model'][:12]:<12} {w['beat_age_s']:>5.1f}s "
                f"{w['running']:>4} {w['waiting']:>4} {kv:>13} {w['tokens_total']:>9}  "
                f"{w['priorities']}{flag}"
            )
    if snap["lapsed_workers"]:
        lines.append(f"  lapsed (no heartbeat): {', '.join(snap['lapsed_workers'])}")
    for w in snap.get("waiting_on_models", []):  # (absent in a snapshot of an older version)
        lines.append(
            f"waiting on model {w['model']}: {w['waiting']} requests, no live worker"
            + (" (declared)" if w["declared"] else "")
        )
    lines.append(f"queues: {len(snap['queues'])}   dead letters: {snap['dead_letters']}")
    if snap["queues"]:
        lines.append(
            f"  {'model':<16} {'priority':<9} {'waiting':>8} {'running':>8} {'bound':>8}  policy"
        )
        for q in snap["queues"]:
            lines.append(
                f"  {q['model'][:16]:<16} {q['priority']:<9} {q['waiting']:>8} "
                f"{q['running']:>8} {q['max_waiting']:>8}  {q['policy']}"
            )
    tenants = snap.get("tenants", [])  # (absent in a snapshot of an older version)
    if tenants:
        lines.append(f"tenants: {len({t['tenant'] for t in tenants})} (docs/fairness.md)")
        lines.append(
            f"  {'model':<16} {'tenant':<20} {'weight':>6} {'waiting':>8} {'running':>8} "
            f"{'served tokens':>14}"
        )
        for t in tenants:
            lines.append(
                f"  {t['model'][:16]:<16} {t['tenant'][:20]:<20} {t['weight']:>6g} "
                f"{t['waiting']:>8} {t['running']:>8} {t['served_tokens']:>14}"
            )
    from tokenfleet.worker.commands.routed_status import model_lines

    lines.extend(model_lines(snap))
    if snap["pools"]:
        from tokenfleet.worker.pool.commands import format_pool

        lines.append(f"KV pools: {len(snap['pools'])}")
        lines.extend(format_pool(view) for view in snap["pools"])
    return "\n".join(lines)


def _redis_flag(w: dict[str, Any]) -> str:
    """What the worker says about Redis: recovering, silent, outages ridden out."""
    if w.get("redis_state") == "recovering":
        return " (recovering from a Redis outage)"
    if w["beat_age_s"] > SILENT_AFTER_S:
        return f" (silent {w['beat_age_s']:.0f}s: waiting for Redis?)"
    if w.get("redis_outages"):
        return f" ({w['redis_outages']} Redis outages, {w['redis_outage_s']:.0f}s)"
    return ""


def func(args: argparse.Namespace) -> int:
    import orjson

    from tokenfleet.shared.redis_connect import redis_client

    settings = settings_from_flags(args)
    client = redis_client(settings)
    try:
        while True:
            snap = snapshot(client, settings)
            if args.json:
                print(orjson.dumps(snap).decode(), flush=True)
            else:
                print(render(snap), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
            print()
    finally:
        client.close()
