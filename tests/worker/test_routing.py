"""Routing with real workers (docs/routing.md): sessions and prefixes pick the worker,
idle workers steal what waits, a killed worker's routed work is taken over, models never mix,
the overflow pool takes only aged work, and cancel / deadlines / overflow policies still hold.

Every wait polls a condition with a deadline (``wait_for``); no test depends on how fast a
worker is; where a worker is kept busy by a long request, the test checks that it still ran.
A record's ``worker`` is cleared at the end (``ran_on`` keeps who ran it); ``route`` and
``routed_to`` say where it was routed and why, also when another worker took it, which its
``taken`` says (``stolen_by:W``, ``overflow:W``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from thread_worker import ThreadWorker
from worker_helpers import WorkerProc, record, wait_for, wait_terminal

from tokenfleet.producer import Client
from tokenfleet.producer.core.route_tokenizer import build_route_tokenizer
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.prefix_chain import model_session_hash
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 20}
# keeps a worker busy (until cancelled) for longer than a steal waits, even on an idle fast host:
# up to the tiny model's context (4,096 positions, the prompt included: the engine ends it there)
LONG = {"max_tokens": 3900, "temperature": 0.0, "ignore_eos": True}


def _turn(*texts: str) -> list[dict[str, str]]:
    """A conversation: the system prompt, then user/assistant turns alternating."""
    roles = ["user", "assistant"]
    return [SYSTEM, *({"role": roles[i % 2], "content": t} for i, t in enumerate(texts))]


class Fleet:
    """Workers on one key prefix and a producer client on it: each in a thread of the test
    (``ThreadWorker``), or a real process where the test kills one."""

    def __init__(self, model_dir: Path, server: RedisServer, prefix: str, tmp: Path) -> None:
        self.model_dir, self.server, self.prefix, self.tmp = model_dir, server, prefix, tmp
        self.keys = Keys(prefix)
        self.r = redis.Redis.from_url(server.url)
        self.workers: dict[str, WorkerProc | ThreadWorker] = {}
        self.client = Client.from_url(settings=Settings(redis_url=server.url, key_prefix=prefix))

    def start(
        self, name: str, *extra: str, target: bool = True, process: bool = False
    ) -> WorkerProc | ThreadWorker:
        w: WorkerProc | ThreadWorker
        if process:
            w = WorkerProc(self.model_dir, self.server.url, self.prefix, name, self.tmp, *extra)
        else:
            w = ThreadWorker(self.model_dir, self.server.url, self.prefix, name, *extra)
        self.workers[name] = w
        w.wait_ready(self.r)
        if target:  # a routing target once its score in the model's routers set is live
            model = extra[extra.index("--model-name") + 1] if "--model-name" in extra else "default"
            wait_for(
                lambda: (self.r.zscore(self.keys.routers(model), name) or 0) > time.time(),
                f"{name} to be a routing target",
            )
        return w

    def done(self, rid: str) -> Any:
        rec = wait_terminal(self.r, self.keys, rid)
        assert rec.status == "done", (rec, self._logs())
        return rec

    def holds(self, worker: str, chain: tuple[str, ...]) -> None:
        """Wait until ``worker``'s published prefix set holds all of ``chain``."""
        key = self.keys.prefixes(worker)
        wait_for(lambda: all(self.r.smismember(key, list(chain))), f"{worker} to publish chain")

    def _logs(self) -> str:
        return "\n".join(f"--- {n}\n{w.output()}" for n, w in self.workers.items())

    def taken(self, rid: str) -> str | None:
        """The record's ``taken``: who took the request from where it was routed, and how."""
        value = self.r.hget(self.keys.record(rid), "taken")
        return value.decode() if isinstance(value, bytes) else value

    def close(self) -> None:
        self.client.close()
        for w in self.workers.values():
            w.close()
        self.r.delete(*(self.r.keys(f"{self.prefix}:*") or ["-"]))
        self.r.close()


