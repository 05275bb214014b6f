"""The worker's Lua scripts and the claim rule, in process against the real server."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from worker_helpers import enqueue, make_intake, make_request, record

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.prefix_chain import link_of
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args
from tokenfleet.shared.scripts.worker import (
    APPEND_TOKENS,
    HANDBACK,
    START,
    append_tokens_keys_args,
)
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake import claimer as claiming
from tokenfleet.worker.intake.claimer import Claimer
from tokenfleet.worker.service import heartbeat
from tokenfleet.worker.service.heartbeat import Heartbeat
from tokenfleet.worker.service.prefix_set import PrefixSet

STREAM = "tft:q:default:normal"


def _start(
    r: redis.Redis,
    keys: Keys,
    rid: str,
    entry: str,
    worker: str = "w1",
    deadline: str = "",
    limit: int = 3,
) -> list:
    return registry.call(
        r,
        START,
        [keys.record(rid), STREAM, keys.cancel_set, keys.tokens(rid)],
        [rid, worker, repr(time.time()), entry, CONSUMER_GROUP, limit, deadline],
    )


def _events(rid: str, first: int, n: int) -> list[bytes]:
    return [TokenEvent(rid, first + i, 10 + i, f"t{first + i}").encode() for i in range(n)]


def _append(r: redis.Redis, keys: Keys, rid: str, worker: str, first: int, n: int) -> str:
    k, a = append_tokens_keys_args(
        keys, worker, time.time(), 60, [(rid, first, _events(rid, first, n))]
    )
    reply = registry.call(r, APPEND_TOKENS, k, a)
    assert len(reply) == 2  # "ok", then one reply per request
    return reply[1][0].decode()


def test_start_then_append_then_resume_elsewhere(r: redis.Redis, keys: Keys) -> None:
    entry = enqueue(r, keys, make_request("a"))
    assert _start(r, keys, "a", entry) == ["ok", b"1", b"0"]
    assert _append(r, keys, "a", "w1", 0, 3) == "ok"
    # index 2 exists already: nothing written (issue 15: reported "corrupt", was "gap")
    assert _append(r, keys, "a", "w1", 2, 1) == "corrupt"
    assert r.llen(keys.tokens("a")) == 3
    # w1 died; w2 claims the entry and starts it again: it gets the published events
    reply = _start(r, keys, "a", entry, worker="w2")
    assert reply[:3] == ["ok", b"2", b"3"] and len(reply[3:]) == 3
    assert _append(r, keys, "a", "w1", 3, 1) == "lost"  # the zombie cannot write any more
    assert _append(r, keys, "a", "w2", 3, 1) == "ok"
    rec = record(r, keys, "a")
    assert rec is not None and rec.worker == "w2" and rec.num_tokens == 4 and rec.attempts == 2


def test_append_tokens_judges_each_request_of_a_step_on_its_own(r: redis.Redis, keys: Keys) -> None:
    """One call for a whole step: a lost request and a gapped one write nothing, while the
    others in the same call are appended and published in index order, list before channel."""
    for rid, worker in (("a", "w1"), ("b", "w1"), ("c", "w2"), ("d", "w1")):
        _start(r, keys, rid, enqueue(r, keys, make_request(rid)), worker=worker)
    assert _append(r, keys, "b", "w1", 0, 2) == "ok"
    sub = r.pubsub()
    sub.subscribe(*(keys.channel(rid) for rid in "abcd"))
    for _ in "abcd":
        msg = sub.get_message(timeout=5)
        assert msg is not None and msg["type"] == "subscribe"
    batch = [
        ("a", 0, _events("a", 0, 1)),
        ("b", 1, _events("b", 1, 1)),  # the list holds 2: a gap would follow
        ("c", 0, _events("c", 0, 1)),  # held by w2
        ("d", 0, _events("d", 0, 3)),
    ]
    reply = registry.call(r, APPEND_TOKENS, *append_tokens_keys_args(keys, "w1", 12.5, 60, batch))
    gapped = [b"corrupt", b"its token list holds 2 events where this worker had published 1"]
    assert reply == ["ok", [b"ok"], gapped, [b"lost", b"running", b"w2"], [b"ok"]]
    assert [r.llen(keys.tokens(rid)) for rid in "abcd"] == [1, 2, 0, 3]
    assert r.lrange(keys.tokens("d"), 0, -1) == _events("d", 0, 3)
    published = []
    while (msg := sub.get_message(timeout=0.5)) is not None:
        published.append((msg["channel"], msg["data"]))
    sub.close()
    assert published == [(keys.channel("a").encode(), _events("a", 0, 1)[0])] + [
        (keys.channel("d").encode(), ev) for ev in _events("d", 0, 3)
    ]
    rec_a, rec_d = record(r, keys, "a"), record(r, keys, "d")
    assert rec_a is not None and rec_a.num_tokens == 1
    assert rec_d is not None and rec_d.num_tokens == 3
    assert r.hget(keys.record("a"), "first_token_at") == b"12.5"
    assert r.ttl(keys.tokens("a")) > 0


def test_finish_owner_guard_leaves_a_request_held_by_another(r: redis.Redis, keys: Keys) -> None:
    entry = enqueue(r, keys, make_request("b"))
    _start(r, keys, "b", entry, worker="w2")
    event = TerminalEvent("b", TerminalStatus.DONE, num_tokens=0, finish_reason="length")
    k, a = finish_keys_args(
        keys,
        event,
        model="default",
        priority=Priority.NORMAL,
        now=time.time(),
        ttl_s=60,
        stream_id=entry,
        owner="w1",
    )
    assert registry.call(r, FINISH, k, a)[0] == "lost"
    assert r.xlen(STREAM) == 1 and (record(r, keys, "b") or pytest.fail()).status == "running"
    k, a = finish_keys_args(
        keys,
        event,
        model="default",
        priority=Priority.NORMAL,
        now=time.time(),
        ttl_s=60,
        stream_id=entry,
        owner="w2",
    )
    assert registry.call(r, FINISH, k, a)[0] == "ok"
    assert r.xlen(STREAM) == 0 and (record(r, keys, "b") or pytest.fail()).status == "done"


@pytest.mark.parametrize(
    ("setup", "code"),
    [
        ({"status": "cancelled"}, "terminal"),
        ({"attempts": 3}, "poison"),
        ({"stream_id": "1-1"}, "foreign"),
    ],
)
def test_start_refuses(r: redis.Redis, keys: Keys, setup: dict, code: str) -> None:
    entry = enqueue(r, keys, make_request("c"), **setup)
    if "stream_id" in setup:
        r.hset(keys.record("c"), "stream_id", "1-1")
    assert _start(r, keys, "c", entry)[0] == code
    assert (record(r, keys, "c") or pytest.fail()).status != "running"


def test_start_expired_cancelled_missing(r: redis.Redis, keys: Keys) -> None:
    entry = enqueue(r, keys, make_request("d"))
    assert _start(r, keys, "d", entry, deadline=repr(time.time() - 1))[0] == "expired"
    r.sadd(keys.cancel_set, "d")
    assert _start(r, keys, "d", entry)[0] == "cancelled"
    assert _start(r, keys, "nope", "1-1")[0] == "missing"


def test_handback_requeues_at_the_tail_without_counting_an_attempt(
    r: redis.Redis, keys: Keys
) -> None:
    req = make_request("e", deadline=time.time() + 60)
    entry = enqueue(r, keys, req, deadline=repr(req.deadline))
    r.xreadgroup(CONSUMER_GROUP, "w1", {STREAM: ">"})
    _start(r, keys, "e", entry)
    assert (
        registry.call(
            r,
            HANDBACK,
            [keys.record("e"), STREAM],
            ["e", "w2", entry, CONSUMER_GROUP, req.encode()],
        )[0]
        == "lost"
    )
    code, new = registry.call(
        r, HANDBACK, [keys.record("e"), STREAM], ["e", "w1", entry, CONSUMER_GROUP, req.encode()]
    )
    assert code == "ok"
    rec = record(r, keys, "e")
    assert rec is not None and rec.status == "queued" and rec.attempts == 0
    assert r.hget(keys.record("e"), "stream_id") == new and not r.hexists(
        keys.record("e"), "deadline"
    )
    entries: Any = r.xrange(STREAM)
    assert [e[0] for e in entries] == [new]
    assert entries[0][1][b"h"] == b"1"  # marked: its record may hold tokens to resume from
    assert r.xpending(STREAM, CONSUMER_GROUP)["pending"] == 0  # undelivered: any worker reads it


def test_claim_takes_only_entries_of_dead_owners(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = make_intake(r, settings, worker_name="me")
    for rid in ("x1", "x2"):
        enqueue(r, keys, make_request(rid))
    r.xreadgroup(CONSUMER_GROUP, "alive", {STREAM: ">"}, count=1)
    r.xreadgroup(CONSUMER_GROUP, "dead", {STREAM: ">"}, count=1)
    Heartbeat(r, settings, worker_name="alive", model_name="default", ttl_s=30).beat({"running": 1})
    assert Claimer(r, intake.streams, claim_idle_s=3600).claim(10) == []  # not idle long enough
    claimer = Claimer(r, intake.streams, claim_idle_s=0)
    claimed = claimer.claim(10)
    assert [e.raw_id for e in claimed] == ["x2"]
    owners = {
        p["message_id"]: p["consumer"]
        for p in r.xpending_range(STREAM, CONSUMER_GROUP, "-", "+", 10)
    }
    assert sorted(owners.values()) == [b"alive", b"me"]
    assert claimer.claim(10) == []  # mine now, and alive's stays alive's


def test_a_beat_drops_names_that_lapsed_long_ago(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    now = time.time()
    r.zadd(keys.workers, {"old": now - heartbeat.LAPSED_KEEP_S - 5, "recent": now - 60})
    Heartbeat(r, settings, worker_name="me", model_name="default", ttl_s=30).beat({"running": 0})
    assert sorted(r.zrange(keys.workers, 0, -1)) == [b"me", b"recent"]


def test_a_routed_beat_publishes_the_load_and_the_longest_step_since_the_last_beat(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    beat = Heartbeat(r, settings, worker_name="me", model_name="default", ttl_s=30)
    beat.prefixes, beat.max_num_seqs, beat.levels = PrefixSet(), 8, "critical,normal"
    for step_s in (0.05, 0.9004, 0.2):
        beat.note_step(step_s)
    beat.beat({"running": 3})
    assert r.hget(keys.route_load("default"), "me") == b"3 8 901 critical,normal"
    beat.beat({"running": 0})  # no step since: an idle worker reads at once
    assert r.hget(keys.route_load("default"), "me") == b"0 8 0 critical,normal"


def test_a_failed_beat_loses_no_prefix_change(
    r: redis.Redis, settings: Settings, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    beat = Heartbeat(r, settings, worker_name="me", model_name="default", ttl_s=30)
    beat.prefixes, beat.max_num_seqs = PrefixSet(), 8
    a, b, c = (bytes([n]) * 16 for n in range(3))
    beat.prefixes.cached(0, a)
    beat.beat({"running": 0})  # the first beat writes the whole set
    beat.prefixes.cached(1, b)
    beat.beat({"running": 0})  # a change
    published = {as_str(x) for x in r.smembers(keys.prefixes("me"))}
    assert published == {link_of(a), link_of(b)}
    beat.prefixes.cached(2, c)
    beat.prefixes.forgotten(a)
    real = r.pipeline

    def broken(*args: Any, **kwargs: Any) -> Any:
        pipe: Any = real(*args, **kwargs)

        def down(*a: Any, **k: Any) -> Any:
            raise redis.ConnectionError("down")

        pipe.execute = down
        return pipe

    monkeypatch.setattr(r, "pipeline", broken)
    with pytest.raises(redis.ConnectionError):
        beat.beat({"running": 0})  # these changes are taken, and lost with the round trip
    monkeypatch.setattr(r, "pipeline", real)
    beat.beat({"running": 0})
    published = {as_str(x) for x in r.smembers(keys.prefixes("me"))}
    assert published == {link_of(b), link_of(c)}


def test_claim_rounds_reach_dead_entries_behind_a_full_scan_of_live_ones(
    r: redis.Redis, settings: Settings, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(claiming, "PENDING_SCAN", 3)  # fewer live entries than a real scan
    intake = make_intake(r, settings, worker_name="me")
    for i in range(7):
        enqueue(r, keys, make_request(f"y{i}"))
    r.xreadgroup(CONSUMER_GROUP, "alive", {STREAM: ">"}, count=5)
    r.xreadgroup(CONSUMER_GROUP, "dead", {STREAM: ">"}, count=2)
    Heartbeat(r, settings, worker_name="alive", model_name="default", ttl_s=30).beat({"running": 5})
    claimer = Claimer(r, intake.streams, claim_idle_s=0)
    # rounds of budget 1: y0-y2 (all live), y3-y5 (takes y5), y6 (takes y6)
    got = [e.raw_id for _ in range(3) for e in claimer.claim(1)]
    assert got == ["y5", "y6"]
    owners = [p["consumer"] for p in r.xpending_range(STREAM, CONSUMER_GROUP, "-", "+", 10)]
    assert owners == [b"alive"] * 5 + [b"me"] * 2


def test_a_restarted_worker_inherits_what_its_name_left_pending(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    for rid in ("z1", "z2", "z3"):
        enqueue(r, keys, make_request(rid))
    r.xreadgroup(CONSUMER_GROUP, "me", {STREAM: ">"}, count=2)  # the earlier process
    r.xreadgroup(CONSUMER_GROUP, "alive", {STREAM: ">"}, count=1)
    for name in ("me", "alive"):  # the new process of "me" beats before it claims
        Heartbeat(r, settings, worker_name=name, model_name="default", ttl_s=30).beat(
            {"running": 0}
        )
    intake = make_intake(r, settings, worker_name="me")
    claimer = Claimer(r, intake.streams, claim_idle_s=3600)  # nothing is idle long enough to claim
    assert claimer.claim(10) == []  # without inheriting, nobody ever takes them
    assert claimer.inherit() == 2
    assert [e.raw_id for e in claimer.claim(1)] == ["z1"]  # within the engine's room
    assert claimer.num_inherited == 1
    assert [e.raw_id for e in claimer.claim(10)] == ["z2"]
    assert claimer.num_inherited == 0 and claimer.claim(10) == []
    owners = [p["consumer"] for p in r.xpending_range(STREAM, CONSUMER_GROUP, "-", "+", 10)]
    assert owners == [b"me", b"me", b"alive"]


def test_an_inherited_entry_another_worker_claimed_meanwhile_stays_with_it(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    for rid in ("v1", "v2"):
        enqueue(r, keys, make_request(rid))
    read: Any = r.xreadgroup(CONSUMER_GROUP, "me", {STREAM: ">"}, count=2)  # earlier process
    ids = [entry_id for entry_id, _ in read[0][1]]
    r.xclaim(STREAM, CONSUMER_GROUP, "me", 0, ids, idle=60_000)  # died a minute ago
    claimer = Claimer(r, make_intake(r, settings, worker_name="me").streams, claim_idle_s=3600)
    assert claimer.inherit() == 2
    # meanwhile a live worker claims v1: the earlier process's heartbeat had lapsed
    r.xclaim(STREAM, CONSUMER_GROUP, "other", 30_000, [ids[0]])
    assert [e.raw_id for e in claimer.claim(10)] == ["v2"]
    owners = [p["consumer"] for p in r.xpending_range(STREAM, CONSUMER_GROUP, "-", "+", 10)]
    assert owners == [b"other", b"me"]


def test_inherited_entries_of_queues_no_longer_served_are_left_for_their_workers(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    """The earlier process of this name served the critical queue too; this one does not."""
    enqueue(r, keys, make_request("u1", priority=Priority.CRITICAL))
    crit = keys.stream("default", Priority.CRITICAL)
    read: Any = r.xreadgroup(CONSUMER_GROUP, "me", {crit: ">"}, count=1)
    ((_, [(entry_id, _)]),) = read
    r.xclaim(crit, CONSUMER_GROUP, "me", 0, [entry_id], idle=60_000)
    claimer = Claimer(r, make_intake(r, settings, worker_name="me").streams, claim_idle_s=3600)
    assert claimer.inherit() == 0  # normal only: nothing of its own to resume
    listed: Any = r.xpending_range(crit, CONSUMER_GROUP, "-", "+", 10)
    (pending,) = listed
    assert pending["consumer"] == b"me~gone" and pending["time_since_delivered"] >= 60_000
    serving = make_intake(r, settings, worker_name="crit", priorities=[Priority.CRITICAL])
    claimed = Claimer(r, serving.streams, claim_idle_s=30).claim(10)  # "me~gone" never beats
    assert [e.raw_id for e in claimed] == ["u1"]


def test_script_pipeline_survives_a_script_flush(r: redis.Redis, keys: Keys) -> None:
    from tokenfleet.worker.pipelined import ScriptPipeline

    entry = enqueue(r, keys, make_request("f"))
    _start(r, keys, "f", entry)
    r.script_flush()  # e.g. a restarted server: EVALSHA answers NOSCRIPT
    pipe = ScriptPipeline(r)
    event = TokenEvent("f", 0, 1, "x").encode()
    pipe.script(
        APPEND_TOKENS, *append_tokens_keys_args(keys, "w1", time.time(), 60, [("f", 0, [event])])
    )
    pipe.command("SMISMEMBER", keys.cancel_set, "f")
    assert pipe.execute() == [["ok", [b"ok"]], [0]]
    assert r.llen(keys.tokens("f")) == 1


def test_pipeline_packing_matches_redis_py(r: redis.Redis) -> None:
    from tokenfleet.worker.pipelined import pack

    commands = [
        ("EVALSHA", "ab" * 20, 2, "k:1", b"k:\xff", "w1", 0, repr(1.5), 60, b'{"a":"\xc3\xa9"}'),
        ("SMISMEMBER", "tft:cancel", "r1", "r-2"),
        ("XREADGROUP", "GROUP", "g", "c", "COUNT", 1, "BLOCK", 1000, "STREAMS", "s", ">"),
    ]
    conn = r.connection_pool.get_connection()
    try:
        assert b"".join(pack(conn, commands)) == b"".join(conn.pack_commands(commands))
    finally:
        r.connection_pool.release(conn)


def test_script_pipeline_sends_now_and_reads_later(r: redis.Redis, keys: Keys) -> None:
    from tokenfleet.worker.pipelined import ScriptPipeline

    entry = enqueue(r, keys, make_request("g"))
    _start(r, keys, "g", entry)
    pipe = ScriptPipeline(r)
    event = TokenEvent("g", 0, 1, "x").encode()
    pipe.script(
        APPEND_TOKENS, *append_tokens_keys_args(keys, "w1", time.time(), 60, [("g", 0, [event])])
    )
    pipe.command("SMISMEMBER", keys.cancel_set, "g")
    pipe.send()
    assert r.hget(keys.record("g"), "worker") == b"w1"  # the client is free meanwhile
    assert pipe.receive() == [["ok", [b"ok"]], [0]]
    assert r.llen(keys.tokens("g")) == 1
    with pytest.raises(RuntimeError):
        pipe.send()  # one round trip per pipeline


def test_early_jobs_are_new_decodable_entries_only(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    intake = make_intake(r, settings)
    enqueue(r, keys, make_request("new"))
    r.xadd(STREAM, {"id": "bad", "d": b"not json"})
    r.xadd(STREAM, {"id": "back", "d": make_request("back").encode(), "dl": "", "h": "1"})
    entries = intake.streams.pull(10)
    assert [e.raw_id for e in entries] == ["new", "bad", "back"]
    early = intake.starter.early_jobs(entries)
    assert [(j.request_id, j.attempts, j.resume_token_ids) for j in early] == [("new", 0, [])]
    assert r.xlen(STREAM) == 3  # nothing written: start() still decides every entry


def test_start_reuses_early_decoding_per_stream_and_entry(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    """Entry ids are unique per stream only: two priorities' streams can both hold 5-0."""
    intake = make_intake(r, settings, priorities=[Priority.NORMAL, Priority.BATCH])
    for rid, priority in (("n1", Priority.NORMAL), ("b1", Priority.BATCH)):
        req = make_request(rid, priority=priority)
        r.xadd(keys.stream("default", priority), {"id": rid, "d": req.encode(), "dl": ""}, id="5-0")
        r.hset(keys.record(rid), mapping={"status": "queued", "stream_id": "5-0", "attempts": 0})
    entries = intake.streams.pull(10)
    assert [(e.raw_id, e.entry_id) for e in entries] == [("n1", "5-0"), ("b1", "5-0")]
    jobs, _ = intake.starter.start(entries, intake.starter.early_jobs(entries))
    assert [(j.request_id, j.entry.priority) for j in jobs] == [
        ("n1", Priority.NORMAL),
        ("b1", Priority.BATCH),
    ]
    for rid in ("n1", "b1"):
        rec = record(r, keys, rid)
        assert rec is not None and rec.status == "running" and rec.attempts == 1


def test_intake_reader_never_takes_more_than_the_engine_can_admit(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    from tokenfleet.worker.intake.reader import IntakeReader

    intake = make_intake(r, settings)
    for i in range(5):
        enqueue(r, keys, make_request(f"g{i}"))
    reader = IntakeReader(intake, block_ms=50)
    try:
        admitted: set[str] = set()  # what the engine holds: early jobs and started ones
        got: list[str] = []
        while len(got) < 2:
            delivery = reader.poll(2 - len(admitted), 10.0)
            admitted.update(j.request_id for j in delivery.early + delivery.jobs)
            got += [j.request_id for j in delivery.jobs]
        assert not reader.poll(0, 0.3)  # no room left: nothing more is read
        assert len(got) == 2 and r.xpending(STREAM, CONSUMER_GROUP)["pending"] == 2
        while len(got) < 5:
            got += [j.request_id for j in reader.poll(10, 10.0).jobs]
        assert sorted(got) == [f"g{i}" for i in range(5)]
    finally:
        left = reader.stop()
        reader.close()
    assert left.jobs == []
