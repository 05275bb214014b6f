"""Crashes mid-batch, with real processes: a runner SIGKILLed (a second runner takes over once
its lease lapses) and a worker SIGKILLed under a batch made through the openai SDK and driven
by a real gateway (a second worker runs what it held). In both the output is checked line by
line against the input: no loss, no duplicate."""

from __future__ import annotations

import asyncio
import io
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from batch_helpers import (
    Env,
    chat_line,
    check_exactly_once,
    final,
    upload_and_create,
    wait_batch,
    with_env,
)
from batch_http_helpers import completed, jsonl, lines_of, sdk_for
from batch_http_helpers import final as http_final
from gateway_helpers import Gateway, Proc, Worker, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"bc{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-crash-logs")


@pytest.fixture(scope="module")
def workers(
    redis_server: RedisServer,
    plain_redis: redis.Redis,
    tiny_llama_dir: Path,
    log_dir: Path,
    prefix: str,
) -> Iterator[list[Worker]]:
    ws = [
        Worker(tiny_llama_dir, redis_server.url, prefix, f"bc-worker-{n}", log_dir)
        for n in range(2)
    ]
    try:
        yield [w.wait_ready(plain_redis) for w in ws]
    finally:
        for w in ws:
            w.close()


@pytest.fixture
def bsettings(redis_server: RedisServer, workers: list[Worker], prefix: str) -> Settings:
    return Settings(redis_url=redis_server.url, key_prefix=prefix)


def test_a_runner_sigkilled_mid_batch_is_taken_over(bsettings: Settings, log_dir: Path) -> None:
    lines = [chat_line(i, max_tokens=16) for i in range(40)]
    env_vars = {"REDIS_URL": bsettings.redis_url, "TOKENFLEET_KEY_PREFIX": bsettings.key_prefix}
    args = [sys.executable, "-m", "tokenfleet.producer.gateway.batches.runner"]
    args += ["--lease-ms", "1500", "--window", "8"]

    async def body(env: Env) -> None:
        b = await upload_and_create(env, lines)
        proc = Proc(args, env_vars, log_dir / "runner-1.log")
        try:
            mid = await wait_batch(env, b.id, lambda x: x.completed >= 5)
            assert not mid.final and proc.alive(), proc.output()
            proc.signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            proc.close()
        lease = env.batches._keys.batch_lease(b.id)
        dead_token = await env.r.get(lease)
        assert dead_token is not None  # the dead runner's lease, until it lapses
        mid = await env.batches.get(b.id)
        recorded = await env.r.hlen(env.batches._keys.batch_done(b.id))
        assert mid.next_line > recorded  # it died with lines in flight: re-attached by id
        runner = env.runner(lease_ms=1500)
        task = asyncio.create_task(runner.run())
        try:
            b = await wait_batch(env, b.id, final)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert b.status == "completed" and (b.completed, b.failed) == (40, 0), b.to_dict()
        assert runner.cfg.token.encode() != dead_token
        out, _ = await check_exactly_once(env, b, [x["custom_id"] for x in lines])
        for x in out:
            i = int(x["custom_id"].removeprefix("req-"))
            assert x["response"]["request_id"] == f"{b.id}-{i}"
            assert x["response"]["body"]["usage"]["completion_tokens"] == 16

    with_env(bsettings, body)


def test_a_worker_sigkilled_mid_batch_loses_nothing(
    bsettings: Settings, workers: list[Worker], log_dir: Path
) -> None:
    """As a user meets it: the batch made through the openai SDK and driven by a real
    ``tokenfleet serve`` gateway; one of the two workers SIGKILLed while it runs lines of it."""
    lines = [chat_line(i, max_tokens=24 if i % 2 else 120) for i in range(40)]
    gateway = Gateway(
        bsettings.redis_url,
        bsettings.key_prefix,
        log_dir,
        name="bc-gateway",
        env={"TOKENFLEET_GATEWAY_BATCH_WINDOW": "8"},
    ).wait_ready()
    try:
        sdk = sdk_for(gateway.url + "/v1")
        upload = sdk.files.create(file=("w.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = sdk.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with Client.from_url(settings=bsettings) as client:
            wait_for(lambda: completed(sdk, batch.id) >= 4, "the batch to be under way")
            wait_for(lambda: _running_on(client, batch.id, workers[0].name), "a line on worker 0")
            workers[0].signal(signal.SIGKILL)
            workers[0].wait(10)
            # what it held when it died: its records stay "running" under its name until the
            # other worker claims them (after its heartbeat lapses), so this read is exact
            held = _running_on(client, batch.id, workers[0].name)
            assert held, "the killed worker held no line of the batch"
            done = http_final(sdk, batch.id)
            out, err = lines_of(sdk, done.output_file_id), lines_of(sdk, done.error_file_id)
            assert done.status == "completed", done
            assert (done.request_counts.completed, done.request_counts.failed) == (40, 0)
            assert err == []
            assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
            for x in out:  # every line once, and whole (ignore_eos: exactly its max_tokens)
                i = int(x["custom_id"].removeprefix("req-"))
                assert x["response"]["request_id"] == f"{batch.id}-{i}"
                usage = x["response"]["body"]["usage"]
                assert usage["completion_tokens"] == lines[i]["body"]["max_tokens"], x
            for rid in held:  # what the killed worker held was run again by the other one
                record = client.status(rid)
                assert record.attempts >= 2 and record.ran_on == workers[1].name
    finally:
        gateway.close()


def _running_on(client: Client, batch_id: str, worker: str) -> list[str]:
    """Ids of the batch's requests running on ``worker`` now."""
    b = client.batch(batch_id).status()
    held = []
    for i in range(b.next_line):
        record = client.status(f"{batch_id}-{i}")
        if record.status.value == "running" and record.worker == worker:
            held.append(record.request_id)
    return held
