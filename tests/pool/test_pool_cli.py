"""``tokenfleet pool create`` and ``tokenfleet pool show`` through the CLI entry point."""

from __future__ import annotations

import orjson
import pytest
import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.worker.cli import main
from tokenfleet.worker.pool.admin import pool_snapshot
from tokenfleet.worker.pool.member import KVPoolMember
from tokenfleet.worker.pool.orders import PreemptAsk

PREFIX = Keys()  # the CLI uses the environment's prefix: the default


@pytest.fixture
def url(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.delenv("TOKENFLEET_KEY_PREFIX", raising=False)
    return redis_url


def test_create_then_show(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pool", "create", "gpu0", "--blocks", "1000", "--chunk", "8"]) == 0
    assert "pool gpu0 created 1000 blocks of 16 tokens" in capsys.readouterr().out
    assert main(["pool", "create", "gpu0", "--blocks", "1000"]) == 0  # same size: a no-op
    assert "exists" in capsys.readouterr().out
    assert main(["pool", "create", "gpu0", "--blocks", "10"]) == 1
    assert "exists with 1000 blocks" in capsys.readouterr().err

    r = redis.Redis.from_url(url)
    a = KVPoolMember(client=r, keys=PREFIX, pool="gpu0", member="w-a", weight=2)
    b = KVPoolMember(client=r, keys=PREFIX, pool="gpu0", member="w-b")
    a.step(active=True, want_blocks=600, blocks_by_priority=[0, 0, 600])
    b.step(active=True, ask=PreemptAsk(Priority.CRITICAL, 50))
    r.close()

    assert main(["pool", "show"]) == 0
    out = capsys.readouterr().out
    assert "pool gpu0: 600/1000 blocks held" in out
    assert "w-a     2       600   667       yes     0     0/0/600" in out
    assert "preemption #1: w-a frees 50 blocks for w-b (critical), pending" in out

    assert main(["pool", "show", "gpu0", "--json"]) == 0
    (view,) = orjson.loads(capsys.readouterr().out)
    assert [(m["name"], m["weight"], m["held"], m["entitlement"]) for m in view["members"]] == [
        ("w-a", 2.0, 600, 667),
        ("w-b", 1.0, 0, 333),
    ]
    assert view["preemptions"][0]["donor"] == "w-a"


def test_show_unknown_pool_fails(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pool", "show", "nope"]) == 1
    assert "pool nope does not exist" in capsys.readouterr().err
    assert main(["pool", "show"]) == 0
    assert capsys.readouterr().out.strip() == "no pools"


def test_create_validates(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pool", "create", "gpu0", "--blocks", "0"]) == 1
    assert "total_blocks" in capsys.readouterr().err
    assert main(["pool", "create", "bad name", "--blocks", "10"]) == 1


def test_snapshot_for_status(url: str) -> None:
    main(["pool", "create", "gpu0", "--blocks", "64"])
    r = redis.Redis.from_url(url)
    view = pool_snapshot(r, PREFIX, "gpu0")
    r.close()
    assert (view["name"], view["total"], view["free"], view["members"]) == ("gpu0", 64, 64, [])


def test_status_shows_pools(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pool", "create", "gpu0", "--blocks", "64"]) == 0
    r = redis.Redis.from_url(url)
    member = KVPoolMember(client=r, keys=PREFIX, pool="gpu0", member="w1", weight=2.0)
    member.join()
    member.step(active=True, want_blocks=16)
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    (pool,) = orjson.loads(capsys.readouterr().out)["pools"]
    assert pool["name"] == "gpu0" and [m["name"] for m in pool["members"]] == ["w1"]
    assert main(["status"]) == 0
    text = capsys.readouterr().out
    assert "KV pools: 1" in text and "gpu0" in text and "w1" in text
    member.leave()
    r.close()


def test_create_with_a_compute_share_and_show_it(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["pool", "create", "gpu0", "--blocks", "64", "--token-budget", "900", "--round-ms", "50"]
    assert main(args) == 0
    r = redis.Redis.from_url(url)
    a = KVPoolMember(client=r, keys=PREFIX, pool="gpu0", member="w-a", weight=2)
    assert a.join()["round_ms"] == 50
    a.step(active=True, token_demand=2000)
    r.close()
    capsys.readouterr()
    assert main(["pool", "show"]) == 0
    out = capsys.readouterr().out
    assert "900 tokens per 50 ms round" in out
    assert "tokens want/share" in out and "2000/900" in out
    assert main(["pool", "create", "gpu1", "--blocks", "64", "--round-ms", "0"]) == 1
    assert "round_ms must be an integer in [1, 60000]" in capsys.readouterr().err
