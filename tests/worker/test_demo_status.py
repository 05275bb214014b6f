"""``tokenfleet demo`` end to end (real processes) and ``tokenfleet status``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import redis
from worker_helpers import enqueue, make_request

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main
from tokenfleet.worker.commands.status import render, snapshot
from tokenfleet.worker.local_redis import RedisServer


@pytest.mark.slow
def test_demo_runs_a_fleet_end_to_end(
    tiny_model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {**os.environ, "REDIS_URL": redis_server.url}
    env.pop("TOKENFLEET_KEY_PREFIX", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfleet.worker.cli",
            "demo",
            "--workers",
            "1",
            "--requests",
            "4",
            "--max-tokens",
            "8",
            "--model",
            str(tiny_model_dir),
            "--model-name",  # the requests must ask for the name the workers serve
            "tiny",
            "--timeout",
            "120",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "tokens/s overall" in out and "4 requests" in out
    table = out[out.index("request   priority") :]
    assert table.count(" done ") == 4, out
    for label in ("critical", "normal", "batch"):
        assert label in table
    assert "workers stopped (exit codes [0])" in out
    # the run's private prefix was cleaned up
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert not [k for k in client.scan_iter(match="demo-*")]
    finally:
        client.close()


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
