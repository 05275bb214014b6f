"""The two faces cannot drift: ``Client`` / ``AsyncClient`` and ``Handle`` / ``AsyncHandle``
offer the same public members with the same parameters (a), and the same calls against the real
server give the same results from both (b).

(a) compares the classes' public surface: every method, property and context-manager dunder,
inherited ones included, by name (``close`` / ``aclose`` and the ``with`` / ``async with``
dunders are the only renames), parameter names, kinds and defaults, and how it is called: the
asyncio side is a coroutine (or an async generator where the sync side is a generator) unless
the member does no I/O and is listed as plain on both sides. Public instance attributes are
compared too. Tests below apply the same check to deliberately altered subclasses.

(b) runs one scenario, written once, through each face on a freshly flushed server, with a
scripted fake worker for served, running and finished requests, and compares the outcomes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import redis.asyncio
from producer_helpers import FakeWorker

from tokenfleet.producer import (
    AsyncClient,
    AsyncHandle,
    Client,
    Handle,
    RequestRecord,
    Result,
    TerminalEvent,
    TokenEvent,
)
from tokenfleet.shared.queue_config import QueueStats
from tokenfleet.shared.settings import Settings

PROTOCOL_DUNDERS = frozenset(
    {"__enter__", "__exit__", "__aenter__", "__aexit__", "__iter__", "__aiter__"}
)


@dataclass(frozen=True)
class FacePair:
    """A sync class, its asyncio twin, and the only differences allowed between them."""

    sync: type
    aio: type
    renamed: dict[str, str]  # sync name -> asyncio name
    plain_on_both: frozenset[str]  # members that do no I/O: not coroutines on either side


CLIENTS = FacePair(
    Client,
    AsyncClient,
    {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"},
    frozenset({"from_url", "handle", "batch", "redis_for_key"}),
)
HANDLES = FacePair(
    Handle,
    AsyncHandle,
    {"__enter__": "__aenter__", "__exit__": "__aexit__"},
    frozenset({"close"}),
)


def public_members(cls: type) -> dict[str, Any]:
    """Public members of ``cls`` (inherited included, ``object``'s excluded) and the protocol
    dunders it defines, as found on the class (functions, properties, class/static methods)."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") and name not in PROTOCOL_DUNDERS:
            continue
        for klass in cls.__mro__:
            if klass is not object and name in vars(klass):
                out[name] = vars(klass)[name]
                break
    return out


def _kind(member: Any) -> str:
    if isinstance(member, property):
        return "property"
    if isinstance(member, classmethod):
        return "classmethod"
    if isinstance(member, staticmethod):
        return "staticmethod"
    if inspect.iscoroutinefunction(member):
        return "coroutine"
    if inspect.isasyncgenfunction(member):
        return "async generator"
    if inspect.isgeneratorfunction(member):
        return "generator"
    if callable(member):
        return "plain"
    return "attribute"


def _parameters(member: Any) -> list[tuple[str, Any, Any]]:
    if isinstance(member, property):
        member = member.fget
    if isinstance(member, classmethod | staticmethod):
        member = member.__func__
    if not callable(member):
        return []
    sig = inspect.signature(member)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


# how a sync member may look on the asyncio side (besides plain_on_both)
ASYNC_KIND = {"plain": {"coroutine"}, "generator": {"async generator"}}


def api_differences(pair: FacePair) -> list[str]:
    """Every way ``pair.aio``'s public surface differs from ``pair.sync``'s beyond the allowed
    ones (empty when the faces match)."""
    sync = {pair.renamed.get(n, n): m for n, m in public_members(pair.sync).items()}
    aio = public_members(pair.aio)
    problems = [f"{n} only on {pair.sync.__name__}" for n in sorted(sync.keys() - aio.keys())]
    problems += [f"{n} only on {pair.aio.__name__}" for n in sorted(aio.keys() - sync.keys())]
    for name in sorted(sync.keys() & aio.keys()):
        s, a = sync[name], aio[name]
        if _parameters(s) != _parameters(a):
            problems.append(f"{name}: parameters {_parameters(s)} != {_parameters(a)}")
        sk, ak = _kind(s), _kind(a)
        plain = name in pair.plain_on_both or sk not in ASYNC_KIND
        allowed = {sk} if plain else ASYNC_KIND[sk]
        if ak not in allowed:
            expected = " or ".join(sorted(allowed))
            problems.append(f"{name}: {ak} on {pair.aio.__name__}, expected {expected}")
    return problems


