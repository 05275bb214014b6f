"""``tokenfleet submit``: submit one request and print its text (or JSON).

The request is a plain prompt (``submit "Once upon a time"``), one user turn through the model's
chat template (``submit --chat "What is Redis?"``, with ``--system TEXT`` for a system turn), or a
whole conversation (``--messages FILE``, ``-`` for stdin: a JSON array of ``{"role", "content"}``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from tokenfleet.producer.client import Client
from tokenfleet.shared.errors import InvalidRequest, RequestFailed
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
    p.add_argument("prompt", nargs="?", help="the prompt text (with --chat: the user's turn)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user turn through the model's chat template",
    )
    p.add_argument("--system", default=None, help="with --chat: a system turn before it")
    p.add_argument(
        "--messages",
        default=None,
        metavar="FILE",
        help="a JSON array of {role, content} chat turns from FILE ('-': stdin)",
    )
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


def _input(args: argparse.Namespace) -> dict[str, Any]:
    """``prompt=`` or ``messages=`` for ``submit`` from the flags; ``InvalidRequest`` if they
    contradict each other or a messages file cannot be read."""
    if args.messages is not None:
        if args.prompt is not None or args.chat or args.system is not None:
            raise InvalidRequest("--messages takes the whole conversation: give no PROMPT")
        try:
            raw = sys.stdin.read() if args.messages == "-" else Path(args.messages).read_text()
            messages = orjson.loads(raw)
        except (OSError, orjson.JSONDecodeError) as exc:
            raise InvalidRequest(f"--messages {args.messages}: {exc}") from None
        return {"messages": messages}
    if args.prompt is None:
        raise InvalidRequest("give a PROMPT (or --messages FILE)")
    if args.chat:
        turns = [{"role": "system", "content": args.system}] if args.system is not None else []
        return {"messages": [*turns, {"role": "user", "content": args.prompt}]}
    if args.system is not None:
        raise InvalidRequest("--system needs --chat")
    return {"prompt": args.prompt}


def _show_text(text: str, usage: dict[str, int], finish_reason: str | None) -> None:
    """The result's text, or a note on stderr when the model generated nothing at all (an empty
    line would look like a fault)."""
    if usage.get("completion_tokens", len(text)) == 0 and not text:
        print(f"(no tokens generated: finish_reason {finish_reason})", file=sys.stderr)
    else:
        print(text)


def run(args: argparse.Namespace) -> int:
    """Submit, then stream or wait; exit 1 if the request did not end ``done``."""
    settings = Settings.from_env().with_url(args.redis_url)
    request = _input(args)
    with Client.from_url(settings=settings) as client:
        handle = client.submit(
            **request,
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
                _show_text(result.text, result.usage, result.finish_reason)
    return 0
