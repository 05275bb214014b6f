"""Routing in the enqueue script and the steal script, against the real server (Lua): session
and prefix choices, liveness and load, bounds over shared + routed streams, drop-oldest across
them, and stealing only aged, undelivered entries. Plus the prefix chain and the worker's
prefix set."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from waiting import wait_for

from tokenfleet.shared.block_hash import hash_block
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.prefix_chain import (
    MAX_LINKS,
    link_of,
    model_session_hash,
    prefix_chain,
    session_of,
)
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import RequestRecord, as_str
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.cancel import CANCEL, withdraw_keys_args
from tokenfleet.shared.scripts.enqueue import ENQUEUE, EnqueueItem, RouteTargets, enqueue_keys_args
from tokenfleet.shared.scripts.worker import STEAL
from tokenfleet.worker.intake.stealer import STEP_BOUND_CAP, Stealer, step_ms_of
from tokenfleet.worker.intake.streams import PriorityStreams
from tokenfleet.worker.service.prefix_set import PrefixSet

P = Priority.NORMAL
TWO_BLOCKS = list(range(33))  # 16-token blocks: two full blocks before the last token
CHAIN = prefix_chain(TWO_BLOCKS, 16)  # two links


@pytest.fixture
def keys() -> Keys:
    return Keys("trs")


def _live(r: redis.Redis, keys: Keys, *names: str, running: int = 0, cap: int = 4) -> None:
    r.zadd(keys.served, {"default": time.time() + 60})
    for n in names:
        r.zadd(keys.routers("default"), {n: time.time() + 60})
        r.hset(keys.route_load("default"), n, f"{running} {cap} 40")  # 40: longest step, ms


def _submit(
    r: redis.Redis, keys: Keys, rid: str, *, session: str | None = None, chain: tuple = ()
) -> RequestRecord:
    item = EnqueueItem(rid, b"{}", None, session=session, chain=chain)
    members: Any = r.zrange(keys.routers("default"), 0, -1)
    names = tuple(as_str(n) or "" for n in members)
    k, a = enqueue_keys_args(
        keys, "default", P, [item], now=time.time(), ttl_s=60, route=RouteTargets(names)
    )
    reply = registry.call(r, ENQUEUE, k, a)
    assert reply[0] == "ok"
    rec = RequestRecord.from_hash(rid, r.hgetall(keys.record(rid)))
    assert rec is not None
    return rec


def _submit_as(r: redis.Redis, keys: Keys, tenant: str, rid: str, **route: Any) -> None:
    """Enqueue one request of ``tenant`` with routing on (every live router a candidate)."""
    item = EnqueueItem(rid, b"{}", None, tenant=tenant, **route)
    members: Any = r.zrange(keys.routers("default"), 0, -1)
    names = tuple(as_str(n) or "" for n in members)
    k, a = enqueue_keys_args(
        keys, "default", P, [item], now=time.time(), ttl_s=60, route=RouteTargets(names)
    )
    assert registry.call(r, ENQUEUE, k, a) == ["ok"]


def _next_ms(r: redis.Redis) -> None:
    """Return once Redis's clock is past the millisecond it showed when called."""
    first = r.time()
    while r.time()[1] // 1000 == first[1] // 1000 and r.time()[0] == first[0]:
        pass


def test_the_chain_is_the_block_hashes_at_link_positions_and_bounded() -> None:
    one, two = prefix_chain(TWO_BLOCKS[:17], 16), CHAIN
    assert len(one) == 1 and two[:1] == one and len(two) == 2
    first = hash_block(None, TWO_BLOCKS[:16])
    assert one == (link_of(first),) and two[1] == link_of(hash_block(first, TWO_BLOCKS[16:32]))
    assert prefix_chain(TWO_BLOCKS[:16], 16) == ()  # no full block before the last token
    assert len(prefix_chain(list(range(100_000)), 16)) == MAX_LINKS
    assert session_of({"user": "u1"}) == "u1" and session_of({"session": "s", "user": "u"}) == "s"
    assert session_of(None) is None


