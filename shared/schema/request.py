"""The request as it travels on a stream: one prompt form, sampling, routing, deadline.

Building one from user input raises ``InvalidRequest`` with a message that names the field,
before anything touches Redis; decoding a stream payload raises ``ProtocolError``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenfleet.shared.errors import InvalidRequest, ProtocolError
from tokenfleet.shared.keys import check_model_name, check_request_id
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema.fields import check_text, token_ids_ok
from tokenfleet.shared.schema.sampling import SamplingParams
from tokenfleet.shared.schema.tools import MESSAGE_KEYS, check_tool_message
from tokenfleet.shared.schema.wire import SCHEMA_VERSION, loads

MAX_METADATA_BYTES = 16_384

# What the fingerprint leaves out: the span from the top-level "deadline" key to the "prompt"
# key, i.e. the two times a retry legitimately changes (``enqueued_at`` is the submit time;
# ``deadline`` is the submit time + ``deadline_s``). to_dict() writes them right after the id,
# model and priority (strings of a restricted charset) and before every field a caller fills
# with free JSON (prompt, messages, a schema in sampling, metadata), so the first occurrence of
# each marker is the top-level key.
_FP_CUT_START = b',"deadline":'
_FP_CUT_END = b',"prompt":'


def request_fingerprint(payload: bytes) -> str:
    """The idempotency fingerprint of an encoded request (``GenerationRequest.encode()``).

    128-bit BLAKE2b, hex, of the payload without its ``deadline`` and ``enqueued_at`` fields:
    two submits of the same request at different times (with the same relative ``deadline_s``
    or a different one) share a fingerprint; any other difference — prompt, messages, sampling,
    model, priority, metadata — gives another. Works on the bytes, so ``submit`` and
    ``submit_many`` (which encodes by template, byte-identically) agree without decoding.
    """
    start = payload.find(_FP_CUT_START)
    end = payload.find(_FP_CUT_END, start) if start >= 0 else -1
    if start < 0 or end < 0:  # not our encoder's layout: the whole payload
        return hashlib.blake2b(payload, digest_size=16).hexdigest()
    return hashlib.blake2b(payload[:start] + payload[end:], digest_size=16).hexdigest()


def _check_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """Each message is ``{role, content}``, plus an assistant's ``tool_calls`` or a tool
    result's ``tool_call_id`` (``tools.check_tool_message``); ``name`` is dropped (not used)."""
    if not isinstance(messages, list | tuple) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - MESSAGE_KEYS or "role" not in m:
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'")
        role = check_text(f"messages[{i}].role", m["role"])
        content = check_text(f"messages[{i}].content", m.get("content") or "")
        if not role:
            raise InvalidRequest(f"messages[{i}].role is empty")
        message: dict[str, Any] = {"role": role, "content": content}
        message.update(check_tool_message(i, m))  # nothing for a plain message: encoded as before
        out.append(message)
    if not any(m["content"] or m.get("tool_calls") for m in out):
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
    messages: tuple[dict[str, Any], ...] | None = None
    priority: Priority = Priority.NORMAL
    model: str = "default"
    deadline: float | None = None
    enqueued_at: float = 0.0
    metadata: dict[str, Any] | None = None

    def __post_init__(self) -> None:  # noqa: C901, PLR0912 (one check per field, in order)
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
            if not token_ids_ok(ids):
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
            "deadline": self.deadline,  # the times first: request_fingerprint relies on it
            "enqueued_at": self.enqueued_at,
            "prompt": self.prompt,
            "prompt_token_ids": (
                list(self.prompt_token_ids) if self.prompt_token_ids is not None else None
            ),
            "messages": list(self.messages) if self.messages is not None else None,
            "sampling": self.sampling.to_dict(),
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
        raw = loads(data, max_bytes, "request")
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
