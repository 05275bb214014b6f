"""The wire schema: requests on the streams and events on the per-request channels.

Everything is JSON encoded with orjson and carries ``"v": SCHEMA_VERSION``. Decoding checks the
size before parsing, then every field, and raises ``ProtocolError`` naming the fault; it never
evaluates or unpickles anything. Building a request from user input raises ``InvalidRequest``
with a message that names the field, before anything touches Redis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeGuard

import orjson

from tokenfleet.shared.errors import InvalidRequest, ProtocolError
from tokenfleet.shared.keys import check_model_name, check_request_id
from tokenfleet.shared.priority import Priority

SCHEMA_VERSION = 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_METADATA_BYTES = 16_384
MAX_EVENT_BYTES = 65_536
MAX_SEED = 2**63 - 1


class TerminalStatus(StrEnum):
    """The five ways a request ends; exactly one is reached per accepted request."""

    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    DROPPED = "dropped"
    ERROR = "error"


class RequestStatus(StrEnum):
    """Every status a durable record can show: two live ones, then the terminal ones."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    DROPPED = "dropped"
    ERROR = "error"

    @property
    def is_terminal(self) -> bool:
        """True for the five end states."""
        return self not in (RequestStatus.QUEUED, RequestStatus.RUNNING)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids_ok(ids: tuple[Any, ...]) -> bool:
    """Every element an int (not a bool) in [0, 2**31). The common all-``int`` case is checked
    in C (``map``, ``min``, ``max``): the per-element Python test was most of a submit's
    validation time, and the worker repeats it when it decodes the entry."""
    if set(map(type, ids)) == {int}:
        return min(ids) >= 0 and max(ids) < 2**31
    return all(_is_int(t) and 0 <= t < 2**31 for t in ids)


def check_text(name: str, value: Any) -> str:
    """Return ``value`` if it is a str encodable as UTF-8 (bytes are decoded strictly)."""
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"{name} is not valid UTF-8 (byte {exc.start})") from None
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{name} is not valid UTF-8 (lone surrogate at {exc.start})") from None
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample; validated on construction (``InvalidRequest`` names the field).

    ``temperature == 0`` means greedy; ``top_k == 0`` disables top-k; ``top_p`` is in (0, 1].
    ``max_tokens`` is checked against the fleet's limit by :meth:`check_limit`.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidRequest(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InvalidRequest(f"{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequest(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for s in stop:
            check_text("stop string", s)
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest(
                    f"stop strings must be 1-{MAX_STOP_STRING_CHARS} characters, got {s!r}"
                )
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise InvalidRequest(f"stop_token_ids must be integers >= 0, got {list(ids)!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def check_limit(self, max_tokens_limit: int) -> None:
        """Raise ``InvalidRequest`` if ``max_tokens`` exceeds the fleet's limit."""
        if self.max_tokens > max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens {self.max_tokens} is above the limit of {max_tokens_limit}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }

    @classmethod
    def from_dict(cls, data: Any) -> SamplingParams:
        """Inverse of :meth:`to_dict`; unknown keys are an ``InvalidRequest``."""
        if not isinstance(data, dict):
            raise InvalidRequest("sampling must be an object")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return cls(**data)


