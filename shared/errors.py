"""Error types shared by the producer, the worker and the CLI.

Every error a caller can act on has its own class; each carries a stable ``code`` string that is
also what travels on the wire (terminal ``error`` events carry the same codes).
"""

from __future__ import annotations

import redis


class TokenfleetError(Exception):
    """Base class of every error tokenfleet raises on purpose."""

    code: str = "error"


class SettingsError(TokenfleetError, ValueError):
    """A setting (environment variable, URL, key prefix, CLI flag) is missing or malformed."""

    code = "bad_settings"


class InvalidRequest(TokenfleetError, ValueError):
    """The request was refused before anything touched Redis; the message names the field, and
    ``param`` (when set) is that field's name as an HTTP gateway reports it."""

    code = "invalid_request"

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class IdempotencyConflict(InvalidRequest):
    """A client-chosen ``request_id`` is already taken by a request with a different body.

    Resubmitting the *same* request (same prompt, sampling, model, priority, metadata; the
    submit time and deadline may differ) returns the existing request; anything else under that
    id is refused with this error, which names the id (``request_id``).
    """

    code = "idempotency_conflict"

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class ModelNotServed(InvalidRequest):
    """No live worker serves the request's model and the fleet does not declare it, in a fleet
    that declares models or has live workers (docs/models.md). Refused at submit,
    with nothing written to Redis; the message names what is served and declared.

    ``model`` is the refused request's model when the caller knew it. An HTTP gateway answers
    404 ``model_not_found``.
    """

    code = "model_not_found"

    def __init__(self, message: str, *, model: str | None = None) -> None:
        super().__init__(message)
        self.model = model


class ProtocolError(TokenfleetError, ValueError):
    """A payload read from Redis failed to decode or validate (size, JSON, schema, version).

    ``request_id`` is set when the payload's id could still be read, so the reader can give that
    request a terminal ``error`` event instead of leaving it to vanish.
    """

    code = "protocol_error"

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class Overloaded(TokenfleetError):
    """The target queue is full and its policy refused the request (or a wait timed out)."""

    code = "overloaded"


class AuthError(TokenfleetError):
    """An HTTP caller's API key is missing, malformed, unknown or revoked (the gateway answers
    401). The message says whether a key was missing or not accepted, never why it was not
    accepted, so it does not tell a caller which key ids exist."""

    code = "invalid_api_key"


class UnknownRequest(TokenfleetError, KeyError):
    """No durable record exists for this request id (never submitted, or its TTL lapsed)."""

    code = "unknown_request"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else self.code


class PoolError(TokenfleetError):
    """A shared KV pool refused an operation: it does not exist, exists with other settings,
    has no room for another member, or does not run on a manual clock."""

    code = "pool_error"


class ScriptError(TokenfleetError):
    """A Lua script returned a code this version does not know (a version mismatch)."""

    code = "script_error"


class RequestFailed(TokenfleetError):
    """A request ended in a terminal state other than ``done``.

    ``status`` is the terminal state (``cancelled``, ``expired``, ``dropped`` or ``error``),
    ``code`` the specific error code (equal to ``status`` except for ``error``), ``message``
    a sentence a person can act on.
    """

    def __init__(self, request_id: str, status: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id} {status}: [{code}] {message}")
        self.request_id = request_id
        self.status = status
        self.code = code
        self.message = message


# -- Redis outages (docs/redis-modes.md, "Redis outages") --------------------------------------
class RedisUnavailable(TokenfleetError, redis.ConnectionError):
    """Redis stayed unreachable for longer than ``Settings.redis_retry_s``: a handle gave up
    waiting (it retried with backoff until then). A ``redis.ConnectionError``, so code that
    caught that before still does."""

    code = "redis_unavailable"


class RequestLost(UnknownRequest):
    """The request's durable record vanished while it was being read: Redis lost its state
    (restarted without persistence, or flushed). Nothing more will come for it; submit again."""

    code = "request_lost"
