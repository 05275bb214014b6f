"""``tokenfleet submit "prompt"``: submit one request and print its text (or JSON)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from tokenfleet.producer.client import Client
from tokenfleet.shared.errors import RequestFailed
from tokenfleet.shared.priority import PRIORITIES
from tokenfleet.shared.schema import TokenEvent
from tokenfleet.shared.settings import Settings


def register(subparsers: Any) -> None:
    """Add the ``submit`` parser."""
    p = subparsers.add_parser(
        "submit",
        help="submit a prompt and print the generated text",
        description="Submit one generation request and print its text as it streams "
        "(--stream) or when it is done; --json prints JSON instead.",
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--priority", choices=[x.label for x in PRIORITIES], default="normal")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--model", default=None, help="served model name (default: 'default')")
    p.add_argument("--request-id", default=None, help="idempotent id (default: generated)")
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="must have started within SECONDS, else it ends 'expired'",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up waiting for the result after SECONDS",
    )
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON: the result, or with --stream one event per line",
    )
    p.add_argument("--detach", action="store_true", help="print the request id and exit")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL")
    p.set_defaults(func=run)


def _print_json(data: Any) -> None:
    sys.stdout.write(orjson.dumps(data).decode() + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """Submit, then stream or wait; exit 1 if the request did not end ``done``."""
    settings = Settings.from_env().with_url(args.redis_url)
    with Client.from_url(settings=settings) as client:
        handle = client.submit(
            args.prompt,
            priority=args.priority,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            model=args.model,
            request_id=args.request_id,
            deadline_s=args.deadline,
            timeout=args.timeout,
        )
        with handle:
            if args.detach:
                print(handle.request_id)
                return 0
            try:
                if args.stream:
                    for event in handle.stream(timeout=args.timeout):
                        if args.json:
                            _print_json(event.to_dict())
                        elif isinstance(event, TokenEvent):
                            sys.stdout.write(event.text)
                            sys.stdout.flush()
                    if not args.json:
                        sys.stdout.write("\n")
                result = handle.result(timeout=args.timeout)
            except RequestFailed as exc:
                if not args.json:
                    raise
                if not args.stream:
                    _print_json(
                        {
                            "request_id": exc.request_id,
                            "status": exc.status,
                            "code": exc.code,
                            "message": exc.message,
                        }
                    )
                return 1
            if args.json and not args.stream:
                _print_json(result.to_dict())
            elif not args.stream:
                print(result.text)
    return 0
