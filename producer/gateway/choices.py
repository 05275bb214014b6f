"""Answers of a request with ``n`` > 1: its choices are requests ``<id>.0`` .. ``<id>.<n-1>``
(``Gateway.submit``), read side by side into one answer.

Whole: every choice is read to its end; the response's ``choices`` are indexed 0..n-1, and
``usage`` counts the prompt once (the choices share it) and every choice's completion tokens.
Streamed: the choices' chunks interleave as their tokens come, each with its ``index``; each
chunk's SSE id is the cursor of every choice (``"i0,i1,..."``: the last token index sent per
choice, -1 for none), so ``Last-Event-ID`` resumes each choice where it was (and
``GET /v1/requests/<id>.<i>/events`` resumes one choice alone).

Every choice ends exactly once: a choice that ends other than ``done`` ends the answer (an
error, as for one choice) and the others are cancelled; a client that leaves cancels them all
(or leaves them running, per ``X-On-Disconnect``); a crashed worker's choices are resumed like
any request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from sse_starlette import ServerSentEvent

from tokenfleet.producer.async_handle import AsyncHandle
from tokenfleet.producer.gateway.responses import Framing, collect, stream_error
from tokenfleet.producer.gateway.streams import StreamState
from tokenfleet.producer.gateway.tool_stream import ToolStream
from tokenfleet.shared.errors import RedisUnavailable, RequestLost
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent


def _data(obj: object) -> str:
    return orjson.dumps(obj).decode()


def parse_cursor(value: str | None, n: int) -> list[int]:
    """The index each choice continues from after ``Last-Event-ID: value`` (all 0 when absent
    or not a cursor of ``n`` choices: an unknown position replays rather than skips)."""
    parts = (value or "").strip().split(",")
    try:
        cursor = [int(p) + 1 for p in parts]
    except ValueError:
        return [0] * n
    if len(cursor) != n or any(c < 0 for c in cursor):
        return [0] * n
    return cursor


def combined_usage(terminals: Sequence[TerminalEvent]) -> dict[str, int]:
    """OpenAI's usage of several choices: the shared prompt once, every completion token."""
    prompt = int(terminals[0].usage.get("prompt_tokens", 0)) if terminals else 0
    completion = sum(int(t.usage.get("completion_tokens", t.num_tokens)) for t in terminals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def combined_terminal(request_id: str, terminals: Sequence[TerminalEvent]) -> TerminalEvent:
    """One ``done`` terminal standing for all the choices (what the key's TPM is settled by)."""
    usage = combined_usage(terminals)
    return TerminalEvent(
        request_id,
        TerminalStatus.DONE,
        num_tokens=sum(t.num_tokens for t in terminals),
        finish_reason=terminals[0].finish_reason if terminals else None,
        usage={k: usage[k] for k in ("prompt_tokens", "completion_tokens")},
    )


async def collect_all(
    handles: Sequence[AsyncHandle], cancel: Any
) -> tuple[list[tuple[list[TokenEvent], TerminalEvent]], TerminalEvent | None]:
    """Every choice read to its end, in order, and the first end that was not ``done`` (None
    when all were): at that end the other choices are cancelled (``cancel(request_id)``), so
    the wait is short and each still ends once."""
    tasks = [asyncio.ensure_future(collect(h)) for h in handles]
    failed: TerminalEvent | None = None
    try:
        for next_done in asyncio.as_completed(tasks):
            _, terminal = await next_done
            if terminal.status is not TerminalStatus.DONE and failed is None:
                failed = terminal
                await _cancel_others(handles, terminal.request_id, cancel)
        return [t.result() for t in tasks], failed
    finally:
        for t in tasks:
            t.cancel()


async def _cancel_others(handles: Sequence[AsyncHandle], request_id: str, cancel: Any) -> None:
    for h in handles:
        if h.request_id != request_id:
            await cancel(h.request_id)


def whole_response(
    framing: Framing, results: Sequence[tuple[list[TokenEvent], TerminalEvent]]
) -> dict[str, Any]:
    """The whole response of choices that all ended ``done``."""
    choices = [framing.choice(tokens, end, i) for i, (tokens, end) in enumerate(results)]
    return framing.whole(choices, combined_usage([end for _, end in results]))


class _Choice:
    """One choice of a stream: where its client is, and its chunks."""

    def __init__(self, framing: Framing, index: int, handle: AsyncHandle, from_index: int):
        self.framing, self.index, self.from_index = framing, index, from_index
        self.position = from_index - 1  # the last token index sent (-1: none)
        self.tools = ToolStream(framing, index=index, choice_id=handle.request_id)
        self.terminal: TerminalEvent | None = None

    def token_chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        """The chunks ``event`` makes that the client lacks."""
        if self.framing.tools:
            chunks = self.tools.feed(event)  # (fed from the first token: see ToolStream)
        else:
            chunks = [self.framing.chunk(event.text, token=event, index=self.index)]
        if event.index < self.from_index:
            return []
        self.position = event.index
        return chunks

    def end_chunks(self, event: TerminalEvent) -> list[dict[str, Any]]:
        """The chunks of its ``done`` end: what is left of a tools answer, its finish."""
        rest: list[dict[str, Any]] = []
        finish = event.finish_reason
        if self.framing.tools:
            rest, finish = self.tools.finish(event)
        return [*rest, self.framing.chunk("", finish, index=self.index)]


async def choice_events(
    handles: Sequence[AsyncHandle],
    framing: Framing,
    *,
    cursor: list[int],
    include_usage: bool,
    state: StreamState,
    cancel: Any,
) -> AsyncIterator[ServerSentEvent]:
    """SSE events of the choices from ``cursor`` on (module doc); the handles are closed when
    it ends, however it ends."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, handle: AsyncHandle) -> None:
        try:
            async for event in handle.stream(0 if framing.tools else cursor[i]):
                await queue.put((i, event))
        except (RequestLost, RedisUnavailable) as exc:
            await queue.put((i, exc))

    pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    choices = [_Choice(framing, i, h, cursor[i]) for i, h in enumerate(handles)]
    try:
        for c in choices:
            if c.from_index == 0 and framing.kind == "chat":
                yield ServerSentEvent(_data(framing.chunk("", role=True, index=c.index)))
        while any(c.terminal is None for c in choices):
            i, event = await queue.get()
            if isinstance(event, Exception):  # nothing more can come: say so, visibly
                state.ended = True
                err = {"error": {"message": str(event), "type": "server_error"}}
                yield ServerSentEvent(_data(err))
                return
            if isinstance(event, TokenEvent):
                for chunk in choices[i].token_chunks(event):
                    cursor_id = ",".join(str(c.position) for c in choices)
                    yield ServerSentEvent(_data(chunk), id=cursor_id)
                continue
            choices[i].terminal = event
            if event.status is not TerminalStatus.DONE:  # the answer fails: the rest stop
                state.ended, state.terminal = True, event
                await _cancel_others(handles, event.request_id, cancel)
                yield ServerSentEvent(_data(stream_error(event)))
                return
            for chunk in choices[i].end_chunks(event):
                yield ServerSentEvent(_data(chunk))
        ends = [c.terminal for c in choices if c.terminal is not None]
        state.ended, state.terminal = True, combined_terminal(framing.request_id, ends)
        if include_usage:
            yield ServerSentEvent(_data(framing.chunk(None, usage=combined_usage(ends))))
        yield ServerSentEvent("[DONE]")
    finally:
        for p in pumps:
            p.cancel()
        for h in handles:
            h.close()
