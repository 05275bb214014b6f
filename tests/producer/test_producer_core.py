"""The client logic is sans-I/O: plans driven by hand, with scripted replies and no Redis, and
the drivers' one contract (a reply is sent in, an exception thrown in at the ``yield``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, get_args

import pytest
import redis
from redis.commands.core import HashCommands

from tokenfleet.producer import Client, Handle, ModelNotServed, Overloaded, UnknownRequest
from tokenfleet.producer.async_io.driver import AsyncDriver
from tokenfleet.producer.core import ops
from tokenfleet.producer.core.effects import (
    Command,
    Compute,
    Effect,
    Plan,
    RunScript,
    Sleep,
    Subscribe,
)
from tokenfleet.producer.core.slot_clients import SlotClients
from tokenfleet.producer.core.subscriptions import (
    RECONNECT_BACKOFF_CEILING_S,
    RECONNECT_BACKOFF_FIRST_S,
    Backoff,
)
from tokenfleet.producer.sync_io.driver import SyncDriver
from tokenfleet.shared.errors import ScriptError
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.prefix_chain import prefix_chain
from tokenfleet.shared.route_spec import RouteSpec
from tokenfleet.shared.scripts.enqueue import ENQUEUE
from tokenfleet.shared.settings import Settings

# routing off: a submit is enqueue, subscribe (with routing on, see
# test_submit_with_routing_reads_the_routers_once_a_second)
SETTINGS = Settings(redis_url="redis://127.0.0.1:1/0", key_prefix="core", routing="off")


@pytest.fixture
def offline() -> Iterator[Client]:
    """A client whose Redis is never reached: its plans are only driven by hand."""
    client = Client(redis.Redis.from_url(SETTINGS.redis_url), settings=SETTINGS)
    yield client
    client.close()


def test_status_is_one_hgetall_and_no_record_is_unknown(offline: Client) -> None:
    plan = offline._status("r1")
    assert next(plan) == Command(HashCommands.hgetall, (Keys("core").record("r1"),))
    with pytest.raises(UnknownRequest, match="no request r1"):
        plan.send({})


def test_submit_subscribes_after_the_enqueue_and_survives_a_closed_subscriber(
    offline: Client,
) -> None:
    plan = offline._submit("hi", {"request_id": "r1"}, timeout=None, try_only=False)
    enqueue = next(plan)
    assert isinstance(enqueue, RunScript) and enqueue.script is ENQUEUE
    subscribe = plan.send(["ok"])  # enqueued anew
    assert subscribe == Subscribe(Keys("core").channel("r1"), offline.subscribe_timeout_s, False)
    with pytest.raises(StopIteration) as stop:  # closed meanwhile: the request exists anyway
        plan.throw(redis.ConnectionError("the client is closed"))
    handle = stop.value.value
    assert isinstance(handle, Handle) and handle.request_id == "r1" and handle._sub is None


def test_submit_with_routing_reads_the_routers_once_a_second() -> None:
    client = Client(
        redis.Redis.from_url(SETTINGS.redis_url), settings=replace(SETTINGS, routing="prefix")
    )
    try:
        plan = client._submit("hi", {"request_id": "r1"}, timeout=None, try_only=False)
        spec = next(plan)  # how the model's workers tokenize: none published yet
        assert spec == Command(
            HashCommands.hget, (Keys("core").route_tokenizer("default"), "digest")
        )
        read = plan.send(None)
        assert isinstance(read, Command) and read.args[0] == Keys("core").routers("default")
        enqueue = plan.send([b"w1"])
        assert isinstance(enqueue, RunScript) and "w1" in enqueue.args
        again = client._submit("hi", {"request_id": "r2"}, timeout=None, try_only=False)
        assert isinstance(next(again), RunScript)  # the candidates (and no spec) are cached
    finally:
        client.close()


def test_submit_with_routing_computes_the_chain_with_the_published_route_tokenizer() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["zero", "one", "two", "three", "four", "five", "six", "seven"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="zero"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    spec = RouteSpec(tok.to_str(), "", {}, block_size=2)
    client = Client(
        redis.Redis.from_url(SETTINGS.redis_url), settings=replace(SETTINGS, routing="prefix")
    )
    try:
        prompt = "one two three four five six seven"
        plan = client._submit(prompt, {"request_id": "r1"}, timeout=None, try_only=False)
        key = Keys("core").route_tokenizer("default")
        assert next(plan) == Command(HashCommands.hget, (key, "digest"))
        assert plan.send(spec.digest.encode()) == Command(HashCommands.hgetall, (key,))
        fields = {k.encode(): v.encode() for k, v in spec.to_hash().items()}
        plan.send(fields)  # -> the routers
        enqueue = plan.send([b"w1"])
        assert isinstance(enqueue, RunScript)
        chain = prefix_chain([1, 2, 3, 4, 5, 6, 7], 2)  # the words' ids, in 2-token blocks
        assert len(chain) == 3 and " ".join(chain) in enqueue.args
        # a long prompt is tokenized in a Compute effect (the asyncio face: on a thread)
        long_prompt = " ".join(words[1:] * 200)
        plan = client._submit(long_prompt, {"request_id": "r2"}, timeout=None, try_only=False)
        compute = next(plan)  # the route tokenizer is cached: tokenizing comes first
        assert isinstance(compute, Compute)
        chains = compute.fn()
        assert chains == [prefix_chain([*range(1, 8)] * 200, 2)]
        plan.send(chains)  # -> the enqueue (routers cached)
    finally:
        client.close()


def test_a_block_queue_is_polled_with_growing_delays(offline: Client) -> None:
    plan = offline._submit("hi", {}, timeout=None, try_only=False)
    next(plan)
    first, growth, ceiling = ops.BLOCK_POLL
    delays = []
    for _ in range(12):
        sleep = plan.send(["ok", 1, b"full", b"queue is full"])
        assert isinstance(sleep, Sleep)
        delays.append(sleep.seconds)
        assert isinstance(plan.send(None), RunScript)  # then it asks again
    assert delays[:2] == [first, first * growth]
    assert max(delays) == ceiling and delays == sorted(delays)


def test_a_refusal_ends_the_plan_with_its_error(offline: Client) -> None:
    plan = offline._submit("hi", {}, timeout=0.0, try_only=True)
    next(plan)
    with pytest.raises(Overloaded, match="queue is full"):
        plan.send(["ok", 1, b"full", b"queue is full"])


def _boom(_client: object) -> None:
    raise ValueError("boom")


async def _aboom(_client: object) -> None:
    raise ValueError("boom")


def _catching(command: Any) -> Plan[str]:
    try:
        yield Command(command, ())
    except ValueError as exc:
        return f"caught {exc}"
    return "not raised"


def _sync_driver() -> SyncDriver:
    client = redis.Redis.from_url(SETTINGS.redis_url)
    return SyncDriver(SlotClients.single(client, None), client)  # type: ignore[arg-type]


def _async_driver() -> AsyncDriver:
    return AsyncDriver(SlotClients.single(None, None), None)  # type: ignore[arg-type]


def test_drivers_throw_an_effects_exception_into_the_plan() -> None:
    sync = _sync_driver()
    assert sync.run(_catching(_boom)) == "caught boom"
    aio = _async_driver()
    assert asyncio.run(aio.run(_catching(_aboom))) == "caught boom"


def test_both_drivers_perform_every_effect_type() -> None:
    effect_types = set(get_args(Effect))
    assert len(effect_types) == 9
    sync = _sync_driver()
    assert set(sync._perform) == effect_types
    assert set(_async_driver()._perform) == effect_types


def test_an_uncaught_exception_leaves_the_driver() -> None:
    def plan() -> Plan[None]:
        yield Command(_boom, ())

    with pytest.raises(ValueError, match="boom"):
        _sync_driver().run(plan())


def test_stream_refuses_a_bad_index(offline: Client) -> None:
    handle = offline.handle("r1")
    for bad in (-1, True, "0"):
        with pytest.raises(ValueError, match="from_index"):
            next(handle.stream(bad))  # type: ignore[arg-type]


def test_reconnect_backoff_doubles_up_to_its_ceiling_and_resets() -> None:
    backoff = Backoff(jitter=lambda: 1.0)  # the bound itself (jitter draws below it)
    delays = [backoff.next() for _ in range(10)]
    assert delays[:3] == [RECONNECT_BACKOFF_FIRST_S, 2 * RECONNECT_BACKOFF_FIRST_S, 0.2]
    assert max(delays) == RECONNECT_BACKOFF_CEILING_S == delays[-1]
    backoff.reset()
    assert backoff.next() == RECONNECT_BACKOFF_FIRST_S


def test_reconnect_backoff_jitters_between_half_and_all_of_its_bound() -> None:
    low, high = Backoff(jitter=lambda: 0.0), Backoff()
    assert low.next() == RECONNECT_BACKOFF_FIRST_S / 2
    draws = [high.next() for _ in range(10)]
    bounds = [min(RECONNECT_BACKOFF_FIRST_S * 2**i, RECONNECT_BACKOFF_CEILING_S) for i in range(10)]
    assert all(b / 2 <= d <= b for d, b in zip(draws, bounds, strict=True))


def test_enqueue_answers_name_only_what_was_not_new() -> None:
    ids = ["a", "b", "c"]
    assert ops.enqueue_refusals(["ok"], ids) == [None, None, None]
    out = ops.enqueue_refusals(["ok", 1, b"exists", b"done", 3, b"unserved", b"no"], ids, "m")
    assert out[:2] == [None, None] and isinstance(out[2], ModelNotServed)
    assert out[2].model == "m" and str(out[2]) == "no"
    assert ops.enqueue_pair(["ok"]) == ("new", "")
    assert ops.enqueue_pair(["ok", 1, b"full", b"x"]) == ("full", "x")
    for bad in (
        ["ok", 1, b"new"],
        ["ok", 4, b"exists", b"done"],
        ["ok", 2, b"a", b"", 1, b"b", b""],
    ):
        with pytest.raises(ScriptError):
            ops.enqueue_refusals(bad, ids)