def attribute_differences(sync_obj: object, aio_obj: object) -> list[str]:
    """Public instance attributes present on one object and not the other."""
    s = {n for n in vars(sync_obj) if not n.startswith("_")}
    a = {n for n in vars(aio_obj) if not n.startswith("_")}
    return [f"attribute {n} differs" for n in sorted(s ^ a)]


# -- (a) same public surface ---------------------------------------------------------------------
@pytest.mark.parametrize("pair", [CLIENTS, HANDLES], ids=["clients", "handles"])
def test_faces_offer_the_same_members_and_signatures(pair: FacePair) -> None:
    assert api_differences(pair) == []
    assert set(public_members(pair.sync)) >= {"close"}  # the check is not vacuous


def test_faces_hold_the_same_public_attributes(redis_url: str, settings: Settings) -> None:
    sync_client = Client(redis.Redis.from_url(redis_url), settings=settings)
    aio_client = AsyncClient(redis.asyncio.Redis.from_url(redis_url), settings=settings)
    try:
        assert attribute_differences(sync_client, aio_client) == []
        assert {"settings", "recheck_s"} <= set(vars(sync_client))
        sync_handle, aio_handle = sync_client.handle("x"), aio_client.handle("x")
        assert attribute_differences(sync_handle, aio_handle) == []
        assert "request_id" in vars(sync_handle)
    finally:
        sync_client.close()
        asyncio.run(aio_client._redis.aclose())


def test_a_member_on_one_side_only_is_caught() -> None:
    class Extra(AsyncClient):
        async def purge(self) -> None: ...

    class Missing(Handle):
        stream = None  # type: ignore[assignment]

    assert api_differences(dataclasses.replace(CLIENTS, aio=Extra)) == ["purge only on Extra"]
    problems = api_differences(dataclasses.replace(HANDLES, sync=Missing))
    assert problems[0] == "stream: parameters [] != " + str(_parameters(AsyncHandle.stream))


def test_a_changed_signature_or_call_style_is_caught() -> None:
    class Defaults(AsyncClient):
        async def status(self, request_id: str, fresh: bool = False) -> RequestRecord:
            raise NotImplementedError

    class Blocking(AsyncHandle):
        def result(self, timeout: float | None = None) -> Result:  # type: ignore[override]
            raise NotImplementedError

    class Renamed(Handle):
        def cancel(self, now: bool = True) -> bool:
            raise NotImplementedError

    (problem,) = api_differences(dataclasses.replace(CLIENTS, aio=Defaults))
    assert problem.startswith("status: parameters")
    assert api_differences(dataclasses.replace(HANDLES, aio=Blocking)) == [
        "result: plain on Blocking, expected coroutine"
    ]
    (problem,) = api_differences(dataclasses.replace(HANDLES, sync=Renamed))
    assert problem.startswith("cancel: parameters")


# -- (b) same results against the real server ------------------------------------------------------
@dataclass
class Step:
    """One call of the scenario: ``call(client)`` for a client call (its value may be
    awaitable), else ``serve(worker)`` for the fake worker's part."""

    label: str
    call: Callable[[Any], Any] | None = None
    serve: Callable[[FakeWorker], Any] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


def _drain(events: Any) -> Any:
    """All events of a sync or async iterator (a list, or a coroutine giving one)."""
    if hasattr(events, "__aiter__"):

        async def collect() -> list[Any]:
            return [e async for e in events]

        return collect()
    return list(events)


def _serve_running(worker: FakeWorker) -> str:
    """Take the next normal request, emit two tokens, leave it running."""
    rid = worker.take()
    worker.emit(rid, 0, ["o", "k"])
    return rid


