"""``tokenfleet cancel ID``: cancel a request (a queued one ends now, a running one at its
worker's next step), as ``Client.cancel`` does."""

from __future__ import annotations

import argparse
from typing import Any

from tokenfleet.producer.client import Client
from tokenfleet.producer.commands import output
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags


def register(subparsers: Any) -> None:
    """Add the ``cancel`` parser."""
    p = subparsers.add_parser(
        "cancel",
        help="cancel a request",
        description="Cancel a request: a queued one ends 'cancelled' at once, a running one is "
        "stopped by its worker at its next step. Exit status: 0 cancelled or asked for, 1 it "
        "had already ended (or there is no such request).",
    )
    p.add_argument("request_id", metavar="ID", help="the request id (submit --detach prints it)")
    p.add_argument("--json", action="store_true", help="print the record after it as JSON")
    add_redis_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Cancel, then say what became of the request."""
    settings = settings_from_flags(args)
    with Client.from_url(settings=settings) as client:
        cancelled = client.cancel(args.request_id)
        record = client.status(args.request_id)
    if args.json:
        output.print_json({**record.to_dict(), "cancelled": cancelled})
    elif not cancelled:
        print(f"request {record.request_id} had already ended: {record.status.value}")
    elif record.status.is_terminal:
        print(f"request {record.request_id} {record.status.value}")
    else:
        print(
            f"request {record.request_id} is {record.status.value}: cancel asked for; its "
            "worker stops it at its next step"
        )
    return output.EXIT_DONE if cancelled else output.EXIT_FAILED