def test_the_prefix_set_follows_the_engines_cache_and_reports_its_changes() -> None:
    held = PrefixSet()
    a, b, c, d = (bytes([n]) * 16 for n in range(4))
    held.cached(0, a)
    held.cached(1, b)
    held.cached(8, c)  # block 8 is not at a link position (0-7, then 9, 11, ...): not routable
    assert len(held) == 2 and held.changes() == (sorted([link_of(a), link_of(b)]), [])
    held.forgotten(a)  # evicted from the engine's cache: leaves the published set
    held.cached(9, d)
    held.forgotten(c)  # never a link: nothing to publish
    assert held.changes() == ([link_of(d)], [link_of(a)])
    held.cached(2, a)
    held.forgotten(a)  # in and out between two beats: nothing to publish
    assert held.changes() == ([], []) and sorted(held.snapshot()) == sorted(
        [link_of(b), link_of(d)]
    )


def test_a_longer_match_is_weighed_against_its_holders_load(r: redis.Redis, keys: Keys) -> None:
    """Score = links matched - load / max_num_seqs: the best positive score wins."""
    chain = prefix_chain(list(range(16 * 4 + 1)), 16)  # four links
    _live(r, keys, "busy", running=6, cap=4)  # 1.5 batches of work ahead
    _live(r, keys, "idle", running=0, cap=4)
    r.sadd(keys.prefixes("busy"), *chain[:2])  # 2 - 1.5 = 0.5
    r.sadd(keys.prefixes("idle"), chain[0])  # 1 - 0 = 1: the idle one wins, with less cached
    rec = _submit(r, keys, "r1", chain=chain)
    assert (rec.routed_to, rec.route) == ("idle", "prefix:1")
    r.sadd(keys.prefixes("busy"), *chain[2:])  # 4 - 1.5 = 2.5: now the longer match is worth it
    rec = _submit(r, keys, "r2", chain=chain)
    assert (rec.routed_to, rec.route) == ("busy", "prefix:4")
    r.delete(keys.prefixes("idle"))
    _live(r, keys, "busy", running=7, cap=4)
    r.srem(keys.prefixes("busy"), *chain[1:])  # 1 - 1.75 < 0: no useful match
    assert _submit(r, keys, "r3", chain=chain).route == "shared"


def test_a_session_is_pinned_and_a_prefix_follows_its_holder(r: redis.Redis, keys: Keys) -> None:
    _live(r, keys, "wa", "wb")
    first = _submit(r, keys, "r1", session="s")
    assert first.route == "session" and first.routed_to in ("wa", "wb")
    home = first.routed_to
    assert _submit(r, keys, "r2", session="s").routed_to == home  # pinned
    chain = CHAIN
    other = "wb" if home == "wa" else "wa"
    r.sadd(keys.prefixes(other), chain[0])
    rec = _submit(r, keys, "r3", chain=chain)
    assert (rec.route, rec.routed_to) == ("prefix:1", other)
    r.sadd(keys.prefixes(home), *chain)
    assert _submit(r, keys, "r4", chain=chain).route == "prefix:2"
    assert _submit(r, keys, "r5").route == "shared"  # no session, no chain
    assert r.xlen(keys.stream("default", P)) == 1


