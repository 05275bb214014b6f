"""The script registry and the shared ``finish`` script, against the real server (Lua)."""

from __future__ import annotations

import threading

import pytest
import redis

from tokenfleet.shared.errors import InvalidRequest, Overloaded, ScriptError, UnknownRequest
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, decode_event
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args
from tokenfleet.shared.scripts.registry import LuaScript, check_reply

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