def scenario() -> Iterator[Step]:
    """The calls both faces make, in order (request ids fixed so outcomes compare)."""
    yield Step(
        "config", lambda c: c.set_queue_config("normal", max_waiting=2, policy="drop_oldest")
    )
    yield Step("read config", lambda c: c.queue_config("normal"))
    yield Step("submit", lambda c: c.submit("a", request_id="p1", max_tokens=4))
    yield Step("same id", lambda c: c.submit("a", request_id="p1", max_tokens=4))
    yield Step("same id, other body", lambda c: c.submit("b", request_id="p1"))
    yield Step("second", lambda c: c.submit("c", request_id="p2"))
    yield Step("try full", lambda c: c.try_submit("d", request_id="p3"))
    yield Step("evict oldest", lambda c: c.submit("d", request_id="p3"))
    yield Step("dropped status", lambda c: c.status("p1"))
    yield Step("dropped result", lambda c: c.handle("p1").result(timeout=10))
    yield Step("batch bound", lambda c: c.set_queue_config("batch", max_waiting=1))
    many = [
        {"prompt": "x", "request_id": "m1", "priority": "batch"},
        {"prompt": "y", "request_id": "m2", "priority": "batch"},
        {"prompt": "z", "request_id": "m3"},
    ]
    yield Step("submit_many", lambda c: c.submit_many(many))
    yield Step("stats", lambda c: c.queue_stats())
    yield Step("cancel queued", lambda c: c.cancel("m1"))
    yield Step("cancel again", lambda c: c.cancel("m1"))
    yield Step("cancelled status", lambda c: c.status("m1"))
    yield Step("cancelled result", lambda c: c.handle("m1").result(timeout=10))
    yield Step("cancel unknown", lambda c: c.cancel("nope"))
    yield Step("status unknown", lambda c: c.status("nope"))
    yield Step("result unknown", lambda c: c.handle("nope").result(timeout=5))
    yield Step("invalid", lambda c: c.submit("x", top_p=0))
    yield Step("invalid many", lambda c: c.submit_many(["ok", {"prompt": "x", "bogus": 1}]))
    yield Step("serve p3", serve=lambda w: w.serve(["Hel", "lo"]))
    yield Step("stream p3", lambda c: _drain(c.stream("p3")))
    yield Step("stream p3 from 1", lambda c: _drain(c.handle("p3").stream(1, timeout=10)))
    yield Step("result p3", lambda c: c.handle("p3").result(timeout=10))
    yield Step("run m3", serve=_serve_running)
    yield Step("running status", lambda c: c.status("m3"))
    yield Step("first tokens", lambda c: _first_two(c.handle("m3")))
    yield Step("cancel running", lambda c: c.cancel("m3"))
    yield Step(
        "block bound", lambda c: c.set_queue_config("critical", max_waiting=0, policy="block")
    )
    yield Step("block wait", lambda c: c.submit("w", priority="critical", timeout=0.05))
    yield Step("late", lambda c: c.submit("e", request_id="e1", priority="batch", deadline_s=0.05))
    yield Step("expired", lambda c: c.handle("e1").result(timeout=20))
    yield Step("expired status", lambda c: c.status("e1"))
    yield Step("stats at end", lambda c: c.queue_stats())
    yield Step("fleet status at end", lambda c: c.fleet_status())


def _first_two(handle: Any) -> Any:
    """The first two events of ``handle`` (a request still running), then the handle closed."""
    events = handle.stream(timeout=10)
    if hasattr(events, "__anext__"):

        async def take() -> list[Any]:
            out = [await anext(events), await anext(events)]
            await events.aclose()
            handle.close()
            return out

        return take()
    out = [next(events), next(events)]
    events.close()
    handle.close()
    return out


VOLATILE_RECORD_FIELDS = ("enqueued_at", "started_at", "first_token_at", "finished_at", "deadline")


