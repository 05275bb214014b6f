"""``tokenfleet pool``: create a shared KV pool, or show pools with their members.

``tokenfleet pool create NAME --blocks N [--block-size 16] [--cap-permille 900] [--chunk C]``
``tokenfleet pool show [NAME] [--json]``

``tokenfleet status`` shows each pool through :func:`~tokenfleet.worker.pool.admin.pool_snapshot`
and :func:`format_pool`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from tokenfleet.shared.errors import PoolError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import PRIORITIES
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags
from tokenfleet.worker.pool.admin import create_pool, pool_names, pool_snapshot
from tokenfleet.worker.pool.config import DEFAULT_ROUND_MS, PoolConfig

__all__ = ["format_pool", "register"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "pool",
        help="create or show shared KV pools",
        description="Shared KV pools: workers on one GPU (or sharing a fleet-wide allowance) "
        "split a pool of KV blocks by weight. Workers join with --kv-pool NAME.",
    )
    sub = p.add_subparsers(dest="pool_command", metavar="ACTION", required=True)

    c = sub.add_parser("create", help="create a pool (a no-op if it exists with the same size)")
    c.add_argument("name", help="pool name")
    c.add_argument("--blocks", type=int, required=True, help="total KV blocks in the pool")
    c.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    c.add_argument(
        "--cap-permille",
        type=int,
        default=900,
        help="largest share of the total one member may hold, in thousandths (900)",
    )
    c.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="blocks members ask for at a time (default: total/64, at least 1)",
    )
    c.add_argument(
        "--lease-ms",
        type=int,
        default=5000,
        help="a member's blocks return to the pool this long after its last call",
    )
    c.add_argument(
        "--preempt-ms",
        type=int,
        default=2000,
        help="a preemption order lapses if the donor has not released by then",
    )
    c.add_argument(
        "--token-budget",
        type=int,
        default=0,
        help="tokens the shared device computes per round, split between co-located members "
        "by weight (compute share; 0: off)",
    )
    c.add_argument(
        "--round-ms",
        type=int,
        default=DEFAULT_ROUND_MS,
        help="the compute share's round: each member computes at most its share of "
        "--token-budget per this many milliseconds",
    )
    add_redis_flags(c)
    c.set_defaults(func=create_func)

    s = sub.add_parser("show", help="show pools: members, weights, held, entitlement, ...")
    s.add_argument("name", nargs="?", help="pool name (default: every pool)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_redis_flags(s)
    s.set_defaults(func=show_func)


def _connect(args: argparse.Namespace) -> tuple[Any, Keys]:
    from tokenfleet.shared.redis_connect import redis_client

    settings = settings_from_flags(args)
    return redis_client(settings), Keys.for_settings(settings)


def create_func(args: argparse.Namespace) -> int:
    chunk = args.chunk if args.chunk is not None else max(1, args.blocks // 64)
    config = PoolConfig(
        total_blocks=args.blocks,
        block_size=args.block_size,
        cap_permille=args.cap_permille,
        chunk_blocks=chunk,
        lease_ms=args.lease_ms,
        preempt_ms=args.preempt_ms,
        token_budget=args.token_budget,
        round_ms=args.round_ms,
    )
    client, keys = _connect(args)
    try:
        created = create_pool(client, keys, args.name, config)
    finally:
        client.close()
    verb = "created" if created else "exists:"
    print(f"pool {args.name} {verb} {config.total_blocks} blocks of {config.block_size} tokens")
    return 0


def show_func(args: argparse.Namespace) -> int:
    client, keys = _connect(args)
    try:
        names = [args.name] if args.name else pool_names(client, keys)
        views = []
        for name in names:
            try:
                views.append(pool_snapshot(client, keys, name))
            except PoolError:
                if args.name:
                    raise
                # listed in the set of pools but deleted since: skip it
    finally:
        client.close()
    if args.json:
        sys.stdout.write(orjson.dumps(views, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    if not views:
        print("no pools")
    for view in views:
        print(format_pool(view))
    return 0


def format_pool(view: dict[str, Any]) -> str:
    """A pool snapshot as a few lines of text (shared with ``tokenfleet status``)."""
    budget = ""
    if view["token_budget"]:
        budget = f", {view['token_budget']} tokens per {view['round_ms']} ms round"
    lines = [
        f"pool {view['name']}: {view['held']}/{view['total']} blocks held "
        f"({view['block_size']} tokens each), cap {view['cap']}, chunk {view['chunk']}, "
        f"{view['active_members']} active{budget}"
    ]
    header: tuple[str, ...] = (
        "member",
        "weight",
        "held",
        "entitled",
        "active",
        "loan",
        "used c/n/b",
        "lease ms",
    )
    if view["token_budget"]:
        header += ("tokens want/share",)
    rows = [header]
    for m in view["members"]:
        use = list(m["blocks_by_priority"]) + [0] * (len(PRIORITIES) - len(m["blocks_by_priority"]))
        rows.append(
            (
                m["name"],
                f"{m['weight']:g}",
                str(m["held"]),
                str(m["entitlement"]),
                "yes" if m["active"] else "no",
                str(m["loan"]),
                "/".join(str(u) for u in use),
                str(m["lease_left_ms"]),
            )
            + ((f"{m['token_demand']}/{m['token_budget']}",) if view["token_budget"] else ())
        )
    if len(rows) == 1:
        lines.append("  (no members)")
    else:
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            cells = (cell.ljust(w) for cell, w in zip(row, widths, strict=True))
            lines.append(("  " + "  ".join(cells)).rstrip())
    for o in view["preemptions"]:
        state = "delivered" if o["delivered"] else "pending"
        label = PRIORITIES[o["priority"]].label if 0 <= o["priority"] < len(PRIORITIES) else "?"
        lines.append(
            f"  preemption #{o['id']}: {o['donor']} frees {o['blocks']} blocks for "
            f"{o['requester']} ({label}), {state}, {o['age_ms']} ms old"
        )
    return "\n".join(lines)
