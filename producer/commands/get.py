"""``tokenfleet get ID``: a request's state from its durable record, and its text once it ended.

Reads the record only (one ``HGETALL``; a queued request past its deadline is finished
``expired`` first, as ``Client.status`` does); it never waits. ``--json`` prints the whole record.
"""

from __future__ import annotations

import argparse
from typing import Any

from tokenfleet.producer.client import Client
from tokenfleet.producer.commands import output
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags


def register(subparsers: Any) -> None:
    """Add the ``get`` parser."""
    p = subparsers.add_parser(
        "get",
        help="show a request's status and, once it ended, its text",
        description="Show a request's state from its durable record: status, model, tokens so "
        "far, worker, error; then its text once it has ended (follow a running one with "
        "'tokenfleet follow ID'). Exits 1 if there is no such request.",
    )
    p.add_argument("request_id", metavar="ID", help="the request id (submit --detach prints it)")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    add_redis_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the record (``UnknownRequest``, so exit 1, when there is none)."""
    settings = settings_from_flags(args)
    with Client.from_url(settings=settings) as client:
        record = client.status(args.request_id)
    if args.json:
        output.print_json(record.to_dict())
        return output.EXIT_DONE
    for line in output.describe(record):
        print(line)
    if record.status.is_terminal and record.text is not None:
        print()
        output.show_text(record.text, record.usage, record.finish_reason)
    return output.EXIT_DONE
