"""Mounting the console on an app: the gateway's (``gateway.app.create_app``) or the standalone
one ``tokenfleet console`` serves for a fleet without a gateway (``create_console_app``).

The routes and the static files are added when the app is built; the state they read
(``app.state.console``) when its lifespan opens its Redis connections.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib import resources

import redis.asyncio
from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.gateway.auth import ApiKeyStore
from tokenfleet.producer.gateway.batches.store import BatchStore
from tokenfleet.producer.gateway.console.access import ConsoleAccess
from tokenfleet.producer.gateway.console.render import environment
from tokenfleet.producer.gateway.console.routes import Console, router
from tokenfleet.producer.gateway.console.view import ConsoleData
from tokenfleet.producer.gateway.settings import GatewaySettings
from tokenfleet.shared.redis_connect import async_redis_client
from tokenfleet.shared.settings import Settings

VENDORED = ("htmx.min.js", "htmx-ext-sse.min.js", "uPlot.iife.min.js", "uPlot.min.css")


def static_folder() -> str:
    """The folder of the console's static files (in the installed package). Refuses to serve a
    console whose vendored scripts were never copied in (``make setup`` does it)."""
    folder = resources.files("tokenfleet.producer.gateway.console").joinpath("static")
    missing = [n for n in VENDORED if not folder.joinpath("vendor", n).is_file()]
    if missing:
        raise RuntimeError(
            f"the console's vendored files are missing ({', '.join(missing)}): run "
            "'make setup' (npm ci in web/, then scripts/console_assets.py), or set "
            "TOKENFLEET_GATEWAY_CONSOLE=off"
        )
    return str(folder)


def mount_console(app: FastAPI) -> None:
    """Add the console's routes and static files to ``app``."""
    app.include_router(router)
    app.mount("/console/static", StaticFiles(directory=static_folder()), name="console-static")


def open_console(
    app: FastAPI,
    client: AsyncClient,
    client_redis: redis.asyncio.Redis,
    batches: BatchStore,
    store: ApiKeyStore | None,
    gateway_settings: GatewaySettings,
) -> Console:
    """The console's state on ``app`` (its lifespan calls this once it has its clients)."""
    data = ConsoleData(client, client_redis, batches, keys_on=store is not None)
    console = Console(
        data,
        ConsoleAccess(store),
        environment(),
        refresh_s=gateway_settings.console_refresh_s,
        keepalive_s=gateway_settings.keepalive_s,
    )
    app.state.console = console
    return console


def create_console_app(settings: Settings, gateway_settings: GatewaySettings) -> FastAPI:
    """The console alone, for a fleet without a gateway (``tokenfleet console --port``): the
    same page, reads and access rules (``--auth required``: viewer and admin keys)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client_redis = async_redis_client(settings)
        client = AsyncClient(client_redis, settings=settings)
        store = ApiKeyStore(client_redis, settings) if gateway_settings.auth_required else None
        batches = BatchStore(
            client_redis,
            settings,
            default_max_tokens=gateway_settings.default_max_tokens,
            lease_ms=gateway_settings.batch_lease_ms,
        )
        console = open_console(app, client, client_redis, batches, store, gateway_settings)
        try:
            yield
        finally:
            await console.feed.close()
            await client.aclose()
            await client_redis.aclose()

    app = FastAPI(title="tokenfleet console", lifespan=lifespan, docs_url=None, redoc_url=None)
    mount_console(app)
    return app
