"""The script registry and the shared ``finish`` script, against the real server (Lua)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tokenfleet.shared.errors import InvalidRequest, Overloaded, ScriptError, UnknownRequest
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import RequestRecord, as_str
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, decode_event
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.cancel import CANCEL, EXPIRE_OVERDUE
from tokenfleet.shared.scripts.enqueue import ENQUEUE, EnqueueItem, enqueue_keys_args
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args
from tokenfleet.shared.scripts.registry import LuaScript, check_reply, load_lua

ECHO = LuaScript(
    name="test-echo",
    ok_codes=frozenset({"maybe"}),
    source="""
-- KEYS: none
-- ARGV[1] = code to return, ARGV[2] = message
return {ARGV[1], ARGV[2]}
""",
)


@pytest.mark.parametrize(
    ("code", "error"),
    [("overloaded", Overloaded), ("invalid", InvalidRequest), ("unknown", UnknownRequest)],
)
def test_error_codes_map_to_exceptions(r: redis.Redis, code: str, error: type) -> None:
    with pytest.raises(error, match="the message"):
        registry.call(r, ECHO, [], [code, "the message"])


def test_ok_codes_and_unknown_codes(r: redis.Redis) -> None:
    assert registry.call(r, ECHO, [], ["ok", "x"]) == ["ok", b"x"]
    assert registry.call(r, ECHO, [], ["maybe", "y"])[0] == "maybe"
    with pytest.raises(ScriptError, match="unknown code 'bogus'"):
        registry.call(r, ECHO, [], ["bogus", "z"])
    with pytest.raises(ScriptError, match="expected"):
        check_reply(ECHO, 5)


def test_script_is_registered_once_per_connection(r: redis.Redis) -> None:
    registry.call(r, ECHO, [], ["ok", "a"])
    first = registry._registered[r]["test-echo"]
    registry.call(r, ECHO, [], ["ok", "b"])
    assert registry._registered[r]["test-echo"] is first
    r.script_flush()  # the server forgot it: EVALSHA falls back and reloads
    assert registry.call(r, ECHO, [], ["ok", "c"]) == ["ok", b"c"]


def _finish(r: redis.Redis, keys: Keys, status: TerminalStatus, stream_id: str = "") -> str:
    event = TerminalEvent("req1", status, num_tokens=0, message=f"{status} now")
    k, a = finish_keys_args(
        keys,
        event,
        model="default",
        priority=Priority.NORMAL,
        now=1.0,
        ttl_s=60,
        stream_id=stream_id,
        extra_fields={"text": "final"},
    )
    return str(registry.call(r, FINISH, k, a)[0])


def test_finish_publishes_exactly_one_terminal_event(r: redis.Redis, keys: Keys) -> None:
    stream = keys.stream("default", Priority.NORMAL)
    r.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    entry = as_str(r.xadd(stream, {"id": "req1", "d": "{}"}))
    assert entry is not None
    r.xreadgroup(CONSUMER_GROUP, "w1", {stream: ">"}, count=1)
    r.hset(keys.record("req1"), mapping={"status": "running"})
    r.sadd(keys.cancel_set, "req1")

    pubsub = r.pubsub()
    pubsub.subscribe(keys.channel("req1"))
    confirmation = pubsub.get_message(timeout=1.0)
    assert confirmation is not None and confirmation["type"] == "subscribe"

    results: list[str] = []
    statuses = [TerminalStatus.CANCELLED, TerminalStatus.DONE, TerminalStatus.ERROR] * 3
    threads = [
        threading.Thread(target=lambda s=s: results.append(_finish(r, keys, s, entry)))
        for s in statuses
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(results) == ["already"] * 8 + ["ok"]
    message = pubsub.get_message(timeout=1.0)
    assert message is not None and message["type"] == "message"
    event = decode_event(message["data"])
    assert isinstance(event, TerminalEvent)
    assert pubsub.get_message(timeout=0.2) is None  # no second terminal event
    record = r.hgetall(keys.record("req1"))
    assert as_str(record[b"status"]) == event.status.value
    assert record[b"text"] == b"final"
    assert 0 < r.ttl(keys.record("req1")) <= 60
    assert r.xlen(stream) == 0  # XDEL
    assert r.xpending(stream, CONSUMER_GROUP)["pending"] == 0  # XACK
    assert not r.sismember(keys.cancel_set, "req1")
    pubsub.close()


def test_finish_in_a_pipeline(r: redis.Redis, keys: Keys) -> None:
    event = TerminalEvent("req1", TerminalStatus.EXPIRED)
    k, a = finish_keys_args(
        keys, event, model="default", priority=Priority.BATCH, now=2.0, ttl_s=60
    )
    pipe = r.pipeline(transaction=False)
    registry.queue(r, pipe, FINISH, k, a)
    registry.queue(r, pipe, FINISH, k, a)
    first, second = (check_reply(FINISH, reply) for reply in pipe.execute())
    assert first == ["ok"] and second[0] == "already"
    assert r.hget(keys.record("req1"), "status") == b"expired"


# -- load_lua: .lua files shipped in a package ---------------------------------------------------

LUA_PACKAGE = "tf_lua_fixture"


@pytest.fixture
def lua_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An importable package folder to put .lua files in (forgotten again after the test)."""
    folder = tmp_path / LUA_PACKAGE
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield folder
    sys.modules.pop(LUA_PACKAGE, None)


