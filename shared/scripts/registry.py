"""Running Lua scripts: registered once per connection, one reply convention, one error mapping.

Every script returns an array whose first element is a status code. ``"ok"`` (and any code the
script lists in ``ok_codes``) is success; any other code is mapped to an exception through
``ERROR_CODES`` with the array's second element as the message. A code nobody knows raises
``ScriptError`` (a producer and a server-side script of different versions).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from tokenfleet.shared.errors import (
    IdempotencyConflict,
    InvalidRequest,
    ModelNotServed,
    Overloaded,
    PoolError,
    ScriptError,
    TokenfleetError,
    UnknownRequest,
)

ERROR_CODES: dict[str, type[TokenfleetError]] = {
    "overloaded": Overloaded,
    "invalid": InvalidRequest,
    "conflict": IdempotencyConflict,
    "unserved": ModelNotServed,
    "unknown": UnknownRequest,
    "pool": PoolError,
}

KeyOrArg = str | bytes | int | float


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A Lua script constant. ``source`` starts with its KEYS/ARGV header comment."""

    name: str
    source: str
    ok_codes: frozenset[str] = field(default_factory=lambda: frozenset({"ok"}))


_INCLUDE = re.compile(r"^-- @include ([\w.-]+\.lua)[ \t]*$", re.MULTILINE)


def _own_text(package: str, filename: str) -> str:
    return resources.files(package).joinpath(filename).read_text(encoding="utf-8")


def _expand(package: str, text: str) -> str:
    return _INCLUDE.sub(lambda m: read_lua(package, m.group(1)).rstrip("\n"), text)


def read_lua(package: str, filename: str) -> str:
    """The text of ``filename`` in ``package``'s folder, each ``-- @include NAME.lua`` line
    replaced by that file's text (from the same folder, recursively). Includes hold shared
    ``local function`` definitions; a script keeps its own KEYS/ARGV header first."""
    return _expand(package, _own_text(package, filename))


def load_lua(
    package: str, filename: str, *, ok_codes: Sequence[str] = (), name: str | None = None
) -> LuaScript:
    """A :class:`LuaScript` from a ``.lua`` file shipped in ``package``; its name is the file's
    stem unless ``name`` is given. The file must open with its own ``-- KEYS``/``-- ARGV``
    header (a script that takes neither says ``-- KEYS: none``; an include's header does not
    count): a script without one is refused here, at import time, not when it first runs."""
    text = _own_text(package, filename)
    first = next((line for line in text.splitlines() if line.strip()), "")
    if not first.startswith(("-- KEYS", "-- ARGV")):
        raise ValueError(f"{package}/{filename} must open with its -- KEYS/ARGV header comment")
    stem = filename.removesuffix(".lua")
    return LuaScript(
        name=name or stem, source=_expand(package, text), ok_codes=frozenset({"ok", *ok_codes})
    )


# client -> {script name -> redis-py Script object}; weak so closed clients are forgotten.
_registered: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _script_for(client: Any, script: LuaScript) -> Any:
    per_client = _registered.setdefault(client, {})
    obj = per_client.get(script.name)
    if obj is None:
        # register_script hashes once; calls use EVALSHA and reload on NOSCRIPT.
        obj = per_client[script.name] = client.register_script(script.source)
    return obj


def _text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def check_reply(script: LuaScript, reply: Any) -> list[Any]:
    """Map a script's reply to its values (status code first) or raise the mapped error."""
    if not isinstance(reply, list) or not reply:
        raise ScriptError(f"script {script.name} returned {reply!r}, expected [code, ...]")
    code = _text(reply[0])
    if code == "ok" or code in script.ok_codes:
        return [code, *reply[1:]]
    message = _text(reply[1]) if len(reply) > 1 else code
    error = ERROR_CODES.get(code)
    if error is None:
        raise ScriptError(f"script {script.name} returned unknown code {code!r}: {message}")
    raise error(message)


def call(
    client: Any, script: LuaScript, keys: Sequence[KeyOrArg], args: Sequence[KeyOrArg]
) -> list[Any]:
    """Run ``script`` on a sync client and return its checked reply."""
    return check_reply(script, _script_for(client, script)(keys=list(keys), args=list(args)))


async def acall(
    client: Any, script: LuaScript, keys: Sequence[KeyOrArg], args: Sequence[KeyOrArg]
) -> list[Any]:
    """Run ``script`` on an asyncio client and return its checked reply."""
    reply = await _script_for(client, script)(keys=list(keys), args=list(args))
    return check_reply(script, reply)


def queue(
    client: Any,
    pipeline: Any,
    script: LuaScript,
    keys: Sequence[KeyOrArg],
    args: Sequence[KeyOrArg],
) -> None:
    """Add ``script`` to ``pipeline`` (created from ``client``); check its reply with
    :func:`check_reply` once the pipeline has executed."""
    _script_for(client, script)(keys=list(keys), args=list(args), client=pipeline)


async def aqueue(
    client: Any,
    pipeline: Any,
    script: LuaScript,
    keys: Sequence[KeyOrArg],
    args: Sequence[KeyOrArg],
) -> None:
    """:func:`queue` for an asyncio pipeline (queuing a script there is a coroutine)."""
    await _script_for(client, script)(keys=list(keys), args=list(args), client=pipeline)
