"""``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``.

Headers (docs/gateway.md): ``Authorization: Bearer KEY`` (when keys are required),
``X-Priority`` (critical | normal | batch; the body's ``priority`` wins), ``X-Deadline-S``
(seconds to start within; the body's ``deadline_s`` wins), ``Idempotency-Key`` (the same key
and body return the same request; another body under it is 409), ``X-On-Disconnect`` (cancel |
continue). Every answer carries ``X-Request-Id``; a stream's chunks carry it as their ``id``.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from tokenfleet.producer.core.models import ModelInfo
from tokenfleet.producer.gateway.choices import (
    choice_events,
    collect_all,
    parse_cursor,
    whole_response,
)
from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.producer.gateway.gateway import Accepted, Caller, Gateway
from tokenfleet.producer.gateway.keepalive import event_stream
from tokenfleet.producer.gateway.openai_api import (
    ChatBody,
    CompletionBody,
    Submission,
    chat_submission,
    completion_submission,
)
from tokenfleet.producer.gateway.responses import collect, failure, used_tokens
from tokenfleet.producer.gateway.settings import DISCONNECT_MODES
from tokenfleet.producer.gateway.streams import StreamState, parse_last_event_id, relay
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.queue_config import QueueStats
from tokenfleet.shared.schema import TerminalStatus

router = APIRouter()


def gateway_of(request: Request) -> Gateway:
    """The app's ``Gateway`` (made in its lifespan)."""
    gw: Gateway = request.app.state.gateway
    return gw


async def caller_of(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> Caller:
    """Dependency: the caller (401 before the body is even validated)."""
    return await gateway_of(request).caller(authorization)


CallerDep = Annotated[Caller, Depends(caller_of)]


def _disconnect_mode(gw: Gateway, header: str | None) -> str:
    if header is None:
        return gw.settings.on_disconnect
    mode = header.strip().lower()
    if mode not in DISCONNECT_MODES:
        raise ApiError(
            400, "X-On-Disconnect must be 'cancel' or 'continue'", param="X-On-Disconnect"
        )
    return mode


def _with_header_extensions(sub: Submission, request: Request) -> tuple[Submission, str | None]:
    """The body's priority/deadline, else the headers'."""
    priority = sub.priority if sub.priority is not None else request.headers.get("x-priority")
    deadline = request.headers.get("x-deadline-s")
    if deadline is not None and "deadline_s" not in sub.params:
        try:
            sub.params["deadline_s"] = float(deadline)
        except ValueError:
            raise ApiError(
                400, "X-Deadline-S must be a number of seconds", param="X-Deadline-S"
            ) from None
    return sub, priority


async def _answer(request: Request, gw: Gateway, caller: Caller, sub: Submission) -> Any:
    sub, asked = _with_header_extensions(sub, request)
    mode = _disconnect_mode(gw, request.headers.get("x-on-disconnect"))
    priority = gw.check_priority(caller, asked)
    accepted = await gw.submit(sub, caller, priority, request.headers)
    if accepted.choices:
        if sub.stream:
            cursor = parse_cursor(request.headers.get("last-event-id"), len(accepted.choices))
            return _stream_choices(gw, caller, accepted, sub, mode, cursor)
        return await _whole_choices(request, gw, caller, accepted, mode)
    if sub.stream:
        from_index = parse_last_event_id(request.headers.get("last-event-id"))
        return _stream(gw, caller, accepted, sub, mode, from_index)
    return await _whole(request, gw, caller, accepted, mode)


def _stream(
    gw: Gateway, caller: Caller, accepted: Accepted, sub: Submission, mode: str, from_index: int
) -> EventSourceResponse:
    state = StreamState()
    handle = accepted.handle
    rid = handle.request_id

    async def on_close(_message: Any) -> None:  # the client went away
        if state.ended:
            return
        gw.metrics.disconnects.labels(mode).inc()
        if mode == "cancel":
            gw.spawn(gw.client.cancel(rid))
        gw.settle_later(caller, rid, accepted.charged_tokens)

    async def body() -> Any:
        try:
            async for sse in relay(
                handle,
                accepted.framing,
                from_index=from_index,
                include_usage=sub.include_usage,
                state=state,
                streams_open=gw.metrics.streams_open,
            ):
                yield sse
        finally:
            if state.terminal is not None:
                gw.spawn(gw.refund(caller, accepted.charged_tokens, used_tokens(state.terminal)))

    return event_stream(
        body(),
        keepalive_s=gw.settings.keepalive_s,
        headers=accepted.headers,
        on_client_close=on_close,
    )


async def _whole(
    request: Request, gw: Gateway, caller: Caller, accepted: Accepted, mode: str
) -> JSONResponse:
    """Wait for the end, or for the client to leave (then cancel or continue, per ``mode``)."""
    rid = accepted.handle.request_id
    work = asyncio.ensure_future(collect(accepted.handle))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            accepted.handle.close()
    if not work.done() or work.cancelled():
        gw.metrics.disconnects.labels(mode).inc()
        if mode == "cancel":
            gw.spawn(gw.client.cancel(rid))
        gw.settle_later(caller, rid, accepted.charged_tokens)
        return JSONResponse({}, status_code=499)  # nobody reads it: the client is gone
    tokens, terminal = work.result()
    accepted.handle.close()
    gw.spawn(gw.refund(caller, accepted.charged_tokens, used_tokens(terminal)))
    if terminal.status is not TerminalStatus.DONE:
        err = failure(terminal)
        err.headers.update(accepted.headers)
        raise err
    return JSONResponse(accepted.framing.response(tokens, terminal), headers=accepted.headers)


def _stream_choices(
    gw: Gateway, caller: Caller, accepted: Accepted, sub: Submission, mode: str, cursor: list[int]
) -> EventSourceResponse:
    """The stream of a request with ``n`` > 1 (``choices``)."""
    state = StreamState()
    ids = [h.request_id for h in accepted.choices]

    async def on_close(_message: Any) -> None:  # the client went away
        if state.ended:
            return
        gw.metrics.disconnects.labels(mode).inc()
        if mode == "cancel":
            for rid in ids:
                gw.spawn(gw.client.cancel(rid))
        gw.settle_later_all(caller, ids, accepted.charged_tokens)

    async def body() -> Any:
        gw.metrics.streams_open.inc()
        try:
            async for sse in choice_events(
                accepted.choices,
                accepted.framing,
                cursor=cursor,
                include_usage=sub.include_usage,
                state=state,
                cancel=gw.client.cancel,
            ):
                yield sse
        finally:
            gw.metrics.streams_open.dec()
            if state.terminal is not None:
                gw.spawn(gw.refund(caller, accepted.charged_tokens, used_tokens(state.terminal)))

    return event_stream(
        body(),
        keepalive_s=gw.settings.keepalive_s,
        headers=accepted.headers,
        on_client_close=on_close,
    )


async def _whole_choices(
    request: Request, gw: Gateway, caller: Caller, accepted: Accepted, mode: str
) -> JSONResponse:
    """Every choice to its end, or the client leaving first (then cancel or continue them)."""
    ids = [h.request_id for h in accepted.choices]
    work = asyncio.ensure_future(collect_all(accepted.choices, gw.client.cancel))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        for h in accepted.choices:
            h.close()
    if not work.done() or work.cancelled():
        gw.metrics.disconnects.labels(mode).inc()
        if mode == "cancel":
            for rid in ids:
                gw.spawn(gw.client.cancel(rid))
        gw.settle_later_all(caller, ids, accepted.charged_tokens)
        return JSONResponse({}, status_code=499)  # nobody reads it: the client is gone
    results, failed = work.result()
    ends = [end for _, end in results]
    used = sum(used_tokens(end) for end in ends)
    gw.spawn(gw.refund(caller, accepted.charged_tokens, used))
    if failed is not None:
        err = failure(failed)
        err.headers.update(accepted.headers)
        raise err
    body = whole_response(accepted.framing, results)
    return JSONResponse(body, headers=accepted.headers)


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read: only that can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionBody, caller: CallerDep) -> Any:
    """OpenAI's (legacy) text completions."""
    return await _answer(request, gateway_of(request), caller, completion_submission(body))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatBody, caller: CallerDep) -> Any:
    """OpenAI's chat completions."""
    gw = gateway_of(request)
    return await _answer(request, gw, caller, chat_submission(body, gw.settings.default_max_tokens))


