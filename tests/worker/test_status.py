"""``tokenfleet status``: live workers, lapsed names and queues, as text and JSON."""

from __future__ import annotations

import time

import orjson
import pytest
import redis
from worker_helpers import enqueue, make_request

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main
from tokenfleet.worker.commands.status import render, snapshot


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
