"""``tokenfleet queues``: show each queue's depth, bound and policy; set bound and policy."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from tokenfleet.producer.client import Client
from tokenfleet.shared.priority import PRIORITIES
from tokenfleet.shared.queue_config import DEFAULT_QUEUE_CONFIG, OverflowPolicy
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags


def register(subparsers: Any) -> None:
    """Add the ``queues`` parser."""
    p = subparsers.add_parser(
        "queues",
        help="show queue depths, bounds and policies; set them",
        description="Without --max-waiting/--policy: list every queue. With them: store the "
        "bound and/or overflow policy of the chosen queues (all three priorities of --model "
        "unless --priority is given), then list.",
    )
    p.add_argument("--model", default=None, help="served model name (default: 'default')")
    p.add_argument(
        "--priority",
        action="append",
        choices=[x.label for x in PRIORITIES],
        help="queue(s) to set (repeatable; default: all three)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="bound on waiting requests (running ones do not count)",
    )
    p.add_argument(
        "--policy",
        choices=[x.value for x in OverflowPolicy],
        default=None,
        help="what a full queue does with one more request",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    add_redis_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Apply the settings given, then print the table (or JSON)."""
    settings = settings_from_flags(args)
    with Client.from_url(settings=settings) as client:
        if args.max_waiting is not None or args.policy is not None:
            for label in args.priority or [x.label for x in PRIORITIES]:
                client.set_queue_config(
                    label, args.model, max_waiting=args.max_waiting, policy=args.policy
                )
        rows = client.queue_stats()
    if args.json:
        sys.stdout.write(orjson.dumps([r.to_dict() for r in rows]).decode() + "\n")
        return 0
    if not rows:
        print(
            f"no queues yet (a new queue holds up to {DEFAULT_QUEUE_CONFIG.max_waiting} waiting "
            f"requests, policy {DEFAULT_QUEUE_CONFIG.policy.value})"
        )
        return 0
    header = ("MODEL", "PRIORITY", "WAITING", "RUNNING", "MAX_WAITING", "POLICY")
    table = [header] + [
        (
            r.model,
            r.priority,
            str(r.waiting),
            str(r.running),
            str(r.max_waiting),
            r.policy.value + ("" if r.configured else " (default)"),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0
