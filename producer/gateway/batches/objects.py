"""The Batch API's objects (``FileObject``, ``BatchObject``) and its errors.

Both objects are read from their Redis hash (strings; JSON for ``metadata`` and ``errors``)
and answered in OpenAI's shape by ``to_dict()``. The errors are ``ApiError`` subclasses, so the
HTTP routes answer them as they are (404, 413, 400, 409).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from tokenfleet.producer.gateway.errors import ApiError

RedisHash = dict[Any, Any]  # fields for HSET (redis-py types the mapping invariantly)
FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})


class LeaseLost(Exception):
    """Another runner (or validating gateway) holds the batch's lease now."""


class NotFound(ApiError):
    """An unknown file or batch id (404)."""

    def __init__(self, what: str, object_id: str) -> None:
        super().__init__(404, f"no {what} with id '{object_id}'", code="not_found")


class FileTooLarge(ApiError):
    """An upload over ``FileStore.max_bytes`` (413)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            413,
            f"the file is {size} bytes; the limit is {limit} bytes",
            code="file_too_large",
            param="file",
        )


def _s(raw: dict[Any, Any], name: str) -> str | None:
    value = raw.get(name.encode())
    return value.decode() if value is not None and value != b"" else None


def _i(raw: dict[Any, Any], name: str) -> int | None:
    value = _s(raw, name)
    return int(value) if value is not None else None


@dataclass(frozen=True, slots=True)
class FileObject:
    """One file: an uploaded input, or a batch's output or error file."""

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    kind: str  # input | output | error
    batch_id: str | None = None

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> FileObject:
        """The object from its hash (as HGETALL returns it)."""
        return cls(
            id=_s(raw, "id") or "",
            purpose=_s(raw, "purpose") or "",
            filename=_s(raw, "filename") or "",
            bytes=_i(raw, "bytes") or 0,
            created_at=_i(raw, "created_at") or 0,
            kind=_s(raw, "kind") or "input",
            batch_id=_s(raw, "batch_id"),
        )

    def to_hash(self) -> RedisHash:
        """The hash's fields."""
        out: RedisHash = {
            "id": self.id,
            "purpose": self.purpose,
            "filename": self.filename,
            "bytes": self.bytes,
            "created_at": self.created_at,
            "kind": self.kind,
        }
        if self.batch_id is not None:
            out["batch_id"] = self.batch_id
        return out

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",  # deprecated by OpenAI, still sent
            "status_details": None,
        }


_TIMES = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


@dataclass(frozen=True, slots=True)
class BatchObject:
    """One batch, as its hash holds it. ``next_line`` and the ledger are the runner's."""

    id: str
    status: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, Any] | None
    created_at: int
    expires_at: int
    times: dict[str, int]  # the *_at of _TIMES that happened
    total: int
    completed: int
    failed: int
    next_line: int
    output_file_id: str | None
    error_file_id: str | None
    errors: list[dict[str, Any]] | None
    out_id: str = ""  # where the runner writes output lines (exposed once final)
    err_id: str = ""  # where invalid lines and failed requests go
    tenant: str = "default"  # whose requests its lines are (the creating key's tenant)

    @property
    def final(self) -> bool:
        """Whether the batch reached a final status."""
        return self.status in FINAL_STATUSES

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> BatchObject:
        """The object from its hash."""
        meta = _s(raw, "metadata")
        errors = _s(raw, "errors")
        return cls(
            id=_s(raw, "id") or "",
            status=_s(raw, "status") or "validating",
            endpoint=_s(raw, "endpoint") or "",
            input_file_id=_s(raw, "input_file_id") or "",
            completion_window=_s(raw, "completion_window") or "24h",
            metadata=orjson.loads(meta) if meta else None,
            created_at=_i(raw, "created_at") or 0,
            expires_at=_i(raw, "expires_at") or 0,
            times={t: v for t in _TIMES if (v := _i(raw, t)) is not None},
            total=_i(raw, "total") or 0,
            completed=_i(raw, "completed") or 0,
            failed=_i(raw, "failed") or 0,
            next_line=_i(raw, "next_line") or 0,
            output_file_id=_s(raw, "output_file_id"),
            error_file_id=_s(raw, "error_file_id"),
            errors=orjson.loads(errors) if errors else None,
            out_id=_s(raw, "out_id") or "",
            err_id=_s(raw, "err_id") or "",
            tenant=_s(raw, "tenant") or "default",
        )

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        out: dict[str, Any] = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }
        for name in _TIMES:
            out[name] = self.times.get(name)
        return out
