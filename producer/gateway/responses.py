"""tokenfleet events → OpenAI response objects and stream chunks (plain dicts, JSON-ready).

A :class:`Framing` holds what every object of one request repeats (id, created, model, kind),
so a resumed stream is framed exactly as the original: ``created`` is the request's enqueue
time (whole seconds) and ``id`` its request id, wherever the stream is served from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet.producer.async_handle import AsyncHandle
from tokenfleet.producer.gateway.errors import ApiError, error_body
from tokenfleet.producer.gateway.identity import Kind
from tokenfleet.shared.schema import TerminalEvent, TokenEvent
from tokenfleet.shared.schema.tools import call_id, parse_calls

# How a request that did not end ``done`` is answered (non-streaming), by terminal status.
_FAILURE_STATUS = {"cancelled": 409, "expired": 504, "dropped": 429}
_CLIENT_ERROR_CODES = {"invalid_request", "prompt_too_long", "protocol_error"}


@dataclass(frozen=True, slots=True)
class Framing:
    """The repeated part of one request's response objects."""

    request_id: str
    kind: Kind
    model: str
    created: int
    tools: bool = False  # tools were offered: the text is read back into tool_calls

    def _object(self, chunk: bool) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        usage: dict[str, int] | None = None,
        token: TokenEvent | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        """One stream chunk of choice ``index``: ``text`` (None: the usage chunk, which has no
        choices); ``token``: the event it carries, whose logprobs (if any) the chunk carries in
        OpenAI's shape."""
        out: dict[str, Any] = {
            "id": self.request_id,
            "object": self._object(True),
            "created": self.created,
            "model": self.model,
        }
        if text is None:
            out["choices"] = []
        elif self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
            if text and not role:
                delta["content"] = text
            out["choices"] = [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": self.logprobs([token]) if token else None,
                    "finish_reason": finish_reason,
                }
            ]
        else:
            out["choices"] = [
                {
                    "index": index,
                    "text": text,
                    "logprobs": self.logprobs([token]) if token else None,
                    "finish_reason": finish_reason,
                }
            ]
        if usage is not None:
            out["usage"] = usage
        return out

    def logprobs(self, tokens: Sequence[TokenEvent]) -> dict[str, Any] | None:
        """The ``logprobs`` object of a choice with these tokens, in the endpoint's shape
        (None when they carry none: the request did not ask). Chat: ``{"content": [per-token
        objects], "refusal": None}``; completions: ``tokens``, ``token_logprobs``,
        ``top_logprobs`` (token -> logprob) and ``text_offset``."""
        entries = [t.logprobs for t in tokens if t.logprobs is not None]
        if not entries:
            return None
        if self.kind == "chat":
            return {"content": entries, "refusal": None}
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t.text)
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                {alt["token"]: alt["logprob"] for alt in e["top_logprobs"]} for e in entries
            ],
            "text_offset": offsets,
        }

    def tool_message(
        self, text: str, finish: str | None, choice_id: str | None = None
    ) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a tools request's output and its finish reason: its calls
        as ``tool_calls`` (``finish_reason: "tool_calls"`` when it ended ``stop``) and any
        text after them (none with the grammar; a call cut by ``length`` stays text) as
        ``content``; text that opens no call is the ``content``, as without tools. The call ids
        derive from ``choice_id`` (the choice's own request id; default: this request's)."""
        rid = choice_id or self.request_id
        calls, end = parse_calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        rest = text[end:].strip()
        message = {
            "role": "assistant",
            "content": rest or None,
            "tool_calls": [c.to_openai(call_id(rid, i)) for i, c in enumerate(calls)],
        }
        return message, "tool_calls" if finish == "stop" else finish

    def response(self, tokens: Sequence[TokenEvent], terminal: TerminalEvent) -> dict[str, Any]:
        """The whole (non-streaming) response of a request that ended ``done``, from its
        token events."""
        return self.whole([self.choice(tokens, terminal)], usage_of(terminal))

    def choice(
        self, tokens: Sequence[TokenEvent], terminal: TerminalEvent, index: int = 0
    ) -> dict[str, Any]:
        """Choice ``index`` of a whole response: the request ``terminal.request_id`` that
        ended ``done``, from its token events."""
        text = "".join(t.text for t in tokens)
        if self.kind != "chat":
            return {
                "index": index,
                "text": text,
                "logprobs": self.logprobs(tokens),
                "finish_reason": terminal.finish_reason,
            }
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = terminal.finish_reason
        if self.tools:
            message, finish = self.tool_message(text, finish, terminal.request_id)
        return {
            "index": index,
            "message": message,
            "logprobs": self.logprobs(tokens),
            "finish_reason": finish,
        }

    def whole(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        """The whole response object holding ``choices``."""
        return {
            "id": self.request_id,
            "object": self._object(False),
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }


async def collect(handle: AsyncHandle) -> tuple[list[TokenEvent], TerminalEvent]:
    """A request's token events and its terminal event, read to the end."""
    tokens: list[TokenEvent] = []
    async for event in handle.stream():
        if isinstance(event, TokenEvent):
            tokens.append(event)
        else:
            return tokens, event
    raise RuntimeError("a handle's stream ended without its terminal event")  # invariant


def usage_of(terminal: TerminalEvent) -> dict[str, int]:
    """OpenAI's usage object from a terminal event."""
    prompt = int(terminal.usage.get("prompt_tokens", 0))
    completion = int(terminal.usage.get("completion_tokens", terminal.num_tokens))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def used_tokens(terminal: TerminalEvent) -> int:
    """Prompt plus completion tokens: what an API key's TPM is finally charged."""
    return sum(int(terminal.usage.get(k, 0)) for k in ("prompt_tokens", "completion_tokens"))


def failure(terminal: TerminalEvent) -> ApiError:
    """The HTTP error for a request that ended other than ``done`` (names why)."""
    status_name = terminal.status.value
    code = terminal.code or status_name
    message = terminal.message or f"the request ended {status_name}"
    if status_name == "error":
        http = 400 if code in _CLIENT_ERROR_CODES else 500
    else:
        http = _FAILURE_STATUS.get(status_name, 500)
    return ApiError(http, f"request {terminal.request_id} {status_name}: {message}", code=code)


def stream_error(terminal: TerminalEvent) -> dict[str, Any]:
    """The SSE data that ends a stream whose request did not end ``done`` (the OpenAI SDKs
    raise ``APIError`` on a chunk holding ``error``)."""
    err = failure(terminal)
    return error_body(err.status, err.message, code=err.code)