def test_load_lua_expands_includes_recursively(r: redis.Redis, lua_package: Path) -> None:
    (lua_package / "twice.lua").write_text(
        "-- KEYS: none (an include)\n-- @include one.lua\n"
        "local function twice(x) return x * 2 + one() - 1 end\n"
    )
    (lua_package / "one.lua").write_text(
        "-- KEYS: none (an include)\nlocal function one() return 1 end\n"
    )
    (lua_package / "double.lua").write_text(
        "-- KEYS: none\n-- ARGV[1] = a number\n-- @include twice.lua\n"
        "return {'ok', twice(tonumber(ARGV[1]))}\n"
    )
    script = load_lua(LUA_PACKAGE, "double.lua", ok_codes=("maybe",))
    assert script.name == "double" and script.ok_codes == {"ok", "maybe"}
    assert script.source.startswith("-- KEYS: none\n-- ARGV[1] = a number\n")
    assert "-- @include" not in script.source
    assert script.source.index("local function one") < script.source.index("local function twice")
    assert registry.call(r, script, [], [21]) == ["ok", 42]
    assert load_lua(LUA_PACKAGE, "double.lua", name="other").name == "other"


@pytest.mark.parametrize(
    "text",
    [
        "return {'ok'}\n",
        "\n-- a comment first\n-- KEYS[1] = a hash\nreturn {'ok'}\n",
        "-- @include lib.lua\n-- KEYS[1] = a hash\nreturn {'ok'}\n",  # the include's header
    ],
)
def test_load_lua_refuses_a_script_without_its_header(lua_package: Path, text: str) -> None:
    (lua_package / "lib.lua").write_text("-- KEYS: none (an include)\nlocal x = 1\n")
    (lua_package / "bad.lua").write_text(text)
    with pytest.raises(ValueError, match="must open with its -- KEYS/ARGV header"):
        load_lua(LUA_PACKAGE, "bad.lua")


def test_load_lua_accepts_an_argv_only_header_after_blank_lines(lua_package: Path) -> None:
    (lua_package / "argv.lua").write_text("\n\n-- ARGV[1] = a word\nreturn {'ok', ARGV[1]}\n")
    assert load_lua(LUA_PACKAGE, "argv.lua").source.startswith("\n\n-- ARGV[1]")


def test_the_terminal_transition_is_one_included_function() -> None:
    for script in (FINISH, CANCEL, EXPIRE_OVERDUE, ENQUEUE):
        assert script.source.count("local function tf_finish(") == 1, script.name
        assert "\n-- @include" not in script.source, script.name
        assert script.source.startswith("-- KEYS[1] = "), script.name


def test_enqueue_takes_each_record_key_from_keys(r: redis.Redis, keys: Keys) -> None:
    items = [EnqueueItem(rid, b"{}", None) for rid in ("a", "b")]
    k, a = enqueue_keys_args(keys, "default", Priority.NORMAL, items, now=1.0, ttl_s=60)
    assert k[4:11] == [
        keys.served,
        keys.declared,
        keys.tally,
        keys.recent,
        keys.tenants_active("default", Priority.NORMAL),
        keys.tenant_book("default"),
        keys.tenant_backlog("default", Priority.NORMAL),
    ]
    assert k[11:] == [keys.record("a"), keys.record("b")]
    assert keys.dead_letter not in k  # a producer's ACL user may not write it
    with pytest.raises(redis.ResponseError, match="one record key per request"):
        registry.call(r, ENQUEUE, k[:12], a)
    assert r.xlen(keys.stream("default", Priority.NORMAL)) == 0  # refused before any write
    reply = registry.call(r, ENQUEUE, k, a)
    assert reply == ["ok"]  # both new
    again = registry.call(r, ENQUEUE, k, a)
    assert again == ["ok", 1, b"exists", b"queued", 2, b"exists", b"queued"]
    assert r.hget(keys.record("b"), "status") == b"queued"


def test_enqueue_writes_only_the_fields_a_reader_has_no_default_for(
    r: redis.Redis, keys: Keys
) -> None:
    """num_tokens 0, attempts 0, an empty worker or deadline and no fingerprint (a generated
    id) are what readers assume when a field is absent, so a new record leaves them out; the
    TTL is counted on Redis's clock, whatever the producer's ``now`` (1.0 here)."""
    items = [
        EnqueueItem("plain", b"{}", None, chosen_id=False),
        EnqueueItem("full", b'{"x":1}', 99.5, chosen_id=True),
    ]
    r.zadd(keys.served, {"default": 1e12})  # served: nothing waits on the model
    k, a = enqueue_keys_args(keys, "default", Priority.NORMAL, items, now=1.0, ttl_s=60)
    registry.call(r, ENQUEUE, k, a)
    plain = {as_str(f) for f in r.hgetall(keys.record("plain"))}
    assert plain == {"status", "stream_id", "enqueued_at", "model", "priority"}
    full = {as_str(f): as_str(v) for f, v in r.hgetall(keys.record("full")).items()}
    assert set(full) == plain | {"deadline", "fingerprint"} and full["deadline"] == "99.5"
    for rid in ("plain", "full"):
        assert 55 < r.ttl(keys.record(rid)) <= 60
    record = RequestRecord.from_hash("plain", r.hgetall(keys.record("plain")))
    assert record is not None
    assert (record.num_tokens, record.attempts, record.worker, record.deadline) == (0, 0, "", None)
    assert record.waiting_on == ""
