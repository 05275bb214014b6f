"""``tokenfleet serve``: the OpenAI-compatible HTTP gateway on uvicorn.

The flags are generated from ``GatewaySettings``' declaration and override its
``TOKENFLEET_GATEWAY_*`` variables (docs/configuration.md). ``--processes N`` runs N uvicorn
worker processes on one port; as stateless as the gateway is, any number of ``serve`` processes
on any number of machines may also stand behind a load balancer.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from tokenfleet.producer.gateway.settings import GatewaySettings
from tokenfleet.shared.declared_settings import env_of
from tokenfleet.shared.redis_flags import add_redis_flags, redis_env, settings_from_flags
from tokenfleet.shared.settings_flags import add_flags, flag_values


def register(subparsers: Any) -> None:
    """Add the ``serve`` parser."""
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP gateway",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models and "
        "/v1/requests/{id}[/events|/cancel] over the fleet's Redis (docs at /docs).",
    )
    add_flags(p, GatewaySettings, title="gateway (a flag wins over its variable)")
    add_redis_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate the settings, then hand the app to uvicorn (returns when it stops)."""
    import uvicorn  # here: the base install has no uvicorn, and other commands need none

    from tokenfleet.producer.gateway.app import create_app

    settings = settings_from_flags(args)
    flags = flag_values(args, GatewaySettings)
    gateway = GatewaySettings.from_env(**flags)
    if gateway.processes > 1:  # each process builds its own app: pass the settings by environment
        os.environ.update(redis_env(settings))
        os.environ.update(env_of(gateway, flags))
        uvicorn.run(
            "tokenfleet.producer.gateway.app:app_from_env",
            factory=True,
            host=gateway.host,
            port=gateway.port,
            workers=gateway.processes,
            log_level=gateway.log_level,
        )
        return 0
    uvicorn.run(
        create_app(settings, gateway),
        host=gateway.host,
        port=gateway.port,
        log_level=gateway.log_level,
    )
    return 0
