"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

``ApiError`` is raised anywhere in the gateway; the app's exception handlers turn it (and
FastAPI's validation errors, and the producer's ``TokenfleetError``s) into a JSON response with
the status code, the body and any headers (``Retry-After``, ``x-ratelimit-*``) it carries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenfleet.shared.errors import (
    IdempotencyConflict,
    InvalidRequest,
    Overloaded,
    RedisUnavailable,
    TokenfleetError,
    UnknownRequest,
)

# OpenAI's "type" for each status code we answer with.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An HTTP error answered in the OpenAI shape.

    ``headers`` travel with the response (``Retry-After`` on 429/503, ``x-ratelimit-*``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return error_body(self.status, self.message, code=self.code, param=self.param)


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` for ``status``."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def from_tokenfleet(exc: TokenfleetError) -> ApiError:
    """The HTTP answer to an error the producer raised (``Overloaded`` is the caller's: it
    needs a Retry-After only the caller can work out)."""
    if isinstance(exc, IdempotencyConflict):
        return ApiError(409, str(exc), code="idempotency_conflict", param="Idempotency-Key")
    if getattr(exc, "code", "") == "model_not_found":
        return ApiError(404, str(exc), code="model_not_found", param="model")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), code=exc.code, param=exc.param)
    if isinstance(exc, UnknownRequest):
        return ApiError(404, str(exc), code=exc.code)
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc), code="queue_full")
    if isinstance(exc, RedisUnavailable):
        return ApiError(503, str(exc), code=exc.code, headers={"Retry-After": "5"})
    return ApiError(500, str(exc), code=exc.code)
