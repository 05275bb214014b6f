"""``tokenfleet status``: live workers, lapsed names and queues, as text and JSON; per model, its
workers and its waiting requests, shared and routed (with a real worker process)."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
import redis
from thread_worker import ThreadWorker
from worker_helpers import enqueue, make_request, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main
from tokenfleet.worker.commands.routed_status import model_lines
from tokenfleet.worker.commands.status import render, snapshot
from tokenfleet.worker.devtools.local_redis import RedisServer


def test_status_lists_live_workers_and_queues(
    r: redis.Redis,
    settings: Settings,
    keys: Keys,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    now = time.time()
    r.hset(
        keys.worker("gpu-0"),
        mapping={
            "model": "default",
            "priorities": "critical,normal",
            "running": 3,
            "waiting": 0,
            "kv_blocks_used": 10,
            "kv_blocks_total": 40,
            "beat_at": now,
            "started_at": now - 60,
            "tokens_total": 1234,
        },
    )
    r.zadd(keys.workers, {"gpu-0": now, "gone-1": now - 100})
    enqueue(r, keys, make_request("st-1", priority=Priority.BATCH))
    snap = snapshot(r, settings)
    assert [w["name"] for w in snap["workers"]] == ["gpu-0"]
    assert snap["workers"][0]["kv_usage"] == 0.25 and snap["lapsed_workers"] == ["gone-1"]
    batch = next(q for q in snap["queues"] if q["priority"] == "batch")
    assert batch["waiting"] == 1
    text = render(snap)
    assert "gpu-0" in text and "25%" in text and "lapsed" in text
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", "tft")
    assert main(["status", "--json", "--redis-url", settings.redis_url]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert data["workers"][0]["running"] == 3


def _ghost(r: redis.Redis, keys: Keys, model: str, name: str) -> None:
    """A live worker of ``model`` as Redis sees it (heartbeat, served mark, routing target) with
    no process behind it: what is routed to it stays waiting in its routed stream."""
    now = time.time()
    r.hset(keys.worker(name), mapping={"model": model, "beat_at": now, "started_at": now})
    r.zadd(keys.workers, {name: now})
    r.zadd(keys.served, {model: now + 600})
    r.zadd(keys.routers(model), {name: now + 600})
    r.hset(keys.route_load(model), name, "0 8")


@pytest.mark.slow
def test_status_lists_each_model_with_its_workers_and_counts_routed_work_once(
    tiny_model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Each model with a live worker gets its line, a queue or not; a model whose requests wait
    in its shared stream and in a routed one counts each request once."""
    prefix = "tsm"
    keys = Keys(prefix)
    settings = Settings(redis_url=redis_server.url, key_prefix=prefix)
    rr = redis.Redis.from_url(redis_server.url)
    worker = ThreadWorker(  # (nothing signals it: a thread of this process)
        tiny_model_dir, redis_server.url, prefix, "st-real", "--model-name", "st-live"
    )
    try:
        worker.wait_ready(rr)
        wait_for(lambda: (rr.zscore(keys.served, "st-live") or 0) > time.time(), "st-live served")
        _ghost(rr, keys, "st-ghost", "ghost")
        assert b"st-ghost|normal" not in rr.smembers(keys.queues)  # its model has no queue yet
        assert "model st-ghost: workers ghost; waiting 0 (shared 0, routed 0)" in model_lines(
            snapshot(rr, settings)
        )
        with Client.from_url(settings=settings) as client:
            routed = client.submit(
                messages=[{"role": "user", "content": "hi"}],
                model="st-ghost",
                max_tokens=2,
                metadata={"session": "s"},
            )
            shared = client.submit("a short prompt", model="st-ghost", max_tokens=2)
            assert client.status(routed.request_id).routed_to == "ghost"
            assert client.status(shared.request_id).route == "shared"
        snap = snapshot(rr, settings)
        lines = model_lines(snap)
        assert lines == [
            "model st-ghost: workers ghost; waiting 2 (shared 1, routed 1: ghost: 1)",
            "model st-live: workers st-real; waiting 0 (shared 0, routed 0: st-real: 0)",
        ]
        text = render(snap)
        assert all(line in text for line in lines)
        workers = {m["name"]: m["workers"] for m in snap["models"]}
        assert workers == {"st-ghost": ["ghost"], "st-live": ["st-real"]}
    finally:
        worker.close()
        rr.delete(*(rr.keys(f"{prefix}:*") or ["-"]))
        rr.close()
