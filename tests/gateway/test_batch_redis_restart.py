"""Issue 18, item 3: a batch rides out a Redis restart with AOF — no line lost, none written
twice, every line in the output file or the error file.

Real processes and real signals: a private redis-server with AOF (``appendfsync always``: every
acknowledged write survives a SIGKILL) on a TCP port, two ``tokenfleet worker`` processes (the
tiny Llama) and one ``tokenfleet serve`` gateway whose batch runner drives the batch (lease
1.5 s). The batch is created through the gateway's HTTP API with the official ``openai`` SDK;
once some lines are done (and others are in flight), Redis is SIGKILLed, left down for 1 s or
4 s (shorter or longer than the batch lease), and started again on the same port and data
directory. The batch must end ``completed`` with every ``custom_id`` exactly once across the two
files, and no error line (with ``appendfsync always`` Redis loses nothing it acknowledged, so no
line has a reason to fail); the gateway and the workers never exit.
"""

from __future__ import annotations

import io
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from batch_http_helpers import chat_line, jsonl, lines_of, sdk_for
from gateway_helpers import Gateway, Worker, wait_for

from tokenfleet.shared.keys import Keys
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow

LINES = 40
MAX_TOKENS = 20
FINAL = ("completed", "failed", "expired", "cancelled")
GATEWAY_ENV = {"TOKENFLEET_GATEWAY_BATCH_LEASE_MS": "1500", "TOKENFLEET_GATEWAY_BATCH_WINDOW": "8"}


class AofFleet:
    """A private AOF Redis on a TCP port, two workers and one gateway, under one key prefix."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.server = RedisServer(unix_socket=False, appendonly=True).start()
        self.prefix = f"ba{uuid.uuid4().hex[:8]}"
        self.keys = Keys(self.prefix)
        url = self.server.url
        self.workers = [
            Worker(model_dir, url, self.prefix, f"aof-worker-{n}", log_dir) for n in range(2)
        ]
        self.gateway = Gateway(url, self.prefix, log_dir, name="aof-gateway", env=GATEWAY_ENV)

    def redis(self) -> redis.Redis:
        """A fresh command client (the server may have restarted since the last one)."""
        return redis.Redis.from_url(self.server.url, socket_timeout=10)

    def wait_ready(self) -> None:
        r = self.redis()
        try:
            for w in self.workers:
                w.wait_ready(r)
        finally:
            r.close()
        self.gateway.wait_ready()

    def check_alive(self) -> None:
        for proc, name in [(self.gateway, "gateway"), *((w, w.name) for w in self.workers)]:
            assert proc.alive(), f"{name} exited:\n{proc.output()}"

    def close(self) -> None:
        self.gateway.close()
        for w in self.workers:
            w.close()
        self.server.stop()


@pytest.fixture
def aof_fleet(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[AofFleet]:
    f = AofFleet(tiny_llama_dir, tmp_path)
    try:
        f.wait_ready()
        yield f
    finally:
        f.close()


def retrieve(sdk: openai.OpenAI, batch_id: str) -> Any:
    """The batch, or None while the gateway cannot answer (Redis down or just back)."""
    try:
        return sdk.batches.retrieve(batch_id)
    except (openai.APIStatusError, openai.APIConnectionError):
        return None


# how long Redis stays down (the outage itself, not a wait for a condition): shorter than the
# batch lease (1.5 s), and longer, so that the lease has lapsed when Redis comes back
@pytest.mark.parametrize("outage_s", [1.0, 4.0])
def test_a_batch_survives_a_redis_restart_with_aof(aof_fleet: AofFleet, outage_s: float) -> None:
    f = aof_fleet
    sdk = sdk_for(f.gateway.url + "/v1")
    rows = [chat_line(i, max_tokens=MAX_TOKENS) for i in range(LINES)]
    upload = sdk.files.create(file=("aof.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def under_way() -> Any:
        b = sdk.batches.retrieve(batch.id)
        return b.request_counts is not None and b.request_counts.completed >= 3 and b

    mid = wait_for(under_way, "the batch to be under way")
    assert mid.status == "in_progress" and mid.request_counts.completed < LINES
    r = f.redis()
    try:
        assert r.exists(f.keys.batch_lease(batch.id))  # the gateway drives it
        submitted = int(r.hget(f.keys.batch(batch.id), "next_line") or 0)
        recorded = r.hlen(f.keys.batch_done(batch.id))
        f.server.kill()  # SIGKILL: a crash
    finally:
        r.close()
    assert submitted > recorded  # the crash hit lines in flight
    time.sleep(outage_s)
    f.server.start()  # the same port and data directory: AOF replays what was acknowledged
    f.check_alive()

    done = wait_for(
        lambda: (b := retrieve(sdk, batch.id)) is not None and b.status in FINAL and b,
        f"batch {batch.id} to end",
        240,
    )
    out, err = lines_of(sdk, done.output_file_id), lines_of(sdk, done.error_file_id)
    f.check_alive()
    assert done.status == "completed", done
    seen = sorted(row["custom_id"] for row in out + err)
    assert seen == sorted(f"c-{i}" for i in range(LINES))  # every line once: none lost or twice
    assert err == [], err  # AOF with appendfsync always: nothing acknowledged is lost
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (
        LINES,
        LINES,
        0,
    )
    for row in out:
        i = int(row["custom_id"].removeprefix("c-"))
        assert row["response"]["request_id"] == f"{batch.id}-{i}"
        body = row["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
