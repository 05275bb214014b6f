"""The cron runner's rq connection in each Redis mode, from flags and environment: standalone as
the URL says, cluster refused at start with one line (rq's queues need a standalone or Sentinel
Redis), sentinel settings passed through (the connection itself, against real sentinels, and rq
on a standalone Redis beside a fleet on a cluster: tests/ha/test_cron_ha.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from tokenfleet.producer import cron
from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.settings import Settings

CRON_CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "cron_config.py")
NOWHERE_URL = "redis://127.0.0.1:1/0"  # nothing listens: a test that connects would fail
CLUSTER_NODE = "redis://10.0.0.7:7000/0"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "RQ_REDIS_URL",
        "TOKENFLEET_REDIS_MODE",
        "TOKENFLEET_SENTINELS",
        "TOKENFLEET_SENTINEL_SERVICE",
    ):
        monkeypatch.delenv(var, raising=False)


def _settings(*argv: str) -> Settings:
    return cron.rq_settings(cron.build_parser().parse_args([CRON_CONFIG, *argv]))


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


def test_cluster_mode_from_the_environment_exits_2_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENFLEET_REDIS_MODE", "cluster")
    monkeypatch.setenv("REDIS_URL", CLUSTER_NODE)
    assert cron.main([CRON_CONFIG]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("python -m tokenfleet.producer.cron: rq needs a standalone or Sentinel")
    for fix in ("--redis-mode standalone", "--url", "RQ_REDIS_URL", "the rq worker's own"):
        assert fix in err


def test_cluster_mode_from_the_flag_is_refused_before_connecting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cron.main([CRON_CONFIG, "--redis-mode", "cluster", "--url", NOWHERE_URL]) == 2
    assert "not a Redis Cluster" in _one_line_error(capsys)
    with pytest.raises(SettingsError, match="rq needs a standalone or Sentinel Redis"):
        cron.rq_connection(Settings(redis_url=CLUSTER_NODE, redis_mode="cluster"))


def test_a_bad_sentinel_list_exits_2_with_the_settings_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--redis-mode", "sentinel", "--sentinels", "s1:26379,s2", "--sentinel-service", "m"]
    assert cron.main([CRON_CONFIG, *argv]) == 2
    assert "entry 's2' is not host:port" in _one_line_error(capsys)


def test_rq_url_is_the_flag_else_rq_redis_url_else_redis_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://fleet:6379/0")
    assert _settings().redis_url == "redis://fleet:6379/0"
    monkeypatch.setenv("RQ_REDIS_URL", "redis://rq:6379/1")
    assert _settings().redis_url == "redis://rq:6379/1"
    assert _settings("--url", "redis://flag:6379/2").redis_url == "redis://flag:6379/2"
    assert _settings("--redis-url", "redis://alias:6379/3").redis_url == "redis://alias:6379/3"
    monkeypatch.delenv("REDIS_URL")
    monkeypatch.delenv("RQ_REDIS_URL")
    assert _settings().redis_url == "redis://localhost:6379/0"


def test_sentinel_flags_reach_the_settings_of_rqs_redis() -> None:
    settings = _settings(
        "--redis-mode", "sentinel", "--sentinels", "s1:26379,s2:26380",
        "--sentinel-service", "mymaster", "--url", "redis://:pw@ignored:6379/3",
    )  # fmt: skip
    assert settings.redis_mode == "sentinel" and settings.sentinel_service == "mymaster"
    assert settings.sentinel_addresses() == [("s1", 26379), ("s2", 26380)]
    assert settings.redis_url == "redis://:pw@ignored:6379/3"  # db, password (host ignored)


def test_standalone_flag_over_a_cluster_environment_enqueues_on_the_url(
    monkeypatch: pytest.MonkeyPatch, r: redis.Redis, redis_url: str
) -> None:
    """The documented fix: the cron process on a standalone Redis for rq while its environment
    (shared with the rq worker, whose jobs reach the fleet) says cluster."""
    monkeypatch.setenv("TOKENFLEET_REDIS_MODE", "cluster")
    monkeypatch.setenv("REDIS_URL", CLUSTER_NODE)
    scheduler = cron.build_scheduler(
        [CRON_CONFIG, "--redis-mode", "standalone", "--url", redis_url]
    )
    try:
        assert [j.name for j in scheduler.enqueue_jobs()] == ["hourly-summary"]
    finally:
        scheduler.connection.close()
    [job] = Queue("tokenfleet-cron", connection=r, serializer=JSONSerializer).get_jobs()
    assert job.func_name == "tokenfleet.producer.jobs.generate"
    assert job.kwargs["on_overload"] == "skip"
