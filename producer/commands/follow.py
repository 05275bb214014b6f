"""``tokenfleet follow ID``: print a request's tokens from where they are as they arrive.

It reads the durable token list from ``--from`` (default 0: the text so far) and then follows the
request's channel through a ``Handle`` of its own, which re-reads the record and token list
after a reconnect and goes on from the index it has: no token is printed twice or skipped.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tokenfleet.producer.client import Client
from tokenfleet.producer.commands import output
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags


def register(subparsers: Any) -> None:
    """Add the ``follow`` parser."""
    p = subparsers.add_parser(
        "follow",
        help="stream a request's tokens (the text so far, then live)",
        description="Print a request's text from token --from on as it is generated, whichever "
        "process submitted it; rides out reconnects. Exit status: 0 done, 1 ended otherwise "
        "(or unknown id), 3 --timeout passed first (its state is printed).",
    )
    p.add_argument("request_id", metavar="ID", help="the request id (submit --detach prints it)")
    p.add_argument(
        "--from",
        dest="from_index",
        type=int,
        default=0,
        metavar="INDEX",
        help="first token index to print (default 0: from the start)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON event per line")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop following after SECONDS: print the request's state and exit 3",
    )
    p.add_argument(
        "--cancel-on-timeout",
        action="store_true",
        help="with --timeout: cancel the request when the timeout passes",
    )
    add_redis_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check that the request exists, then stream it (see ``output`` for exit statuses)."""
    settings = settings_from_flags(args)
    until = None if args.timeout is None else time.monotonic() + args.timeout
    with Client.from_url(settings=settings) as client:
        client.status(args.request_id)  # UnknownRequest (exit 1) rather than a wait
        with client.handle(args.request_id) as handle:
            try:
                events = output.events_until(handle, args.from_index, until)
                terminal = output.print_events(events, as_json=args.json)
            except TimeoutError:
                return output.report_timeout(
                    client,
                    handle,
                    args.timeout,
                    cancel=args.cancel_on_timeout,
                    as_json=args.json,
                )
    return output.exit_status(terminal)