def _check_messages(messages: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list | tuple) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m:
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'")
        role = check_text(f"messages[{i}].role", m["role"])
        content = check_text(f"messages[{i}].content", m.get("content", ""))
        if not role:
            raise InvalidRequest(f"messages[{i}].role is empty")
        out.append({"role": role, "content": content})
    if not any(m["content"] for m in out):
        raise InvalidRequest("messages have no content")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as it travels on a stream. Exactly one of prompt / prompt_token_ids / messages.

    Times are epoch seconds. ``deadline`` is the time by which the request must have started.
    """

    request_id: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None
    priority: Priority = Priority.NORMAL
    model: str = "default"
    deadline: float | None = None
    enqueued_at: float = 0.0
    metadata: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        check_model_name(self.model)
        object.__setattr__(self, "priority", Priority.parse(self.priority))
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequest("sampling must be SamplingParams")
        given = [
            n for n in ("prompt", "prompt_token_ids", "messages") if getattr(self, n) is not None
        ]
        if len(given) != 1:
            raise InvalidRequest(
                "give exactly one of prompt, prompt_token_ids or messages"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.prompt is not None:
            prompt = check_text("prompt", self.prompt)
            if not prompt:
                raise InvalidRequest("prompt is empty")
            object.__setattr__(self, "prompt", prompt)
        if self.prompt_token_ids is not None:
            ids = tuple(self.prompt_token_ids)
            if not ids:
                raise InvalidRequest("prompt_token_ids is empty")
            if not _token_ids_ok(ids):
                raise InvalidRequest("prompt_token_ids must be integers in [0, 2**31)")
            object.__setattr__(self, "prompt_token_ids", ids)
        if self.messages is not None:
            object.__setattr__(self, "messages", _check_messages(self.messages))
        for name in ("deadline", "enqueued_at"):
            value = getattr(self, name)
            if value is None and name == "deadline":
                continue
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidRequest(f"{name} must be a number of epoch seconds, got {value!r}")
            if not math.isfinite(value):
                raise InvalidRequest(f"{name} must be finite")
            object.__setattr__(self, name, float(value))
        if self.metadata is not None:
            if not isinstance(self.metadata, dict):
                raise InvalidRequest("metadata must be a JSON object")
            try:
                size = len(orjson.dumps(self.metadata))
            except TypeError as exc:
                raise InvalidRequest(f"metadata is not JSON-serialisable: {exc}") from None
            if size > MAX_METADATA_BYTES:
                raise InvalidRequest(
                    f"metadata is {size} bytes encoded; the limit is {MAX_METADATA_BYTES}"
                )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, including the schema version."""
        return {
            "v": SCHEMA_VERSION,
            "id": self.request_id,
            "model": self.model,
            "priority": self.priority.label,
            "prompt": self.prompt,
            "prompt_token_ids": (
                list(self.prompt_token_ids) if self.prompt_token_ids is not None else None
            ),
            "messages": list(self.messages) if self.messages is not None else None,
            "sampling": self.sampling.to_dict(),
            "deadline": self.deadline,
            "enqueued_at": self.enqueued_at,
            "metadata": self.metadata,
        }

    def encode(self, max_bytes: int | None = None) -> bytes:
        """orjson bytes; ``InvalidRequest`` if over ``max_bytes``."""
        data = orjson.dumps(self.to_dict())
        if max_bytes is not None and len(data) > max_bytes:
            raise InvalidRequest(
                f"request is {len(data)} bytes encoded; the limit is {max_bytes} bytes"
            )
        return data

    @classmethod
    def decode(cls, data: bytes | str, max_bytes: int) -> GenerationRequest:
        """Parse and validate a stream payload.

        Raises:
            ProtocolError: oversize, not JSON, wrong version or invalid fields; its
                ``request_id`` is set when the id could be read, so the caller can still
                give that request a terminal ``error`` event.
        """
        raw = _loads(data, max_bytes, "request")
        rid = raw.get("id") if isinstance(raw.get("id"), str) else None
        try:
            rid = check_request_id(rid) if rid is not None else None
        except InvalidRequest:
            rid = None
        if raw.get("v") != SCHEMA_VERSION:
            raise ProtocolError(
                f"request schema version {raw.get('v')!r} is not supported (expected "
                f"{SCHEMA_VERSION})",
                request_id=rid,
            )
        expected = {
            "v",
            "id",
            "model",
            "priority",
            "prompt",
            "prompt_token_ids",
            "messages",
            "sampling",
            "deadline",
            "enqueued_at",
            "metadata",
        }
        unknown = set(raw) - expected
        if unknown:
            raise ProtocolError(
                f"unknown request field(s): {', '.join(sorted(unknown))}", request_id=rid
            )
        try:
            return cls(
                request_id=raw.get("id"),  # type: ignore[arg-type]
                sampling=SamplingParams.from_dict(raw.get("sampling", {})),
                prompt=raw.get("prompt"),
                prompt_token_ids=raw.get("prompt_token_ids"),
                messages=raw.get("messages"),
                priority=raw.get("priority", "normal"),
                model=raw.get("model", "default"),
                deadline=raw.get("deadline"),
                enqueued_at=raw.get("enqueued_at", 0.0),
                metadata=raw.get("metadata"),
            )
        except (InvalidRequest, TypeError) as exc:
            raise ProtocolError(f"invalid request: {exc}", request_id=rid) from None


def _loads(data: bytes | str, max_bytes: int, what: str) -> dict[str, Any]:
    size = len(data)
    if size > max_bytes:
        raise ProtocolError(f"{what} payload is {size} bytes; the limit is {max_bytes}")
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"{what} payload is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"{what} payload must be a JSON object, got {type(raw).__name__}")
    return raw


# -- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token. ``index`` counts from 0 per request, gap-free and unique.

    ``text`` is the text released with this token (possibly ""); the concatenation of all texts
    in index order is the request's final text.
    """

    request_id: str
    index: int
    token_id: int
    text: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "v": SCHEMA_VERSION,
            "type": "token",
            "id": self.request_id,
            "index": self.index,
            "token_id": self.token_id,
            "text": self.text,
        }

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


def decode_event(data: bytes | str, max_bytes: int = MAX_EVENT_BYTES) -> Event:
    """Parse and validate one channel message or stored token event; ``ProtocolError`` if bad."""
    raw = _loads(data, max_bytes, "event")
    if raw.get("v") != SCHEMA_VERSION:
        raise ProtocolError(f"event schema version {raw.get('v')!r} is not supported")
    kind = raw.get("type")
    rid = raw.get("id")
    if not isinstance(rid, str):
        raise ProtocolError("event has no request id")
    if kind == "token":
        index, token_id, text = raw.get("index"), raw.get("token_id"), raw.get("text")
        if not (_is_int(index) and index >= 0 and _is_int(token_id) and isinstance(text, str)):
            raise ProtocolError(f"malformed token event for {rid}")
        return TokenEvent(rid, index, token_id, text)
    try:
        status = TerminalStatus(str(kind))
    except ValueError:
        raise ProtocolError(f"unknown event type {kind!r}") from None
    num_tokens = raw.get("num_tokens", 0)
    usage, timings = raw.get("usage") or {}, raw.get("timings") or {}
    if not _is_int(num_tokens) or not isinstance(usage, dict) or not isinstance(timings, dict):
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
