"""``tokenfleet submit``: submit one request and print its text (or JSON).

The request is a plain prompt (``submit "Once upon a time"``), one user turn through the model's
chat template (``submit --chat "What is Redis?"``, with ``--system TEXT`` for a system turn), or a
whole conversation (``--messages FILE``, ``-`` for stdin: a JSON array of ``{"role", "content"}``)
or token ids (``--token-ids 1,2,3``). Every wire option has a flag; exit statuses are in
``output``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from tokenfleet.producer.client import Client
from tokenfleet.producer.commands import output
from tokenfleet.shared.errors import InvalidRequest, RequestFailed
from tokenfleet.shared.priority import PRIORITIES
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags


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
    p.add_argument(
        "--token-ids",
        default=None,
        metavar="IDS",
        help="the prompt as comma-separated token ids (instead of PROMPT)",
    )
    p.add_argument("--priority", choices=[x.label for x in PRIORITIES], default="normal")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end the text before TEXT (repeatable)",
    )
    p.add_argument(
        "--stop-token-id",
        action="append",
        type=int,
        default=[],
        metavar="ID",
        help="end after this token id (repeatable)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="go on past the model's EOS")
    p.add_argument("--metadata", default=None, metavar="JSON", help="a small JSON object")
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
        help="stop waiting after SECONDS (a 'block' queue's wait included): print the "
        "request's state and exit 3; the request goes on",
    )
    p.add_argument(
        "--cancel-on-timeout",
        action="store_true",
        help="with --timeout: cancel the request when the timeout passes",
    )
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON: the result, or with --stream one event per line",
    )
    p.add_argument(
        "--detach",
        action="store_true",
        help="print the request id and exit (then: tokenfleet get/follow/cancel ID)",
    )
    add_redis_flags(p)
    p.set_defaults(func=run)


def _input(args: argparse.Namespace) -> dict[str, Any]:
    """``prompt=`` or ``messages=`` for ``submit`` from the flags; ``InvalidRequest`` if they
    contradict each other or a messages file cannot be read."""
    if args.token_ids is not None:
        if args.prompt is not None or args.chat or args.messages is not None:
            raise InvalidRequest("--token-ids is the whole prompt: give no PROMPT or --messages")
        try:
            return {"prompt": [int(t) for t in args.token_ids.split(",")]}
        except ValueError:
            raise InvalidRequest(
                f"--token-ids must be comma-separated integers, got {args.token_ids!r}"
            ) from None
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
        raise InvalidRequest("give a PROMPT (or --messages FILE, or --token-ids IDS)")
    if args.chat:
        turns = [{"role": "system", "content": args.system}] if args.system is not None else []
        return {"messages": [*turns, {"role": "user", "content": args.prompt}]}
    if args.system is not None:
        raise InvalidRequest("--system needs --chat")
    return {"prompt": args.prompt}


def _params(args: argparse.Namespace) -> dict[str, Any]:
    """Every wire option ``submit`` was given, as ``Client.submit`` keywords."""
    params: dict[str, Any] = {
        "priority": args.priority,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_id,
        "ignore_eos": args.ignore_eos,
        "model": args.model,
        "request_id": args.request_id,
        "deadline_s": args.deadline,
    }
    if args.metadata is not None:
        try:
            params["metadata"] = orjson.loads(args.metadata)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"--metadata is not JSON: {exc}") from None
    return params


def run(args: argparse.Namespace) -> int:
    """Submit, then stream or wait; exit status: see ``output`` (0 done, 1 not done, 3 timed
    out)."""
    if args.cancel_on_timeout and args.timeout is None:
        raise InvalidRequest("--cancel-on-timeout needs --timeout")
    settings = settings_from_flags(args)
    request = {**_input(args), **_params(args)}
    until = None if args.timeout is None else time.monotonic() + args.timeout
    with Client.from_url(settings=settings) as client:
        handle = client.submit(**request, timeout=args.timeout)
        with handle:
            if args.detach:
                print(handle.request_id)
                return output.EXIT_DONE
            try:
                if args.stream:
                    terminal = output.print_events(
                        output.events_until(handle, 0, until), as_json=args.json
                    )
                    return output.exit_status(terminal)
                remaining = None if until is None else max(0.0, until - time.monotonic())
                result = handle.result(timeout=remaining)
            except TimeoutError:
                return output.report_timeout(
                    client,
                    handle,
                    args.timeout,
                    cancel=args.cancel_on_timeout,
                    as_json=args.json,
                )
            except RequestFailed as exc:
                if not args.json:
                    raise
                output.print_json(
                    {
                        "request_id": exc.request_id,
                        "status": exc.status,
                        "code": exc.code,
                        "message": exc.message,
                    }
                )
                return output.EXIT_FAILED
            if args.json:
                output.print_json(result.to_dict())
            else:
                output.show_text(result.text, result.usage, result.finish_reason)
    return output.EXIT_DONE
