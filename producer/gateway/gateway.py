"""``Gateway``: what every route shares — the async client, API keys, models, drain, metrics.

One per app, made in the app's lifespan. Each ``/v1`` call goes: :meth:`caller` (the API key,
or nobody when keys are off) → parse the body → :meth:`check_priority` → :meth:`check_model`
(404 unknown, 503 no live worker) → :meth:`admit` (the key's RPM/TPM, 429) → :meth:`submit`
(the queue's bound, 429 with a Retry-After from its drain rate). Nothing is enqueued unless
every check before the submit passed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.async_handle import AsyncHandle
from tokenfleet.producer.gateway.auth import ApiKey, ApiKeyStore, AuthError
from tokenfleet.producer.gateway.batches.files import FileStore
from tokenfleet.producer.gateway.batches.store import BatchStore
from tokenfleet.producer.gateway.drain import DrainMeter
from tokenfleet.producer.gateway.errors import ApiError, from_tokenfleet
from tokenfleet.producer.gateway.identity import choice_id, make_request_id
from tokenfleet.producer.gateway.metrics import GatewayMetrics
from tokenfleet.producer.gateway.openai_api import Submission
from tokenfleet.producer.gateway.responses import Framing, used_tokens
from tokenfleet.producer.gateway.settings import MODELS_REFRESH_S, GatewaySettings
from tokenfleet.shared.cancellation import cancel_checkpoint, raise_if_cancelling
from tokenfleet.shared.errors import InvalidRequest, Overloaded, TokenfleetError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import MAX_SEED, TerminalEvent
from tokenfleet.shared.tenants import DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: their API key (None when keys are off)."""

    key: ApiKey | None = None

    @property
    def owner(self) -> str | None:
        """The prefix of the request ids this caller owns (see ``identity``)."""
        return self.key.key_id if self.key is not None else None


@dataclass(slots=True)
class Accepted:
    """A submitted request, as the route answers it. With ``n`` > 1, ``choices`` holds a
    handle per choice (``handle`` is the first); else it is empty."""

    handle: AsyncHandle
    framing: Framing
    headers: dict[str, str] = field(default_factory=dict)
    charged_tokens: int = 0
    choices: list[AsyncHandle] = field(default_factory=list)


