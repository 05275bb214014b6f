"""The wire format: the schema version every payload carries, and the one JSON reader.

Every payload is a JSON object encoded with orjson and carries ``"v": SCHEMA_VERSION``.
:func:`loads` checks the size before parsing and never evaluates or unpickles anything.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenfleet.shared.errors import ProtocolError

SCHEMA_VERSION = 1


def loads(data: bytes | str, max_bytes: int, what: str) -> dict[str, Any]:
    """The JSON object in ``data``; ``ProtocolError`` (naming ``what``) if it is over
    ``max_bytes``, not JSON, or not an object."""
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
