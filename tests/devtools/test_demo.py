"""``tokenfleet demo`` end to end: real worker processes, a private Redis, the table it prints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
from child_process import run_command, tokenfleet_args

from tokenfleet.worker.devtools.local_redis import RedisServer


@pytest.mark.slow
def test_demo_runs_a_fleet_end_to_end(
    tiny_llama_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {**os.environ, "REDIS_URL": redis_server.url}
    env.pop("TOKENFLEET_KEY_PREFIX", None)
    proc = run_command(
        tokenfleet_args(
            "demo",
            "--workers",
            "1",
            "--requests",
            "4",
            "--max-tokens",
            "8",
            "--model",
            str(tiny_llama_dir),
            "--model-name",  # the requests must ask for the name the workers serve
            "tiny",
            "--timeout",
            "120",
        ),
        env,
        inherit_env=False,
        cwd=tmp_path,
        timeout_s=240,
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
