"""The pool scripts as shipped: ``.lua`` files with their KEYS/ARGV headers, every key from KEYS[].

Redis Cluster routes a script by the keys it is given, so a key a script built itself (from a
prefix or a template) would go unseen. These checks read the files the way a reviewer would.
"""

from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

import pytest

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.pool import scripts
from tokenfleet.shared.scripts.registry import LuaScript
from tokenfleet.worker.pool import config

LUA = resources.files("tokenfleet.shared.pool.lua")
SCRIPTS = {
    "pool_create.lua": scripts.POOL_CREATE,
    "pool_join.lua": scripts.POOL_JOIN,
    "pool_step.lua": scripts.POOL_STEP,
    "pool_leave.lua": scripts.POOL_LEAVE,
    "pool_inspect.lua": scripts.POOL_INSPECT,
    "pool_advance_clock.lua": scripts.POOL_ADVANCE_CLOCK,
}
# Names the prelude binds to KEYS[1..3]; a key argument is one of these or KEYS[n] itself.
KEY_NAMES = {"POOL", "MEMBERS", "ORDERS"}
REDIS_CALL = re.compile(r"redis\.call\(\s*'(\w+)'\s*(?:,\s*([^,)]+))?")


def _text(name: str) -> str:
    return LUA.joinpath(name).read_text(encoding="utf-8")


def _code(source: str) -> str:
    """The source without its ``--`` comments."""
    return "\n".join(line.split("--", 1)[0] for line in source.splitlines())


def test_every_lua_file_is_a_loaded_script_or_the_prelude() -> None:
    shipped = {p.name for p in LUA.iterdir() if p.name.endswith(".lua")}
    assert shipped == {*SCRIPTS, "prelude.lua"}


@pytest.mark.parametrize("filename", sorted(SCRIPTS))
def test_each_script_opens_with_a_header_naming_every_key_it_is_given(filename: str) -> None:
    text = _text(filename)
    header = []
    for line in text.splitlines():
        if not line.startswith("--") or line.startswith("-- @include"):
            break
        header.append(line)
    assert header[0].startswith("-- KEYS[1] = ")
    documented = "\n".join(header)
    covered: set[int] = set()
    for first, last in re.findall(r"^-- KEYS\[(\d)(?:\.\.(\d))?\] = ", documented, re.M):
        covered.update(range(int(first), int(last or first) + 1))
    assert covered == set(range(1, len(scripts.pool_keys(Keys("t"), "p")) + 1)), filename
    assert "ARGV" in documented
    assert "-- @include prelude.lua" in text
    script = SCRIPTS[filename]
    assert isinstance(script, LuaScript) and script.name == filename.removesuffix(".lua")


@pytest.mark.parametrize("filename", sorted(SCRIPTS))
def test_every_key_a_script_touches_arrives_through_keys(filename: str) -> None:
    source = _code(SCRIPTS[filename].source)  # the prelude included
    calls = REDIS_CALL.findall(source)
    assert calls, filename
    for command, first_arg in calls:
        if command == "TIME":
            continue
        arg = first_arg.strip()
        if arg == "key":  # load_hash(key): its callers pass a key name (checked below)
            continue
        assert arg in KEY_NAMES or re.fullmatch(r"KEYS\[\d\]", arg), (filename, command, arg)
    assert "local function load_hash(key)" in source
    for arg in re.findall(r"load_hash\((\w+)\)", source):
        assert arg == "key" or arg in KEY_NAMES, (filename, arg)
    # the prelude binds its key names straight from KEYS[], and nothing rebinds them
    binding = "local POOL, MEMBERS, ORDERS = KEYS[1], KEYS[2], KEYS[3]\n"
    assert source.count(binding) == 1
    rest = source.replace(binding, "")
    for name in KEY_NAMES:
        assert not re.search(rf"\b{name}\s*=(?!=)", rest), (filename, name)


def test_the_prelude_mirrors_the_python_limits() -> None:
    prelude = _text("prelude.lua")
    mirrored = dict(re.findall(r"^local (DEFAULT_ROUND_MS|MAX_MEMBERS) = (\d+)$", prelude, re.M))
    assert mirrored == {
        "DEFAULT_ROUND_MS": str(config.DEFAULT_ROUND_MS),
        "MAX_MEMBERS": str(config.MAX_MEMBERS),
    }


def test_no_lua_in_the_pool_wings_python() -> None:
    folder = Path(scripts.__file__).parent
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "redis.call" not in node.value, path
