"""The batch scripts against the real server: the ledger writes a line once whoever records it
(sequentially and from many concurrent callers), the lease renews and releases only for its
holder, and ``next_line`` never moves back."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio

from tokenfleet.producer.gateway.batches.scripts import ADVANCE, LEASE, RECORD
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.scripts.registry import acall, call
from tokenfleet.shared.settings import Settings


def _record_keys(keys: Keys) -> list[str]:
    return [keys.batch_done("b"), keys.batch("b"), keys.file_lines("out"), keys.file_lines("err")]


def test_record_writes_each_index_once(r: redis.Redis, keys: Keys) -> None:
    k = _record_keys(keys)
    assert call(r, RECORD, k, [0, "ok", "first"]) == ["ok", 1]
    assert call(r, RECORD, k, [0, "err", "again"]) == ["ok", 0]
    assert call(r, RECORD, k, [1, "err", "bad"]) == ["ok", 1]
    assert r.lrange(keys.file_lines("out"), 0, -1) == [b"first"]
    assert r.lrange(keys.file_lines("err"), 0, -1) == [b"bad"]
    h = r.hgetall(keys.batch("b"))
    assert h[b"completed"] == b"1" and h[b"failed"] == b"1"
    assert h[b"output_bytes"] == b"6" and h[b"error_bytes"] == b"4"
    assert r.hgetall(keys.batch_done("b")) == {b"0": b"ok", b"1": b"err"}


def test_record_from_many_concurrent_callers(settings: Settings, keys: Keys) -> None:
    async def main() -> list[int]:
        rs = [redis.asyncio.Redis.from_url(settings.redis_url) for _ in range(4)]
        try:
            calls = [
                acall(rs[n], RECORD, _record_keys(keys), [i, "ok", f"{i}-{n}"])
                for i in range(50)
                for n in range(4)
            ]
            return [int(reply[1]) for reply in await asyncio.gather(*calls)]
        finally:
            for c in rs:
                await c.aclose()

    wrote = asyncio.run(main())
    assert sum(wrote) == 50
    r = redis.Redis.from_url(settings.redis_url)
    raw: list[bytes] = r.lrange(keys.file_lines("out"), 0, -1)  # type: ignore[assignment]
    lines = [x.decode().split("-")[0] for x in raw]
    assert sorted(lines, key=int) == [str(i) for i in range(50)]
    assert r.hget(keys.batch("b"), "completed") == b"50"
    r.close()


def test_lease_renews_and_releases_only_for_its_holder(r: redis.Redis, keys: Keys) -> None:
    lease = keys.batch_lease("b")
    assert call(r, LEASE, [lease], ["me", 5000]) == ["lost"]  # nobody holds it
    r.set(lease, "me", px=1000)
    assert call(r, LEASE, [lease], ["you", 5000]) == ["lost"]
    assert call(r, LEASE, [lease], ["me", 5000]) == ["ok"]
    assert r.pttl(lease) > 1000
    assert call(r, LEASE, [lease], ["you", 0]) == ["lost"] and r.exists(lease)
    assert call(r, LEASE, [lease], ["me", 0]) == ["ok"] and not r.exists(lease)


def test_next_line_only_moves_forward(r: redis.Redis, keys: Keys) -> None:
    b = [keys.batch("b")]
    assert call(r, ADVANCE, b, [5]) == ["ok", 5]
    assert call(r, ADVANCE, b, [3]) == ["ok", 5]
    assert call(r, ADVANCE, b, [9]) == ["ok", 9]
    assert r.hget(keys.batch("b"), "next_line") == b"9"
