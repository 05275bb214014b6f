"""tokenfleet events → OpenAI response objects and stream chunks (plain dicts, JSON-ready).

A :class:`Framing` holds what every object of one request repeats (id, created, model, kind),
so a resumed stream is framed exactly as the original: ``created`` is the request's enqueue
time (whole seconds) and ``id`` its request id, wherever the stream is served from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet.producer.gateway.errors import ApiError, error_body
from tokenfleet.producer.gateway.identity import Kind
from tokenfleet.shared.schema import TerminalEvent

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
    ) -> dict[str, Any]:
        """One stream chunk: ``text`` (None: the usage chunk, which has no choices)."""
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
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ]
        else:
            out["choices"] = [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            ]
        if usage is not None:
            out["usage"] = usage
        return out

    def response(self, text: str, terminal: TerminalEvent) -> dict[str, Any]:
        """The whole (non-streaming) response of a request that ended ``done``."""
        choice: dict[str, Any]
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": terminal.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": terminal.finish_reason,
            }
        return {
            "id": self.request_id,
            "object": self._object(False),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_of(terminal),
        }


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
