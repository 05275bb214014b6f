"""The batch runner against a real worker (tiny Llama) on the session's Redis: a batch runs to
completion and its files match its input line by line; the window bounds the batch queue;
cancel and expiry finalize with what is done; two drivers on one batch still write each line
once. Each test has its own key prefix (the module's worker serves all of them: one prefix;
it runs in a thread, tests/thread_worker.py: no test signals it)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from batch_helpers import (
    CHAT,
    COMPLETIONS,
    Env,
    chat_line,
    check_exactly_once,
    final,
    jsonl,
    upload_and_create,
    wait_batch,
    with_env,
)
from gateway_helpers import GATEWAY_FLAGS
from thread_worker import ThreadWorker
from waiting import wait_for_async

from tokenfleet.producer.gateway.batches import BatchObject, BatchRunner, BatchStore
from tokenfleet.producer.gateway.batches.driver import BatchDriver
from tokenfleet.producer.gateway.batches.handle import AsyncBatchHandle
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"bt{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def worker(
    redis_server: RedisServer, plain_redis: redis.Redis, tiny_llama_dir: Path, prefix: str
) -> Iterator[ThreadWorker]:
    """The module's worker, in a thread (no test signals or stops it)."""
    w = ThreadWorker(tiny_llama_dir, redis_server.url, prefix, "batch-worker", flags=GATEWAY_FLAGS)
    try:
        w.wait_ready(plain_redis)
        yield w
    finally:
        w.close()


@pytest.fixture
def bsettings(redis_server: RedisServer, worker: ThreadWorker, prefix: str) -> Settings:
    return Settings(redis_url=redis_server.url, key_prefix=prefix)


async def _run_to_final(env: Env, batch_id: str) -> BatchObject:
    """Drive the batch with a runner of its own until it is final."""
    done: list[BatchObject] = []

    async def wait() -> None:
        done.append(await wait_batch(env, batch_id, final))

    await _with_runner(env, wait())
    return done[0]


async def _with_runner(env: Env, coro: object, **kw: object) -> BatchRunner:
    runner = env.runner(**kw)
    task = asyncio.create_task(runner.run())
    try:
        await coro  # type: ignore[misc]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return runner