def normalized(value: Any) -> Any:
    """A comparable form of an outcome; handles are closed and reduced to their type and id."""
    if isinstance(value, Handle | AsyncHandle):
        value.close()
        return ("handle", value.request_id)
    if isinstance(value, list):
        return [normalized(v) for v in value]
    if isinstance(value, BaseException):
        return ("refused", type(value).__name__, str(value))
    if isinstance(value, RequestRecord):
        d = dataclasses.asdict(value)
        return {k: v for k, v in d.items() if k not in VOLATILE_RECORD_FIELDS}
    if isinstance(value, Result | TokenEvent | TerminalEvent):
        return value.to_dict()
    if isinstance(value, QueueStats):  # when the oldest waits from: set or not
        return dataclasses.replace(value, oldest_waiting_at=value.oldest_waiting_at is not None)
    if isinstance(value, dict) and "workers" in value and "at" in value:  # fleet_status()
        queues = [
            {**q, "oldest_waiting_at": q["oldest_waiting_at"] is not None} for q in value["queues"]
        ]
        return {**value, "at": None, "queues": queues}
    return value


def run_sync(client: Client, worker: FakeWorker) -> list[tuple[str, Any]]:
    out: list[tuple[str, tuple[Any, ...]]] = []
    for step in scenario():
        if step.serve is not None:
            step.serve(worker)
            continue
        assert step.call is not None
        try:
            out.append((step.label, ("ok", normalized(step.call(client)))))
        except Exception as exc:
            out.append((step.label, ("raised", type(exc).__name__, str(exc))))
    return out


async def run_async(client: AsyncClient, worker: FakeWorker) -> list[tuple[str, Any]]:
    out: list[tuple[str, tuple[Any, ...]]] = []
    for step in scenario():
        if step.serve is not None:
            await asyncio.to_thread(step.serve, worker)
            continue
        assert step.call is not None
        try:
            value = step.call(client)
            if inspect.isawaitable(value):
                value = await value
            out.append((step.label, ("ok", normalized(value))))
        except Exception as exc:
            out.append((step.label, ("raised", type(exc).__name__, str(exc))))
    return out


def test_both_faces_give_the_same_results(
    r: redis.Redis, settings: Settings, worker: FakeWorker
) -> None:
    with Client(r, settings=settings, recheck_s=1.0) as client:
        sync_results = run_sync(client, worker)

    r.flushall()

    async def main() -> list[tuple[str, Any]]:
        conn = redis.asyncio.Redis.from_url(settings.redis_url)
        aclient = AsyncClient(conn, settings=settings, recheck_s=1.0)
        try:
            return await run_async(aclient, worker)
        finally:
            await aclient.aclose()
            await conn.aclose()

    async_results = asyncio.run(main())
    for s, a in zip(sync_results, async_results, strict=True):
        assert s == a
    # and the scenario exercised what it claims to
    raised = {label: o[1] for label, o in sync_results if o[0] == "raised"}
    outcomes = {label: o[1] for label, o in sync_results if o[0] == "ok"}
    assert raised == {
        "same id, other body": "IdempotencyConflict",
        "try full": "Overloaded",
        "dropped result": "RequestFailed",
        "cancelled result": "RequestFailed",
        "cancel unknown": "UnknownRequest",
        "status unknown": "UnknownRequest",
        "result unknown": "UnknownRequest",
        "invalid": "InvalidRequest",
        "invalid many": "InvalidRequest",
        "block wait": "Overloaded",
        "expired": "RequestFailed",
    }
    assert outcomes["dropped status"]["status"] == "dropped"
    assert outcomes["submit_many"][1][:2] == ("refused", "Overloaded")
    assert [o[0] for o in outcomes["submit_many"]] == ["handle", "refused", "handle"]
    assert (outcomes["cancel queued"], outcomes["cancel again"]) == (True, False)
    assert [e["type"] for e in outcomes["stream p3"]] == ["token", "token", "done"]
    assert outcomes["stream p3 from 1"] == outcomes["stream p3"][1:]
    assert outcomes["result p3"]["text"] == "Hello"
    assert outcomes["running status"]["status"] == "running"
    assert [e["text"] for e in outcomes["first tokens"]] == ["o", "k"]
    assert outcomes["cancel running"] is True
    assert outcomes["expired status"]["status"] == "expired"
