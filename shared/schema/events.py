"""The events on a request's channel (and in its token list): tokens, then one terminal event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenfleet.shared.errors import ProtocolError
from tokenfleet.shared.schema.fields import is_int
from tokenfleet.shared.schema.status import TerminalStatus
from tokenfleet.shared.schema.wire import SCHEMA_VERSION, loads

MAX_EVENT_BYTES = 65_536


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token. ``index`` counts from 0 per request, gap-free and unique.

    ``text`` is the text released with this token (possibly ""); the concatenation of all texts
    in index order is the request's final text. ``logprobs`` (requests that asked for them) is
    OpenAI's per-token object: ``{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}, ...]}`` (:func:`check_logprobs`); written only when set.
    """

    request_id: str
    index: int
    token_id: int
    text: str
    logprobs: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        out = {
            "v": SCHEMA_VERSION,
            "type": "token",
            "id": self.request_id,
            "index": self.index,
            "token_id": self.token_id,
            "text": self.text,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out

    def encode(self) -> bytes:
        """orjson bytes."""
        return orjson.dumps(self.to_dict())


@dataclass(frozen=True, slots=True)
class TerminalEvent:
    """The last event of a request: how it ended.

    ``num_tokens`` is the number of token events that precede it (indices 0..num_tokens-1), so
    a reader can tell it has seen everything. ``finish_reason`` is ``stop`` or ``length`` for
    ``done``; ``code`` equals the status except for ``error``, where it is specific
    (``worker_lost``, ``prompt_too_long``, ``invalid_request``, ...).
    """

    request_id: str
    status: TerminalStatus
    num_tokens: int = 0
    finish_reason: str | None = None
    code: str | None = None
    message: str | None = None
    usage: dict[str, int] = field(default_factory=dict)  # prompt_tokens, completion_tokens
    timings: dict[str, float] = field(default_factory=dict)  # queue_s, ttft_s, tpot_s, e2e_s

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", TerminalStatus(self.status))
        if self.code is None:
            object.__setattr__(self, "code", self.status.value)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "v": SCHEMA_VERSION,
            "type": self.status.value,
            "id": self.request_id,
            "num_tokens": self.num_tokens,
            "finish_reason": self.finish_reason,
            "code": self.code,
            "message": self.message,
            "usage": self.usage,
            "timings": self.timings,
        }

    def encode(self) -> bytes:
        """orjson bytes."""
        return orjson.dumps(self.to_dict())


Event = TokenEvent | TerminalEvent


def _entry_ok(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("token"), str)
        and isinstance(entry.get("logprob"), int | float)
        and isinstance(entry.get("bytes"), list)
    )


def check_logprobs(value: Any) -> bool:
    """Whether ``value`` is a token's logprobs object as workers write it (shape and types; at
    most 20 alternatives)."""
    if not _entry_ok(value):
        return False
    top = value.get("top_logprobs")
    return isinstance(top, list) and len(top) <= 20 and all(_entry_ok(e) for e in top)


def decode_event(data: bytes | str, max_bytes: int = MAX_EVENT_BYTES) -> Event:
    """Parse and validate one channel message or stored token event; ``ProtocolError`` if bad."""
    raw = loads(data, max_bytes, "event")
    if raw.get("v") != SCHEMA_VERSION:
        raise ProtocolError(f"event schema version {raw.get('v')!r} is not supported")
    kind = raw.get("type")
    rid = raw.get("id")
    if not isinstance(rid, str):
        raise ProtocolError("event has no request id")
    if kind == "token":
        index, token_id, text = raw.get("index"), raw.get("token_id"), raw.get("text")
        if not (is_int(index) and index >= 0 and is_int(token_id) and isinstance(text, str)):
            raise ProtocolError(f"malformed token event for {rid}")
        logprobs = raw.get("logprobs")
        if logprobs is not None and not check_logprobs(logprobs):
            raise ProtocolError(f"malformed logprobs in token event {index} of {rid}")
        return TokenEvent(rid, index, token_id, text, logprobs)
    try:
        status = TerminalStatus(str(kind))
    except ValueError:
        raise ProtocolError(f"unknown event type {kind!r}") from None
    num_tokens = raw.get("num_tokens", 0)
    usage, timings = raw.get("usage") or {}, raw.get("timings") or {}
    if not is_int(num_tokens) or not isinstance(usage, dict) or not isinstance(timings, dict):
        raise ProtocolError(f"malformed {kind} event for {rid}")
    for name in ("finish_reason", "code", "message"):
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise ProtocolError(f"malformed {kind} event for {rid}: {name} must be a string")
    return TerminalEvent(
        request_id=rid,
        status=status,
        num_tokens=num_tokens,
        finish_reason=raw.get("finish_reason"),
        code=raw.get("code"),
        message=raw.get("message"),
        usage=usage,
        timings=timings,
    )
