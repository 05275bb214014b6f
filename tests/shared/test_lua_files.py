"""Lua lives in ``.lua`` files, each opening with its KEYS/ARGV header, and takes its keys from
``KEYS[]``.

Three checks over the whole project (every package folder, so scripts added anywhere are seen):

* every ``.lua`` file opens with its ``-- KEYS`` / ``-- ARGV`` header (an include says
  ``-- KEYS: none``), and every script (a file no other file includes) is loaded by a Python
  module of its package;
* no Python module under ``shared/``, ``producer/``, ``worker/`` holds Lua (``redis.call``);
* every key a script hands to ``redis.call`` / ``redis.pcall`` comes from ``KEYS[]`` (see
  :func:`key_violations` for what the check follows and where it stops).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tokenfleet.shared.scripts.registry import read_lua

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = {
    "shared": "tokenfleet.shared",
    "producer": "tokenfleet.producer",
    "worker": "tokenfleet.worker",
}
# Names a script may use as keys although they are built inside it, per script file. enqueue.lua
# ends *waiting* requests it picks itself from the stream (drop-oldest eviction, reclaim past a
# deadline), so no caller can pass their keys (docs/protocol.md, "Keys in scripts").
# Tenant queues and the records of the requests admitted from them are picked inside the
# script too (tf_tenants.lua: the head of the tenant with the least virtual time), so enqueue.lua
# and worker_pull.lua build them from Keys' templates; the worker's PULL takes each queue's
# active-tenant set and tenant backlog in KEYS but through tables (``active``, ``backlog``), one
# per stream, and ends a request it meets past its deadline at admission, whose keys it builds
# the same way (``expired_*``). A request routed while it waited in a tenant queue is admitted
# into its worker's routed stream, which the script builds from the level's routed-stream name
# and the worker the entry names (``routed_stream``, tf_tenants.lua's tt_routed); an overflow
# worker's OVERFLOW admits from tenant queues as PULL does.
_TENANT_BUILT = frozenset({"queue", "rec", "routed_stream"})
# tf_tenants.lua's tt_expire (PULL's and OVERFLOW's end of a request met past its deadline at
# admission) builds that request's keys the same way; included but never called by enqueue.lua
# and finish.lua, whose tf_finish the check still follows it into
_EXPIRED_BUILT = frozenset({"expired_record", "expired_tokens", "expired_channel"})
KEYS_BUILT_IN_LUA = {
    "enqueue.lua": frozenset(
        {"victim_record", "victim_tokens", "victim_channel", "counted_stream", "tenant_queue"}
        | {"moved_record", "target"}
    )
    | _TENANT_BUILT
    | _EXPIRED_BUILT,
    "worker_pull.lua": _TENANT_BUILT | _EXPIRED_BUILT | {"active", "backlog"},
    "worker_overflow.lua": _TENANT_BUILT | _EXPIRED_BUILT | {"active", "backlog"},
    # (tf_tenants.lua's admission, included but never called there: the check, by name, cannot
    # tell that its `backlog` parameter only ever holds the callers' KEYS[])
    "finish.lua": _TENANT_BUILT | _EXPIRED_BUILT | {"backlog"},
}
_INCLUDE_LINE = re.compile(r"^-- @include ([\w.-]+\.lua)[ \t]*$", re.MULTILINE)
_HEADER = ("-- KEYS", "-- ARGV")


def lua_files() -> list[Path]:
    """Every .lua file in the package folders."""
    return sorted(p for folder in PACKAGE_FOLDERS for p in (ROOT / folder).rglob("*.lua"))


def included_names(folder: Path) -> set[str]:
    """File names that some .lua file of ``folder`` includes."""
    return {m.group(1) for p in folder.glob("*.lua") for m in _INCLUDE_LINE.finditer(p.read_text())}


def scripts() -> list[Path]:
    """The .lua files that are scripts (not only included by others)."""
    return [p for p in lua_files() if p.name not in included_names(p.parent)]


def package_of(path: Path) -> str:
    """The import name of the package folder holding ``path``."""
    rel = path.parent.relative_to(ROOT)
    return ".".join([PACKAGE_FOLDERS[rel.parts[0]], *rel.parts[1:]])


# -- reading Lua --------------------------------------------------------------------------------

_QUOTES = "'\""
_OPEN, _CLOSE = "([{", ")]}"


def strip_comments(source: str) -> str:
    """``source`` without ``--`` comments (strings kept). Long brackets (``[[``, ``--[[``) are
    refused: the scanner below does not read them, so a script using them is not checked."""
    if "[[" in source or "[=" in source:
        raise ValueError("long strings/comments are not supported by this check")
    out, i, quote = [], 0, ""
    while i < len(source):
        c = source[i]
        if quote:
            out.append(c)
            if c == "\\":
                out.append(source[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c in _QUOTES:
            quote = c
            out.append(c)
        elif source.startswith("--", i):
            while i < len(source) and source[i] != "\n":
                i += 1
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


_OPERATOR_END = re.compile(r"(\.\.|[-+*/%^<>=,]|\band|\bor|\bnot)\s*$")
_OPERATOR_START = re.compile(r"\s*(\.\.|[-+*/%^<>=]|and\b|or\b)")


def _continues(code: str, begin: int, newline: int) -> bool:
    """Whether the statement at ``code[begin:newline]`` goes on after this line break (the
    line ends, or the next one starts, with a binary operator)."""
    return bool(
        _OPERATOR_END.search(code[begin:newline]) or _OPERATOR_START.match(code, newline + 1)
    )


def split_args(code: str, start: int, closer: str = ")") -> tuple[list[str], int]:
    """The top-level, comma-separated expressions from ``code[start]`` up to the bracket that
    closes the enclosing one (or, with ``closer="\\n"``, to the end of the statement: the end of
    a line where every bracket is closed). Returns them stripped and the index after the end."""
    parts, depth, quote, i, begin = [], 0, "", start, start
    while i < len(code):
        c = code[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in _QUOTES:
            quote = c
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE and depth:
            depth -= 1
        elif c == closer == "\n" and depth == 0 and _continues(code, begin, i):
            pass
        elif (depth == 0 and c in ("," + closer)) or c in _CLOSE:
            parts.append(code[begin:i].strip())
            begin = i + 1
            if c != ",":
                return [p for p in parts if p], i + 1
        i += 1
    parts.append(code[begin:].strip())
    return [p for p in parts if p], i


# -- following keys -----------------------------------------------------------------------------

_KEYS_INDEX = re.compile(r"KEYS\[[^\[\]]+\]")
_KEYS_UNPACK = re.compile(r"unpack\(KEYS(?:\s*,\s*[^(),]+){0,2}\)")  # a run of KEYS[] itself
_NAME = re.compile(r"[A-Za-z_]\w*")
_NAMES = r"[A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*"
_FUNCTION = re.compile(r"\bfunction\s+([A-Za-z_]\w*)\s*\(([^)]*)\)")
_ASSIGN = re.compile(rf"(?<![\w.\]:])({_NAMES})\s*=(?!=)")
_FOR_IN = re.compile(rf"\bfor\s+({_NAMES})\s+in\b")
_REDIS_CALL = re.compile(r"\bredis\.p?call\s*\(")
_SINGLE_KEY = frozenset(
    {
        *("HGET", "HMGET", "HSET", "HDEL", "HINCRBY", "HGETALL", "HEXISTS", "EXPIRE", "PEXPIRE"),
        *("PEXPIREAT",),
        *("DEL", "GET", "SET", "INCRBY", "LRANGE", "LLEN", "RPUSH", "LPUSH", "LPOP", "PUBLISH"),
        *("SPUBLISH",),
        *("XACK", "XDEL", "XADD", "XLEN", "XRANGE", "XREVRANGE", "XPENDING", "XCLAIM"),
        *("SADD", "SREM", "SISMEMBER", "SMEMBERS", "ZADD", "ZREM", "ZRANGE", "ZSCORE"),
        *("ZRANGEBYSCORE", "HSETNX", "SMISMEMBER", "LTRIM", "HINCRBYFLOAT", "ZCARD", "ZINCRBY"),
    }
)


def key_positions(args: list[str]) -> list[int]:
    """Indices in ``args`` (``args[0]`` is the quoted command) of the arguments that are keys.
    A command missing here fails the check: add it with its key positions."""
    command = args[0].strip(_QUOTES).upper()
    sub = args[1].strip(_QUOTES).upper() if len(args) > 1 else ""
    if command == "TIME":
        return []
    if command == "EXISTS":
        return list(range(1, len(args)))
    if (command, sub) in {("XINFO", "GROUPS"), ("XINFO", "STREAM"), ("XGROUP", "CREATE")}:
        return [2]
    if command in {"XREAD", "XREADGROUP"}:
        words = [a.strip(_QUOTES).upper() for a in args]
        at = words.index("STREAMS") + 1
        return list(range(at, at + (len(args) - at) // 2))
    if command in _SINGLE_KEY:
        return [1]
    raise ValueError(f"command {command} {sub} is not in key_positions(): add it")


@dataclass
class Bindings:
    """Every way a name gets a value in one script: expressions assigned to it, parameters of
    functions (resolved through every call site), and loop variables (never a key)."""

    exprs: dict[str, list[str]] = field(default_factory=dict)
    params: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    loops: set[str] = field(default_factory=set)
    calls: dict[str, list[list[str]]] = field(default_factory=dict)

    @classmethod
    def of(cls, code: str) -> Bindings:
        b = cls()
        for m in _FUNCTION.finditer(code):
            params = [p.strip() for p in m.group(2).split(",") if p.strip()]
            for i, p in enumerate(params):
                b.params.setdefault(p, []).append((m.group(1), i))
            b.calls[m.group(1)] = [
                split_args(code, c.end())[0]
                for c in re.finditer(rf"(?<!function )\b{m.group(1)}\s*\(", code)
            ]
        for m in _ASSIGN.finditer(code):
            names = [n.strip() for n in m.group(1).split(",")]
            if code[max(0, m.start() - 4) : m.start()].strip() == "for":
                b.loops.update(names)  # numeric for
                continue
            exprs = split_args(code, m.end(), closer="\n")[0]
            for i, n in enumerate(names):
                b.exprs.setdefault(n, []).append(exprs[i] if i < len(exprs) else "<missing>")
        for m in _FOR_IN.finditer(code):
            b.loops.update(n.strip() for n in m.group(1).split(","))
        return b

    def sources(self, name: str) -> Iterator[str]:
        """Every expression that can give ``name`` its value (call-site arguments included);
        ``<loop>`` / ``<missing>`` for values that are never keys."""
        if name in self.loops:
            yield "<loop>"
        yield from self.exprs.get(name, [])
        for function, i in self.params.get(name, []):
            for args in self.calls.get(function, []):
                yield args[i] if i < len(args) else "<missing>"

    def key_names(self, allowed: frozenset[str]) -> set[str]:
        """The names whose every value comes from ``KEYS[]`` (or is in ``allowed``): the largest
        set closed under :meth:`sources`, less the names no ``KEYS[]`` value ever reaches (a
        parameter of a function that is never called counts as reached: its body never runs)."""
        names = set(self.exprs) | set(self.params) | self.loops

        def is_key(expr: str, known: set[str]) -> bool:
            return bool(_KEYS_INDEX.fullmatch(expr)) or expr in known or expr in allowed

        closed = set(names)
        while True:
            drop = {n for n in closed if not all(is_key(e, closed) for e in self.sources(n))}
            if not drop:
                break
            closed -= drop
        # a parameter of functions never called: the body never runs, so nothing to check
        unused = {n for n in closed if n not in self.exprs and next(self.sources(n), None) is None}
        grounded = set(allowed) | unused
        while True:
            more = {
                n
                for n in closed - grounded
                if any(_KEYS_INDEX.fullmatch(e) or e in grounded for e in self.sources(n))
            }
            if not more:
                break
            grounded |= more
        return grounded


def key_violations(source: str, allowed: frozenset[str] = frozenset()) -> list[str]:
    """Each ``redis.call``/``redis.pcall`` key argument of ``source`` that is not from KEYS.

    A key argument passes if it is ``KEYS[expr]`` or ``unpack(KEYS, i[, j])`` itself (a
    variadic command's keys: the last argument), or a name all of whose values come
    from ``KEYS[...]``: names are followed through ``local`` and plain assignments (multiple
    assignment matched by position), through function parameters (every call site's argument at
    that position) and through other such names; ``allowed`` names pass as they are. Anything
    else fails: a concatenation (``..``), ``ARGV[i]``, a call's result, a table field, a loop
    variable, a name bound nowhere. The check is by name over the whole script (scopes are not
    told apart), so a name used for a key must never hold anything else; that makes it strict,
    not lax. It reads the scripts as written here: no long strings, no ``string.format`` of
    keys, commands with their key positions in :func:`key_positions`.
    """
    code = strip_comments(source)
    keys = Bindings.of(code).key_names(allowed)
    out = []
    for m in _REDIS_CALL.finditer(code):
        args = split_args(code, m.end())[0]
        if not args or args[0][0] not in _QUOTES:
            out.append(f"redis.call with a computed command: {args[:1]}")
            continue
        for i in key_positions(args):
            if i < len(args) and not (
                _KEYS_INDEX.fullmatch(args[i]) or _KEYS_UNPACK.fullmatch(args[i]) or args[i] in keys
            ):
                out.append(f"{args[0]} key argument {args[i]!r} is not from KEYS[]")
    return out


# -- the project's files ------------------------------------------------------------------------


@pytest.mark.parametrize("path", lua_files(), ids=lambda p: p.name)
def test_lua_file_opens_with_its_keys_argv_header(path: Path) -> None:
    first = next(line for line in path.read_text().splitlines() if line.strip())
    assert first.startswith(_HEADER), f"{path.relative_to(ROOT)} opens with {first!r}"


@pytest.mark.parametrize("path", scripts(), ids=lambda p: p.name)
def test_every_script_is_loaded_by_its_package(path: Path) -> None:
    loaders = [  # a wrapper beside the file, or in the package above a lua/ data folder
        p
        for p in [*path.parent.glob("*.py"), *path.parent.parent.glob("*.py")]
        if re.search(rf"load_lua\(\s*[^)]*\"{re.escape(path.name)}\"", p.read_text())
    ]
    assert loaders, f"no module in {package_of(path)} loads {path.name}"


@pytest.mark.parametrize("path", scripts(), ids=lambda p: p.name)
def test_every_key_a_script_uses_comes_from_keys(path: Path) -> None:
    source = read_lua(package_of(path), path.name)
    allowed = KEYS_BUILT_IN_LUA.get(path.name, frozenset())
    assert key_violations(source, allowed) == []


def test_no_python_module_holds_lua() -> None:
    offenders = {
        str(p.relative_to(ROOT))
        for folder in PACKAGE_FOLDERS
        for p in (ROOT / folder).rglob("*.py")
        if re.search(r"redis\.p?call\(", p.read_text())
    }
    assert offenders == set()


def test_the_known_exceptions_are_still_needed() -> None:
    for name, allowed in KEYS_BUILT_IN_LUA.items():
        (path,) = [p for p in scripts() if p.name == name]
        assert key_violations(read_lua(package_of(path), name)) != [], name
        source = strip_comments(read_lua(package_of(path), name))  # (includes too)
        assert all(re.search(rf"\b{n}\b", source) for n in allowed), name


# -- the key check itself -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "lua",
    [
        "redis.call('HGET', KEYS[1], 'f')",
        "local rec, x = KEYS[2], ARGV[1]\nredis.call('HSET', rec, 'f', x)",
        "local a = KEYS[1]\nlocal b = a\nredis.call('HGET', b, 'f')",
        "local function f(k, v)\n  redis.call('HSET', k, 'f', v)\nend\nf(KEYS[1], ARGV[1])",
        "for i = 1, #KEYS do redis.pcall('XREADGROUP', 'GROUP', 'g', 'c', 'COUNT', 1, "
        "'STREAMS', KEYS[i], '>') end",
        "redis.pcall('XINFO', 'GROUPS', KEYS[1])\nredis.call('EXISTS', KEYS[1], KEYS[2])",
        "-- redis.call('HGET', ARGV[1], 'in a comment')\nredis.call('TIME')",
        "local s = KEYS[1]\nlocal function f(s) redis.call('XLEN', s) end\nf(s)",
        "local function never_called(k) redis.call('HGETALL', k) end",
        "redis.call('EXISTS', unpack(KEYS, 7))",
    ],
)
def test_key_check_passes_keys_from_keys(lua: str) -> None:
    assert key_violations(lua) == []


@pytest.mark.parametrize(
    "lua",
    [
        "redis.call('HGET', ARGV[1], 'f')",
        "redis.call('HGET', 'prefix:' .. ARGV[1], 'f')",
        "redis.call('HGET', KEYS[1] .. ':tok', 'f')",
        "local rec = ARGV[9] .. ARGV[1] .. ARGV[10]\nredis.call('HSET', rec, 'f', 'v')",
        "local a, b = KEYS[1], ARGV[1]\nredis.call('HGET', b, 'f')",
        "local a = KEYS[1]\na = a .. ':x'\nredis.call('HGET', a, 'f')",
        "local a = KEYS[1]\n  .. ':x'\nredis.call('HGET', a, 'f')",
        "local a = KEYS[1] ..\n  ':x'\nredis.call('HGET', a, 'f')",
        "local function f(k) redis.call('HGET', k, 'f') end\nf(KEYS[1])\nf(ARGV[1])",
        "local function f(k) redis.call('HGET', k, 'f') end\nf(k)",
        "for _, k in ipairs(KEYS) do redis.call('HGET', k, 'f') end",
        "local h = redis.call('HMGET', KEYS[1], 's')\nredis.call('XLEN', h[1])",
        "redis.call('XGROUP', 'CREATE', ARGV[1], 'g', '0')",
        "redis.pcall('XREADGROUP', 'GROUP', 'g', 'c', 'STREAMS', ARGV[2], '>')",
        "redis.call('PUBLISH', string.format('%s:ch', ARGV[1]), 'x')",
        "redis.call(ARGV[1], KEYS[1])",
        "redis.call('EXISTS', unpack(ARGV, 2))",
        "redis.call('EXISTS', unpack(KEYS[1] .. ':x'))",
    ],
)
def test_key_check_catches_keys_built_in_lua(lua: str) -> None:
    assert key_violations(lua) != []


def test_key_check_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="not in key_positions"):
        key_violations("redis.call('OBJECT', 'ENCODING', KEYS[1])")
    with pytest.raises(ValueError, match="long strings"):
        key_violations("local s = [[redis.call('HGET', ARGV[1], 'f')]]")