def test_a_tenant_queued_request_keeps_its_route_and_is_admitted_into_its_workers_stream(
    r: redis.Redis, keys: Keys
) -> None:
    """With tenants waiting, the route is chosen at enqueue and kept with the tenant-queue
    entry; admission (the enqueue's, another worker's pull) puts it in that worker's routed
    stream while the worker is a target, else in the shared stream."""
    _live(r, keys, "wa", "wb")
    pull_b = PriorityStreams(
        r, keys, model_name="default", priorities=[P], worker_name="wb", starvation_pulls=4
    )
    pull_b.ensure_groups()
    r.sadd(keys.prefixes("wa"), *CHAIN)
    _submit_as(r, keys, "acme", "a1", chain=CHAIN)  # admitted at once: nothing else waits
    tq = keys.tenant_queue("default", P, "acme")
    routed_a = keys.routed("default", P, "wa")
    assert r.xlen(tq) == 0 and r.xlen(routed_a) == 1
    rec = RequestRecord.from_hash("a1", r.hgetall(keys.record("a1")))
    assert rec is not None and (rec.route, rec.routed_to) == ("prefix:2", "wa")
    _submit_as(r, keys, "acme", "a2", chain=CHAIN)  # admitted at once too (shared: empty)
    assert r.xlen(tq) == 0 and r.xlen(routed_a) == 2
    _submit_as(r, keys, "beta", "b1")  # no route: admitted into the shared stream
    shared = keys.stream("default", P)
    assert r.xlen(shared) == 1
    _submit_as(r, keys, "acme", "a3", chain=CHAIN)  # waits in its tenant queue, route kept
    waiting: Any = r.xrange(tq)
    (entry,) = waiting
    assert (entry[1][b"r"], entry[1][b"rt"]) == (b"wa", b"prefix:2")
    assert r.hget(keys.record("a3"), "routed_to") is None  # (set when it is admitted)
    got = pull_b.pull(1)  # wb's pull: a3 into wa's routed stream, b1 read from the shared one
    assert [as_str(e.fields["id"]) for e in got] == ["b1"]
    assert r.xlen(tq) == 0 and r.xlen(routed_a) == 3
    rec = RequestRecord.from_hash("a3", r.hgetall(keys.record("a3")))
    assert rec is not None and (rec.route, rec.routed_to) == ("prefix:2", "wa")
    routed: Any = r.xrange(routed_a)
    assert as_str(r.hget(keys.record("a3"), "stream_id")) == as_str(routed[-1][0])
    # a cancelled admitted routed request leaves the routed stream, as any routed one does
    event = TerminalEvent("a3", TerminalStatus.CANCELLED, message="x")
    k, a = withdraw_keys_args(
        keys, event, model="default", priority=P, now=time.time(), ttl_s=60, routed_to="wa"
    )
    assert registry.call(r, CANCEL, k, a) == ["ok"]
    assert r.xlen(routed_a) == 2
    # its worker dies while a request routed to it waits: admitted into the shared stream
    _submit_as(r, keys, "beta", "b2")  # (admitted: something undelivered in the shared stream)
    _submit_as(r, keys, "acme", "a4", chain=CHAIN)
    waiting = r.xrange(tq)
    assert waiting[0][1][b"r"] == b"wa"
    r.zadd(keys.routers("default"), {"wa": time.time() - 1})
    got = pull_b.pull(4)
    assert [(as_str(e.fields["id"]), e.stream) for e in got] == [("b2", shared), ("a4", shared)]
    rec = RequestRecord.from_hash("a4", r.hgetall(keys.record("a4")))
    assert rec is not None and (rec.route, rec.routed_to, rec.status) == ("shared", "", "queued")
    assert r.xlen(routed_a) == 2  # (a1, a2: wa's, for stealers and claimers as before)


def test_dead_or_overloaded_workers_are_not_targets(r: redis.Redis, keys: Keys) -> None:
    _live(r, keys, "wa", running=8, cap=4)  # load 8 >= 2 * 4
    r.zadd(keys.routers("default"), {"wb": time.time() - 1})  # lapsed
    r.sadd(keys.prefixes("wa"), *CHAIN)
    r.sadd(keys.prefixes("wb"), *CHAIN)
    rec = _submit(r, keys, "r1", session="s", chain=CHAIN)
    assert rec.route == "shared" and rec.routed_to == ""