def test_a_40_line_batch_completes_and_matches_its_input(bsettings: Settings) -> None:
    lines = [chat_line(i, max_tokens=3 + i % 4) for i in range(40)]

    async def body(env: Env) -> None:
        b = await upload_and_create(env, lines)
        runner = env.runner()
        task = asyncio.create_task(runner.run())
        try:
            b = await wait_batch(env, b.id, final)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert b.status == "completed", b.to_dict()
        d = b.to_dict()
        assert d["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
        for name in ("in_progress_at", "finalizing_at", "completed_at"):
            assert d[name] is not None
        assert d["error_file_id"] is None and d["output_file_id"] is not None
        out, _ = await check_exactly_once(env, b, [x["custom_id"] for x in lines])
        by_id = {x["custom_id"]: x for x in out}
        for i, line in enumerate(lines):  # line by line against the input
            got = by_id[line["custom_id"]]["response"]["body"]
            assert got["object"] == "chat.completion" and got["model"] == "default"
            assert got["usage"]["completion_tokens"] == line["body"]["max_tokens"]
            assert got["choices"][0]["message"]["role"] == "assistant"
            assert by_id[line["custom_id"]]["response"]["request_id"] == f"{b.id}-{i}"
        fobj = await env.files.get(b.output_file_id or "")
        assert fobj.kind == "output" and fobj.batch_id == b.id
        assert fobj.bytes == len(await env.files.content(fobj.id))
        assert not await env.r.sismember(env.batches._keys.batches_active, b.id)
        assert not await env.r.exists(env.batches._keys.batch_lease(b.id))

    with_env(bsettings, body)


def test_a_batchs_lines_are_its_tenants_requests(bsettings: Settings) -> None:
    """A batch made for a tenant (the creating API key's) runs its lines as that tenant's
    requests: they wait in its tenant queue and count in its book (docs/fairness.md)."""
    lines = [chat_line(i, max_tokens=2) for i in range(6)]

    async def body(env: Env) -> None:
        f = await env.files.create("batch", "in.jsonl", jsonl(lines))
        b = await env.batches.create(f.id, CHAT, "24h", None, tenant="acme")
        assert (await env.batches.get(b.id)).tenant == "acme"
        b = await _run_to_final(env, b.id)
        assert b.status == "completed", b.to_dict()
        keys = env.batches._keys
        for i in range(len(lines)):
            assert await env.r.hget(keys.record(f"{b.id}-{i}"), "tenant") == b"acme"
        book = keys.tenant_book("default")
        assert int(await env.r.hget(book, "admitted|acme") or 0) == len(lines)
        assert int(await env.r.hget(book, "served|acme") or 0) > 0

    with_env(bsettings, body)


def test_completions_endpoint_with_an_invalid_line(bsettings: Settings) -> None:
    lines = [
        {
            "custom_id": f"c-{i}",
            "method": "POST",
            "url": COMPLETIONS,
            "body": {"model": "default", "prompt": f"p{i}", "max_tokens": 2, "ignore_eos": True},
        }
        for i in range(5)
    ]
    lines[2]["body"]["best_of"] = 3

    async def body(env: Env) -> None:
        b = await _run_to_final(env, (await upload_and_create(env, lines, COMPLETIONS)).id)
        assert b.status == "completed" and (b.completed, b.failed) == (4, 1)
        out, err = await check_exactly_once(env, b, [x["custom_id"] for x in lines])
        assert out[0]["response"]["body"]["object"] == "text_completion"
        assert err[0]["custom_id"] == "c-2" and err[0]["error"]["code"] == "unsupported_parameter"

    with_env(bsettings, body)


def test_the_window_bounds_the_batch_queue(bsettings: Settings) -> None:
    lines = [chat_line(i, max_tokens=2) for i in range(30)]
    keys = Keys(bsettings.key_prefix)
    # the batch level's entries wherever they wait: the shared stream, or (routed by a prefix
    # the worker's cache holds from the tests before) the module worker's routed stream
    streams = [
        keys.stream("default", Priority.BATCH),
        keys.routed("default", Priority.BATCH, "batch-worker"),
    ]

    async def body(env: Env) -> None:
        b = await upload_and_create(env, lines)
        runner = env.runner(window=3)
        task = asyncio.create_task(runner.run())
        most = 0

        async def final_else_sampled() -> bool:
            nonlocal most
            if (await env.batches.get(b.id)).final:
                return True
            pipe = env.r.pipeline(transaction=False)
            for stream in streams:
                pipe.xlen(stream)
            most = max(most, sum(await pipe.execute()))
            return False

        try:
            await wait_for_async(final_else_sampled, "the batch to end", poll_s=0.005)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert 1 <= most <= 3
        assert runner.drivers[b.id].max_in_flight <= 3
        await check_exactly_once(env, await env.batches.get(b.id), [x["custom_id"] for x in lines])

    with_env(bsettings, body)


def test_cancel_mid_batch(bsettings: Settings) -> None:
    lines = [chat_line(i, max_tokens=24) for i in range(60)]

    async def body(env: Env) -> None:
        b = await upload_and_create(env, lines)

        async def cancel_then_wait() -> None:
            nonlocal b
            await wait_batch(env, b.id, lambda x: x.completed >= 3)
            assert (await env.batches.cancel(b.id)).status == "cancelling"
            b = await wait_batch(env, b.id, final)

        await _with_runner(env, cancel_then_wait(), window=4)
        assert b.status == "cancelled" and b.times.get("cancelled_at")
        assert b.completed >= 3 and b.failed >= 1 and b.completed + b.failed == 60
        _, err = await check_exactly_once(env, b, [x["custom_id"] for x in lines])
        codes = {e["error"]["code"] for e in err}
        assert "batch_cancelled" in codes and codes <= {"batch_cancelled", "cancelled"}
        # a cancelled batch stays cancelled: cancelling it again changes nothing
        assert (await env.batches.cancel(b.id)).status == "cancelled"
        # the lines it had fed are over in the fleet too: cancelled or done, none left running
        keys = env.batches._keys
        fed = [f"{b.id}-{i}" for i in range(b.next_line)]
        assert fed, "the batch fed no line before its cancel"
        statuses = [
            RequestRecord.from_hash(rid, await env.r.hgetall(keys.record(rid))) for rid in fed
        ]
        assert all(rec is not None and rec.status.is_terminal for rec in statuses), statuses

    with_env(bsettings, body)


def test_expiry_finalizes_with_partial_results(bsettings: Settings) -> None:
    lines = [chat_line(i, max_tokens=24) for i in range(60)]

    async def body(env: Env) -> None:
        b = await upload_and_create(env, lines)

        async def expire_then_wait() -> None:
            nonlocal b
            await wait_batch(env, b.id, lambda x: x.completed >= 3)
            await env.r.hset(env.batches._keys.batch(b.id), "expires_at", int(time.time()) - 1)
            b = await wait_batch(env, b.id, final)

        await _with_runner(env, expire_then_wait(), window=4)
        assert b.status == "expired" and b.times.get("expired_at")
        _, err = await check_exactly_once(env, b, [x["custom_id"] for x in lines])
        assert b.completed >= 3 and "batch_expired" in {e["error"]["code"] for e in err}

    with_env(bsettings, body)


def test_two_drivers_on_one_batch_write_each_line_once(bsettings: Settings) -> None:
    """Two drivers with the same lease token (what two runners are while one's lapsed lease
    has not been noticed): both submit and record every line; the ledger keeps one."""
    lines = [chat_line(i, max_tokens=3) for i in range(30)]

    async def body(env: Env) -> None:
        b = await upload_and_create(env, lines)
        runner = env.runner(window=8)
        await env.r.set(env.batches._keys.batch_lease(b.id), runner.cfg.token)
        d1, d2 = BatchDriver(runner.cfg, b.id), BatchDriver(runner.cfg, b.id)
        await asyncio.wait_for(asyncio.gather(d1.run(), d2.run()), 120)
        b = await env.batches.get(b.id)
        assert b.status == "completed" and b.completed == 30
        await check_exactly_once(env, b, [x["custom_id"] for x in lines])

    with_env(bsettings, body)


def test_two_runners_share_the_active_batches(bsettings: Settings) -> None:
    async def body(env: Env) -> None:
        bs = [
            await upload_and_create(env, [chat_line(i + 100 * k, max_tokens=2) for i in range(10)])
            for k in range(3)
        ]
        r1, r2 = env.runner(lease_ms=1000), env.runner(lease_ms=1000)
        tasks = [asyncio.create_task(r.run()) for r in (r1, r2)]
        try:
            done = [await wait_batch(env, b.id, final) for b in bs]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for k, b in enumerate(done):
            assert b.status == "completed"
            await check_exactly_once(env, b, [f"req-{i + 100 * k}" for i in range(10)])

    with_env(bsettings, body)


def test_a_batch_queue_bound_smaller_than_the_window_refuses_nothing(
    bsettings: Settings,
) -> None:
    """With the batch queue bounded at 2 waiting and a window cap of 16, the runner backs off
    on a full queue (try mode: nothing evicted, nothing dropped) and every line still runs."""
    lines = [chat_line(i, max_tokens=2) for i in range(24)]

    async def body(env: Env) -> None:
        await env.client.set_queue_config("batch", "default", max_waiting=2)
        try:
            b = await upload_and_create(env, lines)

            async def wait() -> None:
                nonlocal b
                b = await wait_batch(env, b.id, final)

            runner = await _with_runner(env, wait(), window=16)
        finally:
            await env.client.set_queue_config("batch", "default", max_waiting=10_000)
        assert b.status == "completed" and (b.completed, b.failed) == (24, 0)
        assert runner.drivers[b.id].refusals >= 1  # the bound was met, and nothing was lost
        await check_exactly_once(env, b, [x["custom_id"] for x in lines])

    with_env(bsettings, body)


def test_a_record_lost_to_a_redis_error_is_recorded_again(
    bsettings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line whose end could not be recorded (Redis dropped the connection under that one
    call, while the driver's own loop carried on) is followed again and recorded once; the
    batch does not wait for it until its completion window expires."""
    lines = [chat_line(i, max_tokens=3) for i in range(6)]
    real = BatchDriver._record
    failed: list[int] = []

    async def flaky(self: BatchDriver, i: int, kind: str, line: str) -> bool:
        if not failed:  # the first line to end: its record is lost to a dropped connection
            failed.append(i)
            raise redis.ConnectionError("connection dropped under the record")
        return await real(self, i, kind, line)

    monkeypatch.setattr(BatchDriver, "_record", flaky)

    async def body(env: Env) -> None:
        b = await upload_and_create(env, lines)

        async def wait() -> None:
            nonlocal b
            b = await wait_batch(env, b.id, final, timeout_s=60)

        await _with_runner(env, wait(), lease_ms=1000)
        assert failed and b.status == "completed" and (b.completed, b.failed) == (6, 0)
        await check_exactly_once(env, b, [x["custom_id"] for x in lines])

    with_env(bsettings, body)


def test_a_batch_whose_creator_died_validating_is_validated_again_and_run(
    bsettings: Settings,
) -> None:
    """The creating gateway dies after recording some invalid lines: its validation lease
    lapses, a runner validates the batch again (each invalid line still recorded once) and runs
    it; no batch stays ``validating``."""
    lines = [chat_line(i) for i in range(6)]
    lines[1] = {"custom_id": "bad", "method": "GET", "url": "/v1/chat/completions", "body": {}}

    async def body(env: Env) -> None:
        store = BatchStore(env.r, env.settings, lease_ms=300)
        validate_lines = store._validate

        async def dies_half_way(
            bid: str, endpoint: str, texts: list[str], err_id: str, token: str
        ) -> list[dict[str, object]]:
            await validate_lines(bid, endpoint, texts[:3], err_id, token)  # records line 1
            raise SystemExit("the gateway died")

        store._validate = dies_half_way  # type: ignore[method-assign]
        f = await env.files.create("batch", "in.jsonl", jsonl(lines))
        with pytest.raises(SystemExit):
            await store.create(f.id, "/v1/chat/completions")
        (bid,) = [b.id for b in (await env.batches.list())[0] if b.input_file_id == f.id]
        assert (await env.batches.get(bid)).status == "validating"
        assert await env.r.sismember(env.batches._keys.batches_active, bid)
        runner = env.runner()
        task = asyncio.create_task(runner.run())
        try:
            b = await wait_batch(env, bid, final)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert b.status == "completed", b.to_dict()
        _, err = await check_exactly_once(env, b, [x["custom_id"] for x in lines])
        assert [x["custom_id"] for x in err] == ["bad"]

    with_env(bsettings, body)


@pytest.mark.parametrize("lost_as", ["connection_error", "swallowed"])
def test_a_cancelled_runner_stops_even_when_its_cancel_is_lost_in_redis_py(
    bsettings: Settings, lost_as: str
) -> None:
    """A cancel can be lost on its way into the runner's task: redis-py may answer a cancel that
    lands mid-command with a ConnectionError, and Python 3.11's ``wait_for`` (redis-py writes
    commands under it) returns normally when the write finished at the same moment. The runner
    must still stop (``BatchHandle.wait`` hung in CI awaiting a runner cancelled mid-SMEMBERS)."""

    async def body(env: Env) -> None:
        runner = env.runner(poll_s=0.05)
        ticking = asyncio.Event()

        async def tick() -> None:
            ticking.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if lost_as == "connection_error":
                    raise redis.ConnectionError("cancelled mid-command") from None
                return  # the cancel is dropped; the task still counts it (cancelling() == 1)

        runner.tick = tick
        task = asyncio.create_task(runner.run())
        await asyncio.wait_for(ticking.wait(), 10)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        assert task in done and task.cancelled()  # it stopped, as a cancelled task

    with_env(bsettings, body)


def test_a_line_naming_a_model_the_fleet_does_not_serve_goes_to_the_error_file(
    bsettings: Settings,
) -> None:
    """The fleet (one live worker, model ``default``) refuses ``no-such-model`` for good: those
    lines are error lines ``model_not_found`` and the rest of the batch runs to completion."""
    lines = [chat_line(i, max_tokens=2) for i in range(6)]
    for i in (1, 4):
        lines[i]["body"]["model"] = "no-such-model"

    async def body(env: Env) -> None:
        b = await _run_to_final(env, (await upload_and_create(env, lines)).id)
        assert b.status == "completed" and (b.completed, b.failed) == (4, 2)
        _, err = await check_exactly_once(env, b, [x["custom_id"] for x in lines])
        assert sorted(e["custom_id"] for e in err) == ["req-1", "req-4"]
        assert {e["error"]["code"] for e in err} == {"model_not_found"}
        assert all("no-such-model" in e["error"]["message"] for e in err)

    with_env(bsettings, body)


def test_wait_drives_its_own_batch_and_no_other(bsettings: Settings) -> None:
    async def body(env: Env) -> None:
        mine = await upload_and_create(env, [chat_line(i, max_tokens=2) for i in range(4)])
        other = await upload_and_create(env, [chat_line(i, max_tokens=2) for i in range(4)])
        done = await AsyncBatchHandle(env.client, env.r, mine.id).wait(poll_s=0.05, timeout=120)
        assert done.status == "completed" and done.completed == 4
        left = await env.batches.get(other.id)
        assert left.status == "in_progress" and left.next_line == 0 and left.completed == 0
        assert not await env.r.exists(env.batches._keys.batch_lease(other.id))
        # then it runs when its own handle waits
        ran = await AsyncBatchHandle(env.client, env.r, other.id).wait(poll_s=0.05, timeout=120)
        assert ran.status == "completed" and ran.completed == 4

    with_env(bsettings, body)


def test_wait_with_a_timeout_says_where_the_batch_is(bsettings: Settings) -> None:
    async def body(env: Env) -> None:
        b = await upload_and_create(env, [chat_line(i, max_tokens=2) for i in range(3)])
        handle = AsyncBatchHandle(env.client, env.r, b.id)
        with pytest.raises(TimeoutError, match=rf"{b.id} is not final after 0.2 s: in_progress"):
            await handle.wait(drive=False, poll_s=0.05, timeout=0.2)
        assert (await handle.wait(poll_s=0.05, timeout=120)).status == "completed"

    with_env(bsettings, body)
