"""``FileStore``: Batch API files in Redis — a hash for the object, a list for the lines.

Invariants: a file's content is its lines joined with ``"\\n"`` plus a final ``"\\n"``; blank
lines of an upload are not stored (JSONL has none; a trailing newline or ``\\r\\n`` endings are
common and harmless); ``bytes`` is the size of that content. Files are never changed after they
are written (an output file is written by the runner's ledger script while its batch runs, and
gets its object — and so becomes visible — only when the batch is final).
"""

from __future__ import annotations

import os
import time

import redis.asyncio

from tokenfleet.producer.gateway.batches.objects import FileObject, FileTooLarge, NotFound
from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.settings import Settings

DEFAULT_MAX_FILE_BYTES = 100 * 1024 * 1024  # OpenAI allows 200 MB; Redis holds it all in memory
_PUSH_CHUNK = 1000  # lines per RPUSH


def new_file_id() -> str:
    """A fresh ``file-<hex>`` id."""
    return "file-" + os.urandom(12).hex()


def split_lines(data: bytes) -> list[str]:
    """The non-blank lines of UTF-8 ``data`` (``\\r\\n`` accepted). ``ApiError`` 400 if the
    data is not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"the file is not UTF-8 ({exc.reason} at byte {exc.start})", param="file"
        ) from None
    return [line.rstrip("\r") for line in text.split("\n") if line.strip()]


def content_size(lines: list[str]) -> int:
    """Bytes of the content the lines make (each line plus its newline)."""
    return sum(len(line.encode("utf-8")) + 1 for line in lines)


class FileStore:
    """Create, read and delete Batch API files."""

    def __init__(
        self,
        redis: redis.asyncio.Redis,
        settings: Settings,
        *,
        max_bytes: int = DEFAULT_MAX_FILE_BYTES,
    ) -> None:
        self._r = redis
        self._keys = Keys.for_settings(settings)
        self.max_bytes = max_bytes

    async def create(self, purpose: str, filename: str, data: bytes) -> FileObject:
        """Store an upload. ``FileTooLarge`` (413) over ``max_bytes``; ``ApiError`` 400 for a
        purpose other than ``batch``, data that is not UTF-8, or a file without a line."""
        if len(data) > self.max_bytes:
            raise FileTooLarge(len(data), self.max_bytes)
        if purpose != "batch":
            raise ApiError(
                400,
                f"purpose must be 'batch', got {purpose!r}",
                code="invalid_purpose",
                param="purpose",
            )
        lines = split_lines(data)
        if not lines:
            raise ApiError(400, "the file has no line", param="file")
        obj = FileObject(
            id=new_file_id(),
            purpose=purpose,
            filename=filename,
            bytes=content_size(lines),
            created_at=int(time.time()),
            kind="input",
        )
        await self._write(obj, lines)
        return obj

    async def _write(self, obj: FileObject, lines: list[str]) -> None:
        # lines first, the object last: a file is visible only once complete
        pipe = self._r.pipeline(transaction=True)
        lines_key = self._keys.file_lines(obj.id)
        pipe.delete(lines_key)
        for start in range(0, len(lines), _PUSH_CHUNK):
            pipe.rpush(lines_key, *lines[start : start + _PUSH_CHUNK])
        pipe.hset(self._keys.file(obj.id), mapping=obj.to_hash())
        await pipe.execute()

    async def get(self, file_id: str) -> FileObject:
        """The file's object (``NotFound`` for an unknown id)."""
        raw = await self._r.hgetall(self._keys.file(file_id))
        if not raw:
            raise NotFound("file", file_id)
        return FileObject.from_hash(raw)

    async def lines(self, file_id: str) -> list[str]:
        """The file's lines (``NotFound`` for an unknown id)."""
        await self.get(file_id)
        return [
            as_str(b) or "" for b in await self._r.lrange(self._keys.file_lines(file_id), 0, -1)
        ]

    async def content(self, file_id: str) -> bytes:
        """The file's content: its lines, each ending with a newline."""
        return "".join(line + "\n" for line in await self.lines(file_id)).encode("utf-8")

    async def delete(self, file_id: str) -> FileObject:
        """Delete the file (``NotFound`` for an unknown id); its object as it was."""
        obj = await self.get(file_id)
        await self._r.delete(self._keys.file(file_id), self._keys.file_lines(file_id))
        return obj
