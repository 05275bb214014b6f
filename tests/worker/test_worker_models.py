"""Models in a fleet with a real worker process (issue 15 item 5): a request for a declared model
waits on it, visibly in ``status`` and ``get``, until a worker serving that model starts it and
clears the mark; the worker's heartbeat makes the model served, and its expiry unserved again."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from worker_helpers import WorkerProc, wait_for

from tokenfleet.producer import Client, ModelNotServed
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main
from tokenfleet.worker.commands import status
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow
PREFIX = "tfsm"
KEYS = Keys(PREFIX)


def _served(client: Client, model: str) -> bool:
    return any(m.served for m in client.models() if m.name == model)


def test_a_declared_model_waits_for_its_worker_then_runs(
    tiny_model_dir: Path,
    redis_server: RedisServer,
    rr: redis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key in rr.scan_iter(f"{PREFIX}:*"):
        rr.delete(key)
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", PREFIX)
    settings = Settings(redis_url=redis_server.url, key_prefix=PREFIX)
    assert main(["models", "declare", "tiny"]) == 0
    assert "declared now: tiny" in capsys.readouterr().out
    with Client.from_url(settings=settings) as client:
        handle = client.submit("Hello", model="tiny", max_tokens=3, temperature=0)
        rid = handle.request_id
        assert client.status(rid).waiting_on == "tiny"
        with pytest.raises(ModelNotServed):
            client.submit("Hello", model="other")
        text = status.render(status.snapshot(rr, settings))
        assert "waiting on model tiny: 1 requests, no live worker (declared)" in text
        assert main(["get", rid]) == 0
        assert "on model tiny" in capsys.readouterr().out

        w = WorkerProc(
            tiny_model_dir, redis_server.url, PREFIX, "sm-1", tmp_path, "--model-name", "tiny"
        )
        try:
            w.wait_ready(rr)
            result = handle.result(timeout=120)
            assert len(result.token_ids) >= 1
            assert rr.hget(KEYS.record(rid), "waiting_on") is None  # START removed it
            assert client.status(rid).waiting_on == ""
            assert _served(client, "tiny")
            assert client.status(client.submit("Hi", model="tiny").request_id).waiting_on == ""
            assert "waiting on model" not in status.render(status.snapshot(rr, settings))
            capsys.readouterr()
            assert main(["models", "fleet"]) == 0
            row = next(
                line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny")
            )
            assert row.split()[:4] == ["tiny", "yes", "yes", "1"]
            w.signal(15)
            assert w.wait() == 0, w.output()
        finally:
            w.close()
        # the worker removed nothing: its served entry lapses with its heartbeat's TTL (2 s)
        wait_for(lambda: not _served(client, "tiny"), "'tiny' to lapse", 30)
        assert client.status(client.submit("Hi", model="tiny").request_id).waiting_on == "tiny"
        assert main(["models", "undeclare", "tiny"]) == 0
        # nothing declared and no live worker: an empty fleet, which accepts any model
        assert client.status(client.submit("Hi", model="other").request_id).waiting_on == "other"
