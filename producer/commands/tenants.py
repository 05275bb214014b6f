"""``tokenfleet tenants``: set a tenant's weight and own bound; list tenants and their figures
(docs/fairness.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from tokenfleet.producer import tenants
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags


def register(subparsers: Any) -> None:
    """Add the ``tenants`` parser with its ``set`` and ``list`` subcommands."""
    p = subparsers.add_parser(
        "tenants",
        help="fair shares between tenants: set weights and bounds, list figures",
        description="Requests are admitted fairly between tenants: the backlogged tenant with "
        "the least tokens served / weight goes next (docs/fairness.md).",
    )
    sub = p.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)
    s = sub.add_parser("set", help="store a tenant's weight and/or own bound")
    s.add_argument("name", help="tenant name (1-64 of letters, digits, '.', '_', '-')")
    s.add_argument("--weight", type=float, default=None, help="share weight (default 1)")
    s.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="the tenant's own bound on requests waiting in each queue (beyond: refused)",
    )
    s.add_argument("--no-max-waiting", action="store_true", help="remove the tenant's own bound")
    add_redis_flags(s)
    s.set_defaults(func=run_set)
    ls = sub.add_parser("list", help="tenants, weights, waiting, admitted and served tokens")
    ls.add_argument("--json", action="store_true", help="print JSON")
    add_redis_flags(ls)
    ls.set_defaults(func=run_list)


def run_set(args: argparse.Namespace) -> int:
    """Store the settings given and print them."""
    settings = settings_from_flags(args)
    client = redis_client(settings)
    try:
        new = tenants.set_tenant(
            client,
            Keys.for_settings(settings),
            args.name,
            weight=args.weight,
            max_waiting=args.max_waiting,
            clear_bound=args.no_max_waiting,
        )
    finally:
        client.close()
    bound = "none" if new.max_waiting is None else str(new.max_waiting)
    print(f"tenant {args.name}: weight {new.weight:g}, own bound {bound}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    """Print every tenant's settings and, per model, its figures."""
    settings = settings_from_flags(args)
    client = redis_client(settings)
    try:
        stored, rows = tenants.list_tenants(client, Keys.for_settings(settings))
    finally:
        client.close()
    if args.json:
        out = {
            "tenants": {
                k: {"weight": v.weight, "max_waiting": v.max_waiting} for k, v in stored.items()
            },
            "models": [r.to_dict() for r in rows],
        }
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
        return 0
    if not stored and not rows:
        print("no tenants yet (every request is the default tenant's, weight 1)")
        return 0
    header = ("MODEL", "TENANT", "WEIGHT", "MAX_WAITING", "WAITING", "ADMITTED", "SERVED_TOKENS")
    table = [header]
    listed = set()
    for r in rows:
        listed.add(r.tenant)
        table.append(
            (
                r.model,
                r.tenant,
                f"{r.weight:g}",
                "-" if r.max_waiting is None else str(r.max_waiting),
                str(r.waiting),
                str(r.admitted),
                str(r.served_tokens),
            )
        )
    for name, s in sorted(stored.items()):
        if name not in listed:
            bound = "-" if s.max_waiting is None else str(s.max_waiting)
            table.append(("-", name, f"{s.weight:g}", bound, "0", "0", "0"))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0
