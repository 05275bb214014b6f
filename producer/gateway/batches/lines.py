"""One batch input line: its validation, its submission, and the output / error lines it makes.

A line is valid when it is a JSON object with a string ``custom_id`` (unique in the file),
``method`` ``POST``, ``url`` equal to the batch's endpoint, and a ``body`` that is a valid
OpenAI body for that endpoint (the gateway's own pydantic models and submission builders: the
same checks, the same messages). ``stream: true`` is refused (a batch answers whole bodies);
``priority`` in a body is refused unless it is ``batch`` (every line runs at ``batch``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError

from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.producer.gateway.identity import Kind
from tokenfleet.producer.gateway.openai_api import (
    ChatBody,
    CompletionBody,
    Submission,
    chat_submission,
    completion_submission,
)

ENDPOINTS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
DEFAULT_MAX_LINE_BYTES = 1024 * 1024


class LineError(Exception):
    """Why a line is invalid: an OpenAI error code and a message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Line:
    """A parsed input line."""

    custom_id: str | None
    body: dict[str, Any]


def parse_line(text: str, endpoint: str, max_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Line:
    """The line as JSON, checked except for its body (``LineError``). ``custom_id`` may be
    None only when the error is raised (an error line carries what was readable)."""
    if len(text.encode("utf-8")) > max_bytes:
        raise LineError("line_too_large", f"the line is over the limit of {max_bytes} bytes")
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise LineError("invalid_json", f"the line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_json", "the line is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "the line has no string custom_id")
    if obj.get("method") != "POST":
        raise LineError("invalid_method", f"method must be 'POST', got {obj.get('method')!r}")
    if obj.get("url") != endpoint:
        raise LineError(
            "invalid_url", f"url must be the batch's endpoint {endpoint!r}, got {obj.get('url')!r}"
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "the line has no JSON object body")
    return Line(custom_id, body)


def custom_id_of(text: str) -> str | None:
    """The line's custom_id if it can be read (for an invalid line's error line)."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    value = obj.get("custom_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None


def submission(endpoint: str, body: dict[str, Any], default_max_tokens: int) -> Submission:
    """The body as a submission (``LineError`` with the gateway's reason when invalid)."""
    try:
        if ENDPOINTS[endpoint] == "chat":
            sub = chat_submission(ChatBody.model_validate(body), default_max_tokens)
        else:
            sub = completion_submission(CompletionBody.model_validate(body))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise LineError("invalid_body", f"body.{where}: {first['msg']}") from None
    except ApiError as exc:
        raise LineError(exc.code or "invalid_body", exc.message) from None
    if sub.stream:
        raise LineError("invalid_body", "stream: true is not supported in a batch")
    if sub.n > 1:
        raise LineError(
            "unsupported_parameter", "n > 1 is not supported in a batch: one line a choice"
        )
    if sub.priority not in (None, "batch"):
        raise LineError("invalid_body", "every batch line runs at priority 'batch'")
    return sub


def line_id(batch_id: str, index: int) -> str:
    """The output line's ``batch_req_`` id: derived from (batch, index), so a line written
    twice (which the ledger prevents) would at least carry the same id."""
    digest = hashlib.blake2b(f"{batch_id}-{index}".encode(), digest_size=12).hexdigest()
    return "batch_req_" + digest


def request_id(batch_id: str, index: int) -> str:
    """The fleet request id of line ``index``: deterministic, so a resubmit is idempotent."""
    return f"{batch_id}-{index}"


def output_line(batch_id: str, index: int, custom_id: str, rid: str, body: dict[str, Any]) -> str:
    """An output-file line (a request that ended done)."""
    out = {
        "id": line_id(batch_id, index),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": rid, "body": body},
        "error": None,
    }
    return orjson.dumps(out).decode()


def error_line(
    batch_id: str,
    index: int,
    custom_id: str | None,
    code: str,
    message: str,
    response: dict[str, Any] | None = None,
) -> str:
    """An error-file line: ``response`` is None for a line that never ran."""
    out = {
        "id": line_id(batch_id, index),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message},
    }
    return orjson.dumps(out).decode()
