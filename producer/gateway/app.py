"""``create_app``: the FastAPI app ``tokenfleet serve`` runs on uvicorn.

The lifespan opens one Redis connection pool and one ``AsyncClient`` per process, starts the
drain sampler, and closes them at shutdown. Errors of every kind leave in the OpenAI shape
(``errors``); bodies over ``max_body_bytes`` are refused by ``limits.BodyLimit`` before any
parsing; every answer is counted by route and status code (``GET /metrics``). With
``console`` on (the default) it also serves the fleet console at ``/console`` (docs/console.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.gateway import routes_batches, routes_openai, routes_requests
from tokenfleet.producer.gateway.auth import ApiKeyStore
from tokenfleet.producer.gateway.batches.runner import BatchRunner
from tokenfleet.producer.gateway.console.app import mount_console, open_console
from tokenfleet.producer.gateway.drain import DrainMeter
from tokenfleet.producer.gateway.errors import ApiError, error_body, from_tokenfleet
from tokenfleet.producer.gateway.fleet_metrics import FleetMetrics
from tokenfleet.producer.gateway.gateway import Gateway
from tokenfleet.producer.gateway.limits import BodyLimit, CountResponses
from tokenfleet.producer.gateway.settings import GatewaySettings
from tokenfleet.shared.errors import TokenfleetError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.redis_connect import async_redis_client
from tokenfleet.shared.settings import Settings

DESCRIPTION = """OpenAI-compatible HTTP gateway of a tokenfleet fleet.

Extensions to the OpenAI API: `priority` (body) or `X-Priority` (header): critical | normal |
batch; `deadline_s` or `X-Deadline-S`: seconds within which the request must start;
`Idempotency-Key`: the same key and body return the same request; `X-On-Disconnect`: cancel
(default) | continue; `top_k`, `ignore_eos`, `stop_token_ids`. Every answer carries
`X-Request-Id`; streams are resumable at `GET /v1/requests/{id}/events` with `Last-Event-ID`.
"""


def create_app(settings: Settings, gateway_settings: GatewaySettings) -> FastAPI:
    """The app; connects to Redis when it starts (lifespan), not here."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis_client = async_redis_client(settings)
        keys = Keys.for_settings(settings)
        store = ApiKeyStore(redis_client, settings) if gateway_settings.auth_required else None
        client = AsyncClient(redis_client, settings=settings)
        drain = DrainMeter(redis_client, keys, client_for=client.redis_for_key)
        gateway = Gateway(client, redis_client, gateway_settings, key_store=store, drain=drain)
        runner = BatchRunner(  # every gateway drives batches; leases share them out
            client,
            redis_client,
            settings,
            window=gateway_settings.batch_window,
            lease_ms=gateway_settings.batch_lease_ms,
            default_max_tokens=gateway_settings.default_max_tokens,
            store=gateway.batches,
        )
        app.state.gateway = gateway
        gateway.metrics.watch_fleet(FleetMetrics(client, gateway.batches))
        console = None
        if gateway_settings.console == "on":
            console = open_console(
                app,
                client,
                redis_client,
                gateway.batches,
                store,
                gateway_settings,
            )
            gateway.metrics.console_listeners.set_function(lambda: console.feed.listeners)
        loop = asyncio.get_running_loop()
        background = [
            loop.create_task(drain.run()),
            loop.create_task(gateway.keep_models_fresh()),
            loop.create_task(runner.run()),
        ]
        try:
            yield
        finally:
            if console is not None:
                await console.feed.close()
            for task in background:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await gateway.aclose()
            await redis_client.aclose()

    app = FastAPI(
        title="tokenfleet gateway",
        description=DESCRIPTION,
        version="1",
        lifespan=lifespan,
    )
    app.include_router(routes_openai.router)
    app.include_router(routes_requests.router)
    app.include_router(routes_batches.router)
    if gateway_settings.console == "on":
        mount_console(app)
    _install_error_handlers(app)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        body = await gw.metrics.exposition()
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/health", include_in_schema=False)
    async def health(request: Request) -> dict[str, str]:
        gw: Gateway = request.app.state.gateway
        try:
            await gw.drain.sample()
        except redis.RedisError as exc:
            raise ApiError(503, f"waiting for Redis: {exc}", code="redis_unavailable") from None
        return {"status": "ok"}

    app.add_middleware(CountResponses, metrics_of=lambda: _metrics(app))
    app.add_middleware(
        BodyLimit,
        max_bytes=gateway_settings.max_body_bytes,
        max_upload_bytes=gateway_settings.max_file_bytes,
        upload_paths=("/v1/files",),
    )
    return app


def _metrics(app: FastAPI) -> Any:
    gw = getattr(app.state, "gateway", None)
    return gw.metrics if gw is not None else None


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "header", "query", "path")]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
            return JSONResponse(error_body(400, message, code="invalid_json"), status_code=400)
        param = _param(tuple(first.get("loc", ())))
        if param is None and first.get("type") == "missing":
            message = "the body is missing: send a JSON object"
            return JSONResponse(error_body(400, message, code="invalid_json"), status_code=400)
        message = f"{param or 'body'}: {first.get('msg', 'invalid')}"
        return JSONResponse(
            error_body(400, message, code="invalid_type", param=param), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(
            exc.status_code
        )
        body = error_body(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(TokenfleetError)
    async def tokenfleet_error(_request: Request, exc: TokenfleetError) -> JSONResponse:
        err = from_tokenfleet(exc)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(redis.RedisError)
    async def redis_down(_request: Request, exc: redis.RedisError) -> JSONResponse:
        body = error_body(503, f"waiting for Redis: {exc}", code="redis_unavailable")
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


def app_from_env() -> FastAPI:
    """The app from the environment (``REDIS_URL``, ``TOKENFLEET_*``): uvicorn's factory when
    ``tokenfleet serve --processes N`` runs several worker processes."""
    return create_app(Settings.from_env(), GatewaySettings.from_env())
