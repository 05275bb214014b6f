"""A request after its submit: ``GET /v1/requests/{id}`` (status and result),
``POST /v1/requests/{id}/cancel`` and ``GET /v1/requests/{id}/events`` (its stream, resumable).

A request another API key owns is answered exactly as one that does not exist (404): a key
learns nothing about other keys' requests, not even that they exist.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.producer.gateway.gateway import Caller, Gateway
from tokenfleet.producer.gateway.identity import choice_id, has_tools, kind_of, owns
from tokenfleet.producer.gateway.keepalive import event_stream
from tokenfleet.producer.gateway.responses import Framing, collect
from tokenfleet.producer.gateway.routes_openai import CallerDep, gateway_of
from tokenfleet.producer.gateway.streams import StreamState, parse_last_event_id, relay
from tokenfleet.shared.errors import InvalidRequest, UnknownRequest
from tokenfleet.shared.keys import check_request_id
from tokenfleet.shared.record import RequestRecord

router = APIRouter()


async def _record(gw: Gateway, caller: Caller, request_id: str) -> RequestRecord:
    try:
        check_request_id(request_id)
        if not owns(caller.owner, request_id):
            raise UnknownRequest(request_id)
        return await gw.client.status(request_id)
    except (InvalidRequest, UnknownRequest):
        raise ApiError(
            404, f"no request '{request_id}' (never submitted, or expired)", code="not_found"
        ) from None


@router.get("/v1/requests/{request_id}")
async def get_request(request: Request, request_id: str, caller: CallerDep) -> dict[str, Any]:
    """The durable record: status, times, and once ended, text, finish reason and usage; and,
    when the request asked for logprobs, ``logprobs``: one OpenAI per-token object per token
    (read from its stored token events)."""
    gw = gateway_of(request)
    record = await _record(gw, caller, request_id)
    out = record.to_dict()
    out["id"] = out.pop("request_id")
    out["object"] = "tokenfleet.request"
    if record.status.is_terminal and record.num_tokens:
        handle = gw.client.handle(request_id)
        try:
            tokens, _ = await collect(handle)
        finally:
            handle.close()
        if any(t.logprobs is not None for t in tokens):
            out["logprobs"] = [t.logprobs for t in tokens]
    return out


@router.post("/v1/requests/{request_id}/cancel")
async def cancel_request(request: Request, request_id: str, caller: CallerDep) -> dict[str, Any]:
    """Cancel: a waiting request ends at once, a running one at its worker's next step (its KV
    is freed then). ``cancelled`` is false when it had already ended. The id of a request with
    ``n`` > 1 cancels each of its choices (``choices``: each one's answer)."""
    gw = gateway_of(request)
    try:
        await _record(gw, caller, request_id)
    except ApiError:
        choices = await _choice_ids(gw, caller, request_id)
        if not choices:
            raise
        out = [await cancel_request(request, rid, caller) for rid in choices]
        return {
            "id": request_id,
            "cancelled": any(c["cancelled"] for c in out),
            "choices": out,
        }
    cancelled = await gw.client.cancel(request_id)
    record = await gw.client.status(request_id)
    return {"id": request_id, "cancelled": cancelled, "status": record.status.value}


async def _choice_ids(gw: Gateway, caller: Caller, request_id: str) -> list[str]:
    """The requests of ``request_id``'s choices when it asked for ``n`` > 1 (``<id>.0``,
    ``<id>.1``, ... while they exist, at most the gateway's ``max_n``); [] otherwise."""
    out = []
    for i in range(gw.settings.max_n):
        rid = choice_id(request_id, i)
        try:
            await _record(gw, caller, rid)
        except ApiError:
            break
        out.append(rid)
    return out


@router.get("/v1/requests/{request_id}/events")
async def request_events(
    request: Request,
    request_id: str,
    caller: CallerDep,
    last_event_id: int | None = None,
    include_usage: bool = False,
) -> EventSourceResponse:
    """The request's stream from the token after ``Last-Event-ID`` (header; or the
    ``last_event_id`` query parameter), framed as the endpoint that made it framed it:
    tokens already published come from the durable record, the rest live. Leaving it never
    cancels the request (this is a reader, not the submitter)."""
    gw = gateway_of(request)
    record = await _record(gw, caller, request_id)
    header = request.headers.get("last-event-id")
    from_index = parse_last_event_id(header if last_event_id is None else str(last_event_id))
    if from_index > 0:
        gw.metrics.resumes.inc()
    framing = Framing(
        request_id,
        kind_of(request_id),
        record.model,
        int(record.enqueued_at or 0),
        has_tools(request_id),
    )
    handle = gw.client.handle(request_id)

    events = relay(
        handle,
        framing,
        from_index=from_index,
        include_usage=include_usage,
        state=StreamState(),
        streams_open=gw.metrics.streams_open,
    )
    return event_stream(
        events, keepalive_s=gw.settings.keepalive_s, headers={"X-Request-Id": request_id}
    )