class Gateway:
    """The routes' shared state and checks (see the module docstring for the order)."""

    def __init__(
        self,
        client: AsyncClient,
        client_redis: redis.asyncio.Redis,
        settings: GatewaySettings,
        *,
        key_store: ApiKeyStore | None,
        drain: DrainMeter,
    ) -> None:
        self.client = client
        self.client_redis = client_redis
        self.keys = Keys.for_settings(client.settings)
        self.settings = settings
        self.key_store = key_store
        self.files = FileStore(client_redis, client.settings, max_bytes=settings.max_file_bytes)
        self.batches = BatchStore(
            client_redis,
            client.settings,
            default_max_tokens=settings.default_max_tokens,
            lease_ms=settings.batch_lease_ms,
        )
        self.drain = drain
        self.metrics = GatewayMetrics()
        self._models: tuple[float, dict[str, Any]] = (0.0, {})
        self._background: set[asyncio.Task[Any]] = set()

    # -- who, which model ---------------------------------------------------------------------
    async def caller(self, authorization: str | None) -> Caller:
        """The caller's key from ``Authorization: Bearer KEY`` (401 when keys are required and
        it is missing, unknown or revoked)."""
        if not self.settings.auth_required or self.key_store is None:
            return Caller()
        presented = None
        if authorization:
            scheme, _, token = authorization.partition(" ")
            presented = token.strip() if scheme.lower() == "bearer" else None
        try:
            return Caller(await self.key_store.authenticate(presented))
        except AuthError as exc:
            raise ApiError(401, str(exc), code="invalid_api_key") from None

    async def models(self) -> dict[str, Any]:
        """The fleet's models by name (``ModelInfo``): what :meth:`refresh_models` last read.
        Read inline only when that is older than twice ``MODELS_REFRESH_S`` (the refresher is
        behind, or Redis was unreachable), so a request rarely waits on it."""
        at, models = self._models
        if time.monotonic() - at > 2 * MODELS_REFRESH_S:
            models = await self.refresh_models()
        return models

    async def refresh_models(self) -> dict[str, Any]:
        """Read the fleet's models (live heartbeats, declarations) now and cache them."""
        models = {m.name: m for m in await self.client.models()}
        self._models = (time.monotonic(), models)
        return models

    async def keep_models_fresh(self) -> None:
        """Re-read the models every ``MODELS_REFRESH_S`` (the app's lifespan runs it as a task)."""
        while True:
            cancel_checkpoint()
            try:
                await self.refresh_models()
            except redis.RedisError as exc:
                raise_if_cancelling(exc)
            await asyncio.sleep(MODELS_REFRESH_S)

    async def check_model(self, model: str) -> None:
        """404 for a model nobody serves or declared, 503 for one with no live worker now."""
        info = (await self.models()).get(model)
        if info is None or not info.served:  # news since the last refresh? (a worker that
            info = (await self.refresh_models()).get(model)  # just started): read it again
        if info is None:
            raise ApiError(
                404,
                f"the model '{model}' does not exist: no worker serves it and the fleet does "
                "not declare it (GET /v1/models lists the served ones)",
                code="model_not_found",
                param="model",
            )
        if not info.served:
            raise ApiError(
                503,
                f"no worker is serving the model '{model}' now; try again when one is",
                code="model_unavailable",
                param="model",
                headers={"Retry-After": "5"},
            )

    def check_priority(self, caller: Caller, asked: str | None) -> Priority:
        """The priority to submit at: the one asked for (default normal, or the key's ceiling
        when that is lower); 403 when a key asks above its ceiling."""
        try:
            priority = Priority.parse(asked) if asked is not None else Priority.NORMAL
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), code="invalid_priority", param="priority") from None
        if caller.key is None:
            return priority
        ceiling = caller.key.priority_ceiling
        if asked is None:
            return max(priority, ceiling)  # a larger value is less urgent
        if priority < ceiling:
            raise ApiError(
                403,
                f"this API key may submit at priority '{ceiling.label}' or below, not "
                f"'{priority.label}'",
                code="priority_above_ceiling",
                param="priority",
            )
        return priority

    async def admit(self, caller: Caller, tokens: int) -> dict[str, str]:
        """Charge the key's quota (429 with Retry-After when over, 400 when the request alone
        is over the key's TPM); the rate-limit headers."""
        if caller.key is None or self.key_store is None:
            return {}
        try:
            decision = await self.key_store.admit(caller.key, tokens)
        except AuthError as exc:  # revoked since it was authenticated
            raise ApiError(401, str(exc), code="invalid_api_key") from None
        if decision.too_large:  # no wait helps: not a 429 (clients retry those)
            raise ApiError(
                400,
                decision.message,
                code="request_too_large",
                param="max_tokens",
                headers=decision.headers,
            )
        if not decision.allowed:
            wait = max(1, math.ceil(decision.retry_after_s))
            raise ApiError(
                429,
                decision.message,
                code="rate_limit_exceeded",
                headers={
                    **decision.headers,
                    "Retry-After": str(wait),
                    "retry-after-ms": str(max(1, math.ceil(decision.retry_after_s * 1000))),
                },
            )
        return dict(decision.headers)

    # -- submitting ---------------------------------------------------------------------------
    async def submit(
        self,
        sub: Submission,
        caller: Caller,
        priority: Priority,
        headers: Mapping[str, str],
    ) -> Accepted:
        """Check, charge and enqueue ``sub``; the handle and how to frame its answer. ``n`` > 1
        enqueues ``n`` requests in one pipeline, ``<id>.0`` .. ``<id>.<n-1>`` (choice ``i``'s
        seed is ``seed + i``), or none: a refusal of one cancels those accepted."""
        if sub.n > self.settings.max_n:
            raise ApiError(
                400,
                f"n = {sub.n} is above this gateway's limit of {self.settings.max_n} "
                "(TOKENFLEET_GATEWAY_MAX_N)",
                code="n_above_limit",
                param="n",
            )
        await self.check_model(sub.model)
        rate_headers = await self.admit(caller, sub.estimated_tokens)
        rid = make_request_id(
            sub.kind, caller.owner, headers.get("idempotency-key"), tools=sub.tools
        )
        choices: list[AsyncHandle] = []
        try:
            tenant = caller.key.tenant if caller.key is not None else DEFAULT_TENANT
            if sub.n > 1:
                choices = await self._submit_choices(sub, priority, rid, tenant)
                handle = choices[0]
            else:
                handle = await self.client.submit(
                    model=sub.model,
                    priority=priority,
                    request_id=rid,
                    timeout=self.settings.submit_wait_s,
                    tenant=tenant,
                    **sub.params,
                )
        except Overloaded as exc:
            await self.refund(caller, sub.estimated_tokens)
            raise await self._overloaded(exc, sub.model, priority, rate_headers) from None
        except TokenfleetError as exc:
            await self.refund(caller, sub.estimated_tokens)
            err = from_tokenfleet(exc)
            err.headers.update(rate_headers)
            raise err from None
        framing = Framing(rid, sub.kind, sub.model, int(time.time()), sub.tools)
        return Accepted(
            handle, framing, {"X-Request-Id": rid, **rate_headers}, sub.estimated_tokens, choices
        )

    async def _submit_choices(
        self, sub: Submission, priority: Priority, rid: str, tenant: str
    ) -> list[AsyncHandle]:
        """The ``n`` choices' requests, enqueued in one pipeline (one worker usually reads them
        together and prefills their prompt once: docs/engine.md, "Prefix caching"); the first
        refusal is raised after the accepted ones are cancelled (each ends once, cancelled)."""
        specs = []
        for i in range(sub.n):
            spec = {**sub.params, "model": sub.model, "priority": priority, "tenant": tenant}
            spec["request_id"] = choice_id(rid, i)
            if sub.params.get("seed") is not None:  # each choice reproducible on its own
                spec["seed"] = (sub.params["seed"] + i) % (MAX_SEED + 1)
            specs.append(spec)
        results = await self.client.submit_many(specs)
        refused = [r for r in results if isinstance(r, TokenfleetError)]
        handles = [r for r in results if not isinstance(r, TokenfleetError)]
        if refused:
            for h in handles:
                h.close()
                await self.client.cancel(h.request_id)
            raise refused[0]
        return handles

    async def _overloaded(
        self, exc: Overloaded, model: str, priority: Priority, headers: dict[str, str]
    ) -> ApiError:
        slots = 1
        for q in await self.client.queue_stats():
            if q.model == model and q.priority == priority.label:
                slots = max(1, q.waiting - q.max_waiting + 1)
        wait = self.drain.retry_after_s(model, priority, slots)
        return ApiError(
            429,
            f"{exc} Retry in about {wait} s (the queue's recent drain rate).",
            code="queue_full",
            headers={**headers, "Retry-After": str(wait)},
        )

    async def refund(self, caller: Caller, charged: int, used: int = 0) -> None:
        """Settle a key's token charge with what was used (0 for a refused request)."""
        if caller.key is not None and self.key_store is not None and charged:
            await self.key_store.settle(caller.key, charged, used)

    def settle_later(self, caller: Caller, request_id: str, charged: int) -> None:
        """Settle the key's token charge when the request ends (its client left first)."""
        if caller.key is None or not charged:
            return

        async def wait_and_settle() -> None:
            handle = self.client.handle(request_id)
            try:
                async for event in handle.stream():
                    if isinstance(event, TerminalEvent):
                        await self.refund(caller, charged, used_tokens(event))
            finally:
                handle.close()

        self.spawn(wait_and_settle())

    def settle_later_all(self, caller: Caller, request_ids: list[str], charged: int) -> None:
        """:meth:`settle_later` for the choices of one request (the charge split between
        them)."""
        share, extra = divmod(charged, max(1, len(request_ids)))
        for i, rid in enumerate(request_ids):
            self.settle_later(caller, rid, share + (extra if i == 0 else 0))

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` detached from the HTTP request (a disconnect cancels the request's
        task; what must happen after it — cancelling the generation — runs here)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        """Wait for detached work, then close the client."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.client.aclose()
