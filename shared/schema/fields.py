"""Checks of single field values, shared by requests, sampling parameters and events.

Each returns the value it accepts (or a bool) or raises ``InvalidRequest`` naming the field.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from tokenfleet.shared.errors import InvalidRequest


def is_int(value: Any) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids_ok(ids: tuple[Any, ...]) -> bool:
    """Every element an int (not a bool) in [0, 2**31). The common all-``int`` case is checked
    in C (``map``, ``min``, ``max``): the per-element Python test was most of a submit's
    validation time, and the worker repeats it when it decodes the entry."""
    if set(map(type, ids)) == {int}:
        return min(ids) >= 0 and max(ids) < 2**31
    return all(is_int(t) and 0 <= t < 2**31 for t in ids)


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
