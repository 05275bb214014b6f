"""``tokenfleet serve``: the OpenAI-compatible HTTP gateway on uvicorn.

Flags override ``TOKENFLEET_GATEWAY_*`` (docs/gateway.md). ``--processes N`` runs N
uvicorn worker processes on one port; as stateless as the gateway is, any number of ``serve``
processes on any number of machines may also stand behind a load balancer.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from tokenfleet.shared.redis_flags import add_redis_flags, redis_env, settings_from_flags


def register(subparsers: Any) -> None:
    """Add the ``serve`` parser."""
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP gateway",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models and "
        "/v1/requests/{id}[/events|/cancel] over the fleet's Redis (docs at /docs).",
    )
    p.add_argument("--host", default=None, help="default: $TOKENFLEET_GATEWAY_HOST or 127.0.0.1")
    p.add_argument(
        "--port", type=int, default=None, help="default: $TOKENFLEET_GATEWAY_PORT or 8000"
    )
    p.add_argument(
        "--auth",
        choices=["off", "required"],
        default=None,
        help="require API keys (tokenfleet keys create); default: off",
    )
    p.add_argument(
        "--on-disconnect",
        choices=["cancel", "continue"],
        default=None,
        help="what a client's disconnect does to its request (default: cancel)",
    )
    p.add_argument(
        "--keepalive-s",
        type=float,
        default=None,
        help="seconds between SSE keep-alive comments (default: 15; proxies often cut a "
        "connection idle for 60 s)",
    )
    p.add_argument("--processes", type=int, default=1, help="uvicorn worker processes")
    p.add_argument("--log-level", default="info", help="uvicorn's log level")
    add_redis_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate the settings, then hand the app to uvicorn (returns when it stops)."""
    import uvicorn  # here: the base install has no uvicorn, and other commands need none

    from tokenfleet.producer.gateway.app import create_app
    from tokenfleet.producer.gateway.settings import GatewaySettings

    settings = settings_from_flags(args)
    flags = {"host": args.host, "port": args.port, "auth": args.auth}
    flags["on_disconnect"] = args.on_disconnect
    flags["keepalive_s"] = args.keepalive_s
    gateway = GatewaySettings.from_env(**flags)
    if args.processes > 1:  # each process builds its own app: pass the settings by environment
        os.environ.update(redis_env(settings))
        for name, value in flags.items():
            if value is not None:
                os.environ[f"TOKENFLEET_GATEWAY_{name.upper()}"] = str(value)
        uvicorn.run(
            "tokenfleet.producer.gateway.app:app_from_env",
            factory=True,
            host=gateway.host,
            port=gateway.port,
            workers=args.processes,
            log_level=args.log_level,
        )
        return 0
    uvicorn.run(
        create_app(settings, gateway),
        host=gateway.host,
        port=gateway.port,
        log_level=args.log_level,
    )
    return 0
