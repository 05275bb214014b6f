"""``tokenfleet console``: the fleet console for a fleet without a gateway (docs/console.md).

The same page the gateway serves at ``/console`` (queues, workers, KV pools, requests, batches,
API keys, dead letters; live), on its own uvicorn process. Its flags are the gateway's own
(``GatewaySettings``' declaration: ``--host``, ``--port``, ``--auth``,
``--console-refresh-s``, ``--log-level``, with their ``TOKENFLEET_GATEWAY_*`` variables):
``--auth required`` asks for a viewer or admin API key as the gateway does; with ``--auth off``
(the default) anyone who reaches the port may look and act: keep it on 127.0.0.1 then.
"""

from __future__ import annotations

import argparse
from typing import Any

from tokenfleet.producer.gateway.settings import GatewaySettings
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags
from tokenfleet.shared.settings_flags import add_flags, flag_values

FLAGS = ("host", "port", "auth", "console_refresh_s", "log_level")


def register(subparsers: Any) -> None:
    """Add the ``console`` parser."""
    p = subparsers.add_parser(
        "console",
        help="serve the live fleet console (a web page) without a gateway",
        description="Serve the fleet console at http://HOST:PORT/console: queues, workers, KV "
        "pools, requests, batches, API keys and dead letters, updated live.",
    )
    add_flags(p, GatewaySettings, only=FLAGS, title="console (a flag wins over its variable)")
    add_redis_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    import uvicorn  # the gateway extra

    from tokenfleet.producer.gateway.console.app import create_console_app

    settings = settings_from_flags(args)
    gateway = GatewaySettings.from_env(**flag_values(args, GatewaySettings))
    print(f"tokenfleet console: http://{gateway.host}:{gateway.port}/console", flush=True)
    uvicorn.run(
        create_console_app(settings, gateway),
        host=gateway.host,
        port=gateway.port,
        log_level=gateway.log_level,
    )
    return 0
