"""The ``tokenfleet`` command line: one entry point that composes every side's subcommands.

Each command module defines ``register(subparsers) -> None`` that adds its parser and sets
``func`` (a callable taking the parsed namespace and returning an exit code); ``COMMANDS`` lists
those ``register`` functions, imported by name below, in the order ``--help`` shows them. The
commands come from three places: the producer's (``submit``, ``get``, ``follow``, ``cancel``,
``queues``, ``serve``, ``console``, ``keys``), the service's (``worker``, ``models``,
``status``, ``pool``) and the dev tooling's (``demo``, ``make-tiny-model``, ``bench``).

Invariant: importing this module imports no torch or transformers. Command modules import heavy
dependencies inside ``func``, never at import time, so ``tokenfleet submit`` works in the base
install (tests/test_packaging.py and tests/test_cli.py check it).

Why here: this is the one module that may see every side. ``shared`` depends on nothing above it
and ``producer`` on ``shared`` only, so neither can compose the worker's commands; the worker
already stands on the producer (``status`` reads queues through it). ``tokenfleet.worker.cli`` is
also the console script's entry point and what ``python -m`` runs for ``make demo`` and in every
worker process.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import redis

from tokenfleet.producer.commands import (
    batch,
    cancel,
    console,
    follow,
    get,
    keys,
    queues,
    serve,
    submit,
    tenants,
)
from tokenfleet.shared.errors import TokenfleetError
from tokenfleet.worker.commands import models, status, worker
from tokenfleet.worker.devtools.commands import bench, demo, make_tiny_model
from tokenfleet.worker.pool import commands as pool_commands

# Order is the order shown by --help.
COMMANDS: tuple[Callable[[Any], None], ...] = (
    demo.register,
    worker.register,
    models.register,
    submit.register,
    get.register,
    follow.register,
    cancel.register,
    queues.register,
    serve.register,
    console.register,
    batch.register,
    keys.register,
    tenants.register,
    status.register,
    make_tiny_model.register,
    bench.register,
    pool_commands.register,
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="tokenfleet",
        description="A Redis-backed fleet of LLM inference workers. "
        "Every command takes --redis-url (default: $REDIS_URL, else redis://localhost:6379/0) "
        "and --redis-mode, --sentinels, --sentinel-service (docs/redis-modes.md).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
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
    except (redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError) as exc:
        # a Redis user without this command's rights (docs/security.md, "Redis ACL roles")
        print(f"tokenfleet {args.command}: Redis refused: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