@router.get("/v1/models")
async def list_models(request: Request, caller: CallerDep) -> dict[str, Any]:
    """The models some live worker serves now (read afresh: not a hot path), in OpenAI's shape
    plus a ``tokenfleet`` object each: its live workers, whether the fleet declares it, and its
    queues' ``waiting`` / ``running`` per priority, routed streams included. A declared model
    that no live worker serves is not listed (OpenAI lists what it can run now; ``Client.models()``
    and ``tokenfleet models fleet`` list those too)."""
    gw = gateway_of(request)
    models = await gw.refresh_models()
    queues = await gw.client.queue_stats()
    tenants = await gw.client.tenant_stats()
    data = [
        {
            "id": info.name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenfleet",
            "tokenfleet": _model_extension(info, queues, tenants),
        }
        for info in sorted(models.values(), key=lambda m: m.name)
        if info.served
    ]
    return {"object": "list", "data": data}


def _model_extension(
    info: ModelInfo, queues: list[QueueStats], tenants: list[dict[str, Any]]
) -> dict[str, Any]:
    """``/v1/models``' ``tokenfleet`` object of one model: every priority level is named (a
    queue never used counts 0 waiting, 0 running); ``tenants``: per tenant of its book, waiting
    (in its tenant queues), running and served tokens (docs/fairness.md)."""
    depth = {p.label: {"waiting": 0, "running": 0} for p in Priority}
    for q in queues:
        if q.model == info.name:
            depth[q.priority] = {"waiting": q.waiting, "running": q.running}
    mine = {
        t["tenant"]: {k: t[k] for k in ("waiting", "running", "served_tokens")}
        for t in tenants
        if t["model"] == info.name
    }
    return {
        "workers": list(info.workers),
        "declared": info.declared,
        "queues": depth,
        "tenants": mine,
    }
