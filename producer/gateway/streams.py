"""The SSE bodies: a request's events as OpenAI chunks, each token's chunk carrying its index.

Every token chunk is an SSE event whose ``id`` is the token's index, so a client that lost the
connection sends ``Last-Event-ID`` (a browser's EventSource does it by itself) and
``GET /v1/requests/{id}/events`` continues at the next index: read from the durable record,
then live, gap-free and duplicate-free. Chunks that are not tokens (the chat role chunk, the
finish chunk, the usage chunk, ``[DONE]``) carry no id, so they do not move the client's
position. A request that ends other than ``done`` ends its stream with a chunk holding
``error`` (which the OpenAI SDKs raise as ``APIError``), naming why; no ``[DONE]`` follows it.

A tools request's chunks are made by ``tool_stream.ToolStream`` (a call is sent whole): they
depend on every token before them, so its stream is always read from the first token, and the
chunks a resuming client already has (SSE id below its position) are skipped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from prometheus_client import Gauge
from sse_starlette import ServerSentEvent

from tokenfleet.producer.async_handle import AsyncHandle
from tokenfleet.producer.gateway.responses import Framing, stream_error, usage_of
from tokenfleet.producer.gateway.tool_stream import ToolStream
from tokenfleet.shared.errors import RedisUnavailable, RequestLost
from tokenfleet.shared.schema import Event, TerminalEvent, TerminalStatus, TokenEvent


@dataclass(slots=True)
class StreamState:
    """What a stream's disconnect handler needs to know: has its request ended (and how)?"""

    ended: bool = False
    terminal: TerminalEvent | None = None


def _data(obj: object) -> str:
    return orjson.dumps(obj).decode()


def parse_last_event_id(value: str | None) -> int:
    """The index to continue from after ``Last-Event-ID: value`` (0 when absent or not an
    index: an unknown position replays from the start rather than skipping anything)."""
    if value is None or not value.strip().isdigit():
        return 0
    return int(value.strip()) + 1


async def openai_events(
    events: AsyncIterator[Event],
    framing: Framing,
    *,
    from_index: int,
    include_usage: bool,
    state: StreamState,
) -> AsyncIterator[ServerSentEvent]:
    """SSE events of one request from ``from_index`` on (``events`` starts there; for a tools
    request, at the first token: the chunks before ``from_index`` are skipped)."""
    if from_index == 0 and framing.kind == "chat":
        yield ServerSentEvent(_data(framing.chunk("", role=True)))
    tools = ToolStream(framing) if framing.tools else None
    try:
        async for event in events:
            if isinstance(event, TokenEvent):
                if tools is None:
                    chunks = [framing.chunk(event.text, token=event)]
                else:
                    chunks = tools.feed(event)
                    if event.index < from_index:
                        continue
                for chunk in chunks:
                    yield ServerSentEvent(_data(chunk), id=str(event.index))
                continue
            state.ended, state.terminal = True, event
            for sse in _ending(event, framing, include_usage, tools):
                yield sse
            return
    except (RequestLost, RedisUnavailable) as exc:  # nothing more can come: say so, visibly
        state.ended = True
        err = {"error": {"message": str(exc), "type": "server_error", "code": exc.code}}
        yield ServerSentEvent(_data(err))


async def relay(
    handle: AsyncHandle,
    framing: Framing,
    *,
    from_index: int,
    include_usage: bool,
    state: StreamState,
    streams_open: Gauge,
) -> AsyncIterator[ServerSentEvent]:
    """:func:`openai_events` of ``handle`` from ``from_index``, counted in ``streams_open``
    while it runs; the handle is closed when the stream ends, however it ends."""
    streams_open.inc()
    try:
        async for sse in openai_events(
            handle.stream(0 if framing.tools else from_index),
            framing,
            from_index=from_index,
            include_usage=include_usage,
            state=state,
        ):
            yield sse
    finally:
        streams_open.dec()
        handle.close()


def _ending(
    event: TerminalEvent, framing: Framing, include_usage: bool, tools: ToolStream | None
) -> list[ServerSentEvent]:
    if event.status is not TerminalStatus.DONE:
        return [ServerSentEvent(_data(stream_error(event)))]
    out, finish = [], event.finish_reason
    if tools is not None:
        rest, finish = tools.finish(event)
        out = [ServerSentEvent(_data(chunk)) for chunk in rest]
    out.append(ServerSentEvent(_data(framing.chunk("", finish))))
    if include_usage:
        out.append(ServerSentEvent(_data(framing.chunk(None, usage=usage_of(event)))))
    out.append(ServerSentEvent("[DONE]"))
    return out