def test_a_worker_is_a_target_only_for_the_levels_it_serves(r: redis.Redis, keys: Keys) -> None:
    """A batch-only worker never gets a normal request, even pinned or holding its prefix (it
    would wait there for a stealer); a worker of an older version (no levels) serves all."""
    _live(r, keys, "batchy", "both")
    r.hset(keys.route_load("default"), "batchy", "0 4 40 batch")
    r.hset(keys.route_load("default"), "both", "5 8 40 critical,normal")  # busier
    r.sadd(keys.prefixes("batchy"), *CHAIN)
    rec = _submit(r, keys, "r1", session="s", chain=CHAIN)
    assert (rec.route, rec.routed_to) == ("session", "both")
    r.hset(keys.route_load("default"), "both", "0 4 40")  # no levels: every level
    r.set(keys.session(model_session_hash("default", "s")), "batchy")  # pinned to the batch worker
    rec = _submit(r, keys, "r2", session="s", chain=CHAIN)
    assert (rec.route, rec.routed_to) == ("session", "both")


def test_the_bound_counts_routed_entries_and_drop_oldest_evicts_across_streams(
    r: redis.Redis, keys: Keys
) -> None:
    _live(r, keys, "wa")
    r.hset(keys.queue_config("default", P), mapping={"max_waiting": 2, "policy": "drop_oldest"})
    assert _submit(r, keys, "old", session="s").routed_to == "wa"
    _next_ms(r)  # stream ids of two streams tie within one millisecond (docs/routing.md)
    _submit(r, keys, "mid")
    _submit(r, keys, "new")  # full (1 routed + 1 shared): the oldest, in the routed stream, goes
    assert r.hget(keys.record("old"), "status") == b"dropped"
    assert r.xlen(keys.routed("default", P, "wa")) == 0
    assert r.xlen(keys.stream("default", P)) == 2


def test_steal_takes_only_aged_undelivered_entries(r: redis.Redis, keys: Keys) -> None:
    routed = keys.routed("default", P, "wa")
    r.xgroup_create(routed, CONSUMER_GROUP, id="0", mkstream=True)
    now_ms = int(time.time() * 1000)
    r.xadd(routed, {"id": "a"}, id=f"{now_ms - 5000}-0")
    r.xadd(routed, {"id": "b"}, id=f"{now_ms - 4000}-0")
    r.xadd(routed, {"id": "c"}, id=f"{now_ms + 60_000}-0")  # young (in the future)
    r.xreadgroup(CONSUMER_GROUP, "wa", {routed: ">"}, count=1)  # "a" is wa's (pending)
    reply = registry.call(r, STEAL, [routed], [CONSUMER_GROUP, "wb", 10, 1000, -1, "normal"])
    (stream, entries), *_ = reply[1:]
    assert as_str(stream) == routed and [as_str(e[1][1]) for e in entries] == ["b"]
    pending: Any = r.xpending_range(routed, CONSUMER_GROUP, "-", "+", 10)
    assert {(as_str(p["message_id"]), as_str(p["consumer"])) for p in pending} == {
        (f"{now_ms - 5000}-0", "wa"),
        (f"{now_ms - 4000}-0", "wb"),
    }
    assert registry.call(r, STEAL, [routed], [CONSUMER_GROUP, "wb", 10, 1000, -1, "n"]) == ["ok"]


def test_steal_takes_each_stream_after_its_own_age(r: redis.Redis, keys: Keys) -> None:
    """ARGV[4+2n+i]: a per-stream bound (the stealer's, from each target's step time)."""
    fast, slow = keys.routed("default", P, "wa"), keys.routed("default", P, "wc")
    now_ms = int(time.time() * 1000)
    for stream in (fast, slow):
        r.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        r.xadd(stream, {"id": stream}, id=f"{now_ms - 3000}-0")  # waited 3 s
    args: list[str | int] = [
        CONSUMER_GROUP,
        "wb",
        10,
        500,
        -1,
        -1,
        "normal",
        "normal",
        1000,
        10_000,
    ]
    reply = registry.call(r, STEAL, [fast, slow], args)
    assert [as_str(stream) for stream, _ in reply[1:]] == [fast]
    assert r.xlen(slow) == 1 and not r.xpending(slow, CONSUMER_GROUP)["pending"]