@pytest.fixture
def fleet(
    request: pytest.FixtureRequest, tiny_model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> Iterator[Fleet]:
    f = Fleet(tiny_model_dir, redis_server, f"trt-{request.node.name[-40:]}", tmp_path)
    try:
        yield f
    finally:
        f.close()


def test_a_sessions_turns_stay_on_its_worker_and_a_shared_prefix_follows_its_holder(
    fleet: Fleet,
) -> None:
    fleet.start("ra")
    fleet.start("rb")
    c = fleet.client
    first = c.submit(messages=_turn("hi"), max_tokens=4, metadata={"session": "s1"})
    rec1 = fleet.done(first.request_id)
    assert rec1.route == "session" and rec1.routed_to in ("ra", "rb")
    home = rec1.routed_to
    second = c.submit(
        messages=_turn("hi", "hello", "more"), max_tokens=4, metadata={"session": "s1"}
    )
    rec2 = fleet.done(second.request_id)
    assert (rec2.route, rec2.routed_to) == ("session", home)
    # a routed request's end acks and deletes its entry in the routed stream it came from
    routed = fleet.keys.routed("default", Priority.NORMAL, home)
    assert fleet.r.xlen(routed) == 0
    assert fleet.r.xpending(routed, CONSUMER_GROUP)["pending"] == 0
    # no session: the longest cached prefix picks the worker (once its set is published)
    # (the chain: the engine's own block hashes, tokenized as the workers published how)
    convo = _turn("hi", "hello", "more")
    spec: Any = fleet.r.hgetall(fleet.keys.route_tokenizer("default"))  # bytes -> bytes
    router = build_route_tokenizer(spec, "default")
    assert router is not None, "the workers published no route tokenizer"
    held = router.chain(messages=convo)
    assert len(held) >= 4
    fleet.holds(home, held)  # what the second turn left in home's prefix cache
    published = {as_str(x) for x in fleet.r.smembers(fleet.keys.prefixes(home))}
    later = [*convo, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    third = c.submit(messages=later, max_tokens=4)
    rec3 = fleet.done(third.request_id)
    chain3 = router.chain(messages=later)
    matched = 0
    while matched < len(chain3) and chain3[matched] in published:
        matched += 1
    assert matched >= len(held) - 1 >= 3  # the same history, up to the new turn's block
    assert rec3.route == f"prefix:{matched}" and rec3.routed_to == home
    other = "rb" if home == "ra" else "ra"
    assert not fleet.r.smismember(fleet.keys.prefixes(other), list(held))[-1]
    # a prompt nobody holds and no session: the shared stream
    fourth = c.submit(messages=[{"role": "user", "content": "unseen"}], max_tokens=4)
    assert fleet.done(fourth.request_id).route == "shared"


def _prefix_hits(w: WorkerProc | ThreadWorker) -> float:
    """Prompt tokens the worker's engine served from its prefix cache (its metric)."""
    assert isinstance(w, ThreadWorker)
    m = w.service.metrics
    return (
        m.registry.get_sample_value(
            "tokenfleet:prefix_cache_hit_tokens_total", {"model_name": "default"}
        )
        or 0.0
    )


def test_with_tenants_waiting_a_session_and_a_shared_prefix_still_go_to_their_holder(
    fleet: Fleet,
) -> None:
    """Requests that wait in tenant queues (docs/fairness.md) keep the route chosen when they
    were enqueued: admitted, they run on the worker holding their history, whose engine serves
    their prompt from its prefix cache; a killed holder loses none of them."""
    fleet.start("fa")
    fleet.start("fb")
    c, r, keys = fleet.client, fleet.r, fleet.keys
    first = c.submit(messages=_turn("hi"), max_tokens=4, metadata={"session": "t"}, tenant="acme")
    rec1 = fleet.done(first.request_id)
    assert rec1.route == "session" and rec1.routed_to in ("fa", "fb")
    home = rec1.routed_to
    other = "fb" if home == "fa" else "fa"
    assert r.hget(keys.record(first.request_id), "tenant") == b"acme"  # (its tenant queue's)
    convo = _turn("hi", "hello", "more")
    router = build_route_tokenizer(r.hgetall(keys.route_tokenizer("default")), "default")  # type: ignore[arg-type]
    assert router is not None
    hits_before = _prefix_hits(fleet.workers[home])
    second = c.submit(messages=convo, max_tokens=4, metadata={"session": "t"}, tenant="acme")
    rec2 = fleet.done(second.request_id)
    assert (rec2.route, rec2.routed_to, rec2.ran_on) == ("session", home, home)
    assert r.hget(keys.record(second.request_id), "tenant") == b"acme"
    assert _prefix_hits(fleet.workers[home]) > hits_before  # the first turn's blocks, reused
    held = router.chain(messages=convo)
    fleet.holds(home, held)
    # another tenant, no session, the same history: the prefix's holder runs it
    later = [*convo, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    hits_before = _prefix_hits(fleet.workers[home])
    third = c.submit(messages=later, max_tokens=4, tenant="globex")
    rec3 = fleet.done(third.request_id)
    assert rec3.route.startswith("prefix:") and int(rec3.route.partition(":")[2]) >= 3
    assert (rec3.routed_to, rec3.ran_on) == (home, home)
    assert r.hget(keys.record(third.request_id), "tenant") == b"globex"
    assert _prefix_hits(fleet.workers[home]) > hits_before
    assert not r.smismember(keys.prefixes(other), list(held))[-1]  # (only home held it)


def test_behind_another_tenants_backlog_a_turn_still_goes_to_its_sessions_worker(
    fleet: Fleet,
) -> None:
    """A tenant floods both workers (two slots each, stealing out of the way) while a session's
    next turn and a request sharing its history arrive from other tenants: fair admission, by
    the enqueue or by a worker's pull, puts each into the routed stream of the worker holding
    the history, which runs it from its prefix cache."""
    flags = ("--max-num-seqs", "2", "--steal-after-s", "60")
    fleet.start("ga", *flags)
    fleet.start("gb", *flags)
    c, r, keys = fleet.client, fleet.r, fleet.keys
    first = c.submit(messages=_turn("hi"), max_tokens=4, metadata={"session": "g"}, tenant="acme")
    home = fleet.done(first.request_id).routed_to
    assert home in ("ga", "gb")
    flood = c.submit_many(
        [
            {"prompt": f"filler {i}", "max_tokens": 40, "ignore_eos": True, "tenant": "beta"}
            for i in range(10)
        ]
    )
    assert r.zcard(keys.tenants_active("default", Priority.NORMAL)) >= 1  # beta waits
    hits_before = _prefix_hits(fleet.workers[home])
    convo = _turn("hi", "hello", "more")
    second = c.submit(messages=convo, max_tokens=4, metadata={"session": "g"}, tenant="acme")
    later = [*convo, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    router = build_route_tokenizer(r.hgetall(keys.route_tokenizer("default")), "default")  # type: ignore[arg-type]
    assert router is not None
    rec2 = fleet.done(second.request_id)
    assert (rec2.route, rec2.routed_to, rec2.ran_on) == ("session", home, home)
    fleet.holds(home, router.chain(messages=convo))
    third = c.submit(messages=later, max_tokens=4, tenant="globex")
    rec3 = fleet.done(third.request_id)
    assert rec3.route.startswith("prefix:") and (rec3.routed_to, rec3.ran_on) == (home, home)
    assert _prefix_hits(fleet.workers[home]) > hits_before
    for h in flood:
        assert not isinstance(h, Exception)
        assert fleet.done(h.request_id).route == "shared"  # (no session, nothing held)


def test_with_tenants_waiting_routed_work_of_a_killed_worker_is_not_lost(fleet: Fleet) -> None:
    """Requests of two tenants routed (session) to a worker that is SIGKILLed, some running,
    some admitted into its routed stream, some still in their tenant queues: all end done,
    gap-free, each counted once in the tenant book."""
    fleet.start("xa", "--max-num-seqs", "1", process=True)
    fleet.start("xb", "--max-num-seqs", "1", process=True)
    c, r, keys = fleet.client, fleet.r, fleet.keys
    params = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    handles = [
        c.submit(
            messages=_turn(f"n{i}"),
            metadata={"session": "x"},
            tenant=("acme", "globex")[i % 2],
            **params,
        )
        for i in range(6)
    ]
    rids = [h.request_id for h in handles]

    def home_running() -> str | None:
        for rid in rids:
            rec = record(r, keys, rid)
            if rec and rec.status == "running" and rec.routed_to and rec.num_tokens >= 2:
                return rec.routed_to if rec.worker == rec.routed_to else None
        return None

    home = wait_for(home_running, "a routed request running on its worker", poll_s=0.005)
    victim = fleet.workers[home]
    assert isinstance(victim, WorkerProc)
    victim.signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    served = 0
    for h in handles:
        rec = fleet.done(h.request_id)
        events = [e.index for e in h.stream() if isinstance(e, TokenEvent)]
        assert events == list(range(40)), h.request_id  # gap-free, duplicate-free, complete
        assert rec.num_tokens == 40
        usage = orjson.loads(r.hget(keys.record(h.request_id), "usage") or b"{}")
        served += int(usage["prompt_tokens"]) + rec.num_tokens
    book = {as_str(k): as_str(v) or "" for k, v in r.hgetall(keys.tenant_book("default")).items()}
    admitted = int(book.get("admitted|acme") or 0) + int(book.get("admitted|globex") or 0)
    assert admitted == len(rids)  # each admitted once, whoever took it after the kill
    assert int(book["served|acme"]) + int(book["served|globex"]) == served  # counted once
    routed = [record(r, keys, rid) for rid in rids]
    assert any(rec is not None and rec.routed_to == home for rec in routed)


def test_an_idle_worker_steals_routed_work_that_waits_on_a_busy_one(fleet: Fleet) -> None:
    fleet.start("sa", "--max-num-seqs", "1")
    fleet.start("sb", "--max-num-seqs", "1")
    c = fleet.client
    busy = c.submit(messages=_turn("go on"), metadata={"session": "s"}, **LONG)

    def running() -> str:
        rec = record(fleet.r, fleet.keys, busy.request_id)
        return rec.routed_to if rec is not None and rec.status == "running" else ""

    home = wait_for(running, "the long request to run")
    other = "sb" if home == "sa" else "sa"
    # pinned to the busy worker (one sequence slot, taken): it waits in its routed stream
    quick = c.submit(
        messages=_turn("go on", "ok", "short"), max_tokens=4, metadata={"session": "s"}
    )
    rec = fleet.done(quick.request_id)
    # where it was routed and why stay in the record; the steal is noted apart
    assert (rec.route, rec.routed_to) == ("session", home)
    assert fleet.taken(quick.request_id) == f"stolen_by:{other}"
    assert running() == home, record(fleet.r, fleet.keys, busy.request_id)  # busy all along
    # the session follows its stolen turn: the next turn goes where that turn's history is
    assert fleet.r.get(fleet.keys.session(model_session_hash("default", "s"))) == other.encode()
    then = c.submit(
        messages=_turn("go on", "ok", "short", "done", "next"),
        max_tokens=4,
        metadata={"session": "s"},
    )
    rec = fleet.done(then.request_id)
    assert (rec.route, rec.routed_to, fleet.taken(then.request_id)) == ("session", other, None)
    c.cancel(busy.request_id)
    wait_terminal(fleet.r, fleet.keys, busy.request_id)


def test_a_worker_killed_holding_routed_work_loses_nothing(fleet: Fleet) -> None:
    fleet.start("ka", "--max-num-seqs", "2", process=True)  # one of them is killed
    fleet.start("kb", "--max-num-seqs", "2", process=True)
    c = fleet.client
    params = {"max_tokens": 60, "temperature": 0.0, "ignore_eos": True}
    handles = [
        c.submit(messages=_turn(f"n{i}"), metadata={"session": "k"}, **params) for i in range(4)
    ]
    rids = [h.request_id for h in handles]
    first = record(fleet.r, fleet.keys, rids[0])
    assert first is not None
    home = first.routed_to
    victim = fleet.workers[home]
    assert isinstance(victim, WorkerProc)

    def running_on_victim() -> str | None:
        for rid in rids:
            rec = record(fleet.r, fleet.keys, rid)
            if rec and rec.status == "running" and rec.worker == home and rec.num_tokens >= 4:
                return rid
        return None

    held = wait_for(running_on_victim, "a routed request running on its worker", poll_s=0.005)
    victim.signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    for rid in rids:
        rec = fleet.done(rid)
        stream = handles[rids.index(rid)].stream()
        events = [e.index for e in stream if isinstance(e, TokenEvent)]
        assert events == list(range(60)), rid  # gap-free, duplicate-free, complete
        assert rec.num_tokens == 60
    taken = record(fleet.r, fleet.keys, held)
    assert taken is not None and taken.attempts == 2


def test_two_models_in_one_fleet_never_mix(fleet: Fleet) -> None:
    fleet.start("ma", "--model-name", "m1")
    fleet.start("mb", "--model-name", "m2")
    c = fleet.client
    handles = []
    for i in range(6):
        model = "m1" if i % 2 == 0 else "m2"
        handles.append(
            (
                model,
                c.submit(
                    messages=_turn("same"), max_tokens=3, model=model, metadata={"session": "x"}
                ),
            )
        )
    # and through the shared streams (no session, a prompt too short for a chain)
    for i in range(6):
        model = "m1" if i % 2 == 0 else "m2"
        handles.append((model, c.submit(f"p{i}", max_tokens=3, model=model)))
    for model, h in handles:
        rec = fleet.done(h.request_id)
        assert rec.ran_on == {"m1": "ma", "m2": "mb"}[model] and rec.model == model, rec
        if rec.route != "shared":
            assert rec.routed_to == rec.ran_on, rec
    assert {fleet.done(h.request_id).route for _, h in handles[6:]} == {"shared"}


def test_the_overflow_pool_takes_only_aged_work(fleet: Fleet) -> None:
    after_s = 1.5
    fleet.start("oa", "--overflow-for", "default", "--overflow-after-s", str(after_s), target=False)
    c = fleet.client
    quick = c.submit("a prompt for the overflow pool", max_tokens=3)
    rec = fleet.done(quick.request_id)
    assert (rec.route, rec.routed_to, fleet.taken(quick.request_id)) == (
        "shared",
        "",
        "overflow:oa",
    )
    assert rec.started_at is not None and rec.enqueued_at is not None
    assert rec.started_at - rec.enqueued_at >= after_s - 0.01  # (stream id ms vs record's s)
    # with a regular worker beside it (one request at a time, ~8 of them queued: work waits
    # past the threshold), the pool takes some, and only what had waited past it
    fleet.start("ob", "--max-num-seqs", "1")
    handles = [
        c.submit(f"prompt {i}", max_tokens=150, ignore_eos=True, temperature=0.0) for i in range(8)
    ]
    by_pool = 0
    for h in handles:
        r = fleet.done(h.request_id)
        if fleet.taken(h.request_id) == "overflow:oa":
            by_pool += 1
            assert r.started_at is not None and r.enqueued_at is not None
            assert r.started_at - r.enqueued_at >= after_s - 0.01
        else:
            assert r.ran_on == "ob", r
    assert 1 <= by_pool < len(handles)


def test_the_overflow_pool_works_through_tenant_queues_fairly(fleet: Fleet) -> None:
    """With tenants waiting and no regular worker, an overflow worker admits (fairly, charged)
    and runs every request once its tenant queue's head has waited past the threshold: none is
    left in a tenant queue, none starts before its threshold."""
    after_s = 1.0
    fleet.start("op", "--overflow-for", "default", "--overflow-after-s", str(after_s), target=False)
    c, r, keys = fleet.client, fleet.r, fleet.keys
    handles = [
        c.submit(f"prompt {i}", max_tokens=3, tenant=("acme", "beta")[i % 2]) for i in range(6)
    ]
    assert r.xlen(keys.tenant_queue("default", Priority.NORMAL, "acme")) >= 2  # (they wait)
    for h in handles:
        rec = fleet.done(h.request_id)
        assert (fleet.taken(h.request_id), rec.ran_on) == ("overflow:op", "op")
        assert rec.started_at is not None and rec.enqueued_at is not None
        assert rec.started_at - rec.enqueued_at >= after_s - 0.01  # (stream id ms vs record's s)
    book = {as_str(k): as_str(v) or "" for k, v in r.hgetall(keys.tenant_book("default")).items()}
    assert (book["admitted|acme"], book["admitted|beta"]) == ("3", "3")
    assert float(book["vt|acme"]) > 0 and float(book["vt|beta"]) > 0


def test_with_routing_cancel_deadlines_and_drop_oldest_still_hold(fleet: Fleet) -> None:
    """Enqueue-side promises with requests waiting in a routed stream: a routing target that
    never reads ("ghost": a live heartbeat score and hash, no process) keeps them there."""
    r, keys, c = fleet.r, fleet.keys, fleet.client
    now = time.time()
    r.zadd(keys.served, {"default": now + 600})
    r.zadd(keys.routers("default"), {"ghost": now + 600})
    r.hset(keys.route_load("default"), "ghost", "0 8")
    routed = keys.routed("default", Priority.NORMAL, "ghost")
    queued = c.submit(messages=_turn("a"), max_tokens=3, metadata={"session": "p"})
    rec = record(r, keys, queued.request_id)
    assert rec is not None and (rec.route, rec.routed_to, rec.status) == (
        "session",
        "ghost",
        "queued",
    )
    assert r.xlen(routed) == 1
    c.cancel(queued.request_id)
    assert wait_terminal(r, keys, queued.request_id).status == "cancelled"
    assert r.xlen(routed) == 0  # its entry left the routed stream with it
    # a deadline that passes while it waits in a routed stream: it ends expired
    late = c.submit(
        messages=_turn("a", "b"), max_tokens=3, metadata={"session": "p"}, deadline_s=0.2
    )
    assert r.xlen(routed) == 1
    wait_for(lambda: c.status(late.request_id).status == "expired", "the late request to expire")
    assert r.xlen(routed) == 0
    # drop_oldest: the bound counts routed entries, and the oldest waiting one is evicted
    c.set_queue_config("normal", max_waiting=1, policy="drop_oldest")
    a = c.submit(messages=_turn("a", "c"), max_tokens=3, metadata={"session": "p"})
    b = c.submit(messages=[{"role": "user", "content": "elsewhere"}], max_tokens=3)
    assert wait_terminal(r, keys, a.request_id).status == "dropped"
    rec_b = record(r, keys, b.request_id)
    assert rec_b is not None and rec_b.status == "queued" and rec_b.route == "shared"
    assert r.xlen(routed) == 0 and r.xlen(keys.stream("default", Priority.NORMAL)) == 1
