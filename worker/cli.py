"""The ``tokenfleet`` command line: one entry point, one module per subcommand.

Each module in ``COMMAND_MODULES`` defines ``register(subparsers) -> None`` that adds its parser
and sets ``func`` (a callable taking the parsed namespace and returning an exit code). Command
modules import heavy dependencies (torch, transformers) inside ``func``, never at import time, so
``tokenfleet submit`` works in the base install.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tokenfleet.shared.errors import TokenfleetError

# Order is the order shown by --help.
COMMAND_MODULES: tuple[str, ...] = (
    "tokenfleet.worker.commands.demo",
    "tokenfleet.worker.commands.worker",
    "tokenfleet.producer.commands.submit",
    "tokenfleet.producer.commands.queues",
    "tokenfleet.worker.commands.status",
    "tokenfleet.worker.commands.make_tiny_model",
    "tokenfleet.worker.commands.bench",
    "tokenfleet.worker.pool.commands",
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="tokenfleet",
        description="A Redis-backed fleet of LLM inference workers. "
        "Every command takes --redis-url (default: $REDIS_URL, else redis://localhost:6379/0).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module, not a missing command
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TokenfleetError as exc:
        print(f"tokenfleet {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