def test_a_stealer_waits_a_few_of_its_targets_steps(r: redis.Redis, keys: Keys) -> None:
    """A target reads new work at each step's end: the bound is two of its longest recent
    steps (at least the setting, at most STEP_BOUND_CAP times it)."""
    streams = PriorityStreams(
        r, keys, model_name="default", priorities=[P], worker_name="wb", starvation_pulls=8
    )
    loads = {"fast": "1 8 30", "slow": "1 8 900", "stuck": "1 8 60000", "old": "1 8"}
    for worker, load in loads.items():
        r.hset(keys.route_load("default"), worker, load)
    names = ["fast", "slow", "stuck", "old"]
    r.zadd(keys.routers("default"), {w: time.time() + 5 for w in [*names, "wb"]})
    stealer = Stealer(r, streams, steal_after_ms=500)
    assert stealer.workers() == sorted([*names, "wb"])
    ages = {stream: age for stream, _, age in stealer.targets()}
    assert ages == {
        keys.routed("default", P, "fast"): 500,
        keys.routed("default", P, "slow"): 2 * 900,
        keys.routed("default", P, "stuck"): STEP_BOUND_CAP * 500,
        keys.routed("default", P, "old"): 500,
    }
    assert step_ms_of(b"3 8 120") == 120 and step_ms_of(None) == 0 and step_ms_of("2 4") == 0


def test_queue_stats_count_the_routed_streams_too(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    """``queue_stats`` (``tokenfleet queues``, the gateway's Retry-After, the batch window):
    a routed entry waits in its queue like a shared one."""
    from tokenfleet.producer import Client
    from tokenfleet.shared.settings import Settings

    _live(r, keys, "wa")
    assert _submit(r, keys, "a", session="s").routed_to == "wa"
    assert _submit(r, keys, "b").route == "shared"
    routed = keys.routed("default", P, "wa")
    settings = Settings(redis_url=redis_url, key_prefix=keys.prefix)
    with Client.from_url(settings=settings) as client:
        (row,) = [q for q in client.queue_stats() if q.priority == P.label]
        assert (row.length, row.running, row.waiting) == (2, 0, 2)
        assert r.xreadgroup(CONSUMER_GROUP, "wa", {routed: ">"}, count=1)  # wa starts it
        (row,) = [q for q in client.queue_stats() if q.priority == P.label]
        assert (row.length, row.running, row.waiting) == (2, 1, 1)


def test_routing_is_prefix_session_or_off() -> None:
    from tokenfleet.producer.core.request import prepare
    from tokenfleet.shared.errors import SettingsError
    from tokenfleet.shared.settings import Settings

    assert Settings().routing == "prefix"
    assert Settings.from_env({"TOKENFLEET_ROUTING": "off"}).routing == "off"
    with pytest.raises(
        SettingsError, match=r"routing \(TOKENFLEET_ROUTING\) must be one of prefix, session, off"
    ):
        Settings(routing="random")
    params = {"prompt": "p" * 300, "metadata": {"session": "s"}}
    by_mode = {m: prepare(Settings(routing=m), now=0.0, **params) for m in ("prefix", "session")}
    by_mode["off"] = prepare(Settings(routing="off"), now=0.0, **params)
    # prefix: its session and what its chain is computed from; session: the session only
    assert by_mode["prefix"].session == "s" and by_mode["prefix"].route_input is not None
    assert by_mode["session"].session == "s" and by_mode["session"].route_input is None
    assert by_mode["off"].session is None and by_mode["off"].route_input is None


def test_a_lapsed_router_is_forgotten_only_once_its_routed_streams_are_empty(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    """Stealers and claimers know routed streams only from the routers set: a worker dead for
    an hour stays listed while its routed streams hold an entry, waiting or pending, and is
    forgotten (streams and load field deleted) once they are empty."""
    from tokenfleet.shared.scripts.worker import FORGET_ROUTERS
    from tokenfleet.shared.settings import Settings
    from tokenfleet.worker.intake.claimer import Claimer
    from tokenfleet.worker.service.heartbeat import LAPSED_KEEP_S, Heartbeat

    routers, load = keys.routers("default"), keys.route_load("default")
    lapsed = time.time() - LAPSED_KEEP_S - 60
    names = {"waits": lapsed, "held": lapsed, "empty": lapsed, "recent": time.time() - 60}
    r.zadd(routers, names)
    for name in names:
        r.hset(load, name, "0 4 40")
        for p in (P, Priority.BATCH):
            r.xgroup_create(keys.routed("default", p, name), CONSUMER_GROUP, id="0", mkstream=True)
    waiting = r.xadd(keys.routed("default", P, "waits"), {"id": "w"})
    held = keys.routed("default", P, "held")
    r.xadd(held, {"id": "h"})
    r.xreadgroup(CONSUMER_GROUP, "held", {held: ">"})  # pending under the dead worker
    beat = Heartbeat(
        r,
        Settings(redis_url=redis_url, key_prefix=keys.prefix),
        worker_name="alive",
        model_name="default",
        ttl_s=10,
    )
    beat.beat({"running": 0})  # the first beat looks for lapsed routers
    members: Any = r.zrange(routers, 0, -1)
    assert {as_str(m) for m in members} == {"waits", "held", "recent"}
    assert not r.exists(*(keys.routed("default", p, "empty") for p in (P, Priority.BATCH)))
    assert r.hget(load, "empty") is None and r.hget(load, "held") is not None
    streams = PriorityStreams(
        r, keys, model_name="default", priorities=[P], worker_name="alive", starvation_pulls=8
    )
    assert {keys.routed("default", P, w) for w in ("waits", "held")} <= set(
        Claimer(r, streams, claim_idle_s=5).claim_streams()
    )
    # a process back under a lapsed name raises its score: the script checks it again
    r.zadd(routers, {"waits": time.time() + 10})
    r.xdel(keys.routed("default", P, "waits"), waiting)
    stream_keys = [keys.routed("default", p, "waits") for p in Priority]
    args: list[str | int] = [
        repr(time.time() - LAPSED_KEEP_S),
        CONSUMER_GROUP,
        len(stream_keys),
        "waits",
    ]
    assert registry.call(r, FORGET_ROUTERS, [routers, load, *stream_keys], args) == ["ok"]
    assert r.exists(keys.routed("default", P, "waits"))
    # the held entry ends (acked and deleted, as the finish script does): nothing is left
    entries: Any = r.xrange(held)
    ids = [as_str(e[0]) or "" for e in entries]
    r.xack(held, CONSUMER_GROUP, *ids)
    r.xdel(held, *ids)
    assert beat.forget_lapsed_routers(time.time()) == ["held"]
    assert not r.exists(held) and r.hget(load, "held") is None


def test_an_overflow_worker_claims_a_dead_workers_entry_only_past_its_threshold(
    r: redis.Redis, keys: Keys
) -> None:
    """An overflow worker takes only work that has waited its threshold: a dead worker's
    pending entry waits from the owner's death on, as this worker found it."""
    from tokenfleet.worker.intake.claimer import Claimer

    streams = PriorityStreams(
        r, keys, model_name="default", priorities=[P], worker_name="ov", starvation_pulls=8
    )
    streams.ensure_groups()
    shared = keys.stream("default", P)
    entry_id = as_str(r.xadd(shared, {"id": "a"}))
    r.xreadgroup(CONSUMER_GROUP, "dead", {shared: ">"})  # its owner has no heartbeat
    overflow = Claimer(r, streams, claim_idle_s=0)
    overflow.dead_for_s = 0.3
    found_dead_at = time.monotonic()
    assert overflow.claim(4) == []  # a regular claimer would take it now
    claimed = wait_for(lambda: overflow.claim(4), "the overflow worker to claim", timeout_s=10)
    assert time.monotonic() - found_dead_at >= 0.3
    assert [e.entry_id for e in claimed] == [entry_id]
