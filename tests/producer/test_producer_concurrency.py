"""Eight producer processes hammer three bounded queues (one per policy) with no worker.

Invariants checked: no queue ever holds more waiting requests than its bound; every accepted id
is either still waiting or ended ``dropped`` with its record and exactly one terminal event;
every refused call raised ``Overloaded``.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson
import redis
from child_process import ChildProcess
from waiting import wait_for

from tokenfleet.producer import Client, Overloaded
from tokenfleet.producer.core import ops
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.queue_stats import QUEUE_STATS
from tokenfleet.shared.settings import Settings

HERE = Path(__file__).resolve().parent
BOUND = 5
PER_PROCESS = 25
PROCESSES = 8
POLICIES = {
    Priority.CRITICAL: "drop_newest",
    Priority.NORMAL: "drop_oldest",
    Priority.BATCH: "block",
}


def hammer(redis_url: str) -> dict[str, dict[str, list[str]]]:
    """One producer process: submit PER_PROCESS requests to each queue, interleaved."""
    settings = Settings(redis_url=redis_url, key_prefix="tft")
    out: dict[str, dict[str, list[str]]] = {
        p.label: {"accepted": [], "overloaded": [], "other": []} for p in POLICIES
    }
    with Client.from_url(settings=settings) as client:
        for _ in range(PER_PROCESS):
            for priority in POLICIES:
                try:
                    h = client.submit("hammer", priority=priority.label, timeout=0.01)
                    out[priority.label]["accepted"].append(h.request_id)
                    h.close()
                except Overloaded:
                    out[priority.label]["overloaded"].append("")
                except Exception as exc:  # any other error is a failure of the invariant
                    out[priority.label]["other"].append(repr(exc))
    return out


def _hammer_in_processes(redis_url: str, log_dir: Path) -> list[dict[str, dict[str, list[str]]]]:
    """:func:`hammer` in PROCESSES processes at once; each one's result."""
    child = (
        f"import sys, orjson; sys.path[:0] = {[str(HERE.parent), str(HERE)]!r}; "
        "from test_producer_concurrency import hammer; "
        "sys.stdout.buffer.write(orjson.dumps(hammer(sys.argv[1])))"
    )
    with ExitStack() as stack:
        procs = []
        for i in range(PROCESSES):
            proc = ChildProcess(
                [sys.executable, "-c", child, redis_url],
                log_dir / f"producer-{i}.out",
                stderr_path=log_dir / f"producer-{i}.err",
            )
            stack.callback(proc.close)
            procs.append(proc)
        results = []
        for proc in procs:
            assert proc.wait(120) == 0, proc.errors()
            results.append(orjson.loads(proc.output(tail=None)))
        return results


def _waiting(r: redis.Redis, keys: Keys) -> dict[Priority, int]:
    flat: list[str] = []
    for p in POLICIES:
        flat += [keys.stream("default", p), keys.queue_config("default", p)]
    reply = registry.call(r, QUEUE_STATS, flat, [CONSUMER_GROUP])
    rows = ops.stats_rows([("default", p) for p in POLICIES], reply)  # (the client's parse)
    return {Priority.parse(row.priority): row.waiting for row in rows}


def test_bounds_hold_under_concurrent_producers(
    redis_url: str, r: redis.Redis, keys: Keys, client: Client, tmp_path: Path
) -> None:
    for priority, policy in POLICIES.items():
        client.set_queue_config(priority.label, max_waiting=BOUND, policy=policy)

    events: list[tuple[str, bytes]] = []
    pubsub = r.pubsub()
    pubsub.psubscribe(keys.channel("*"))
    assert pubsub.get_message(timeout=5)["type"] == "psubscribe"
    stop = threading.Event()
    max_seen: Counter[Priority] = Counter()

    def collect() -> None:
        while not stop.is_set():
            m = pubsub.get_message(timeout=0.2)
            if m and m["type"] == "pmessage":
                events.append((m["channel"].decode(), m["data"]))

    def sample() -> None:
        sampler = redis.Redis.from_url(redis_url)
        while not stop.is_set():
            for p, n in _waiting(sampler, keys).items():
                max_seen[p] = max(max_seen[p], n)
        sampler.close()

    threads = [threading.Thread(target=collect), threading.Thread(target=sample)]
    for t in threads:
        t.start()
    try:
        results = _hammer_in_processes(redis_url, tmp_path)
        total = PROCESSES * PER_PROCESS
        dropped_ids: set[str] = set()
        for priority, policy in POLICIES.items():
            label = priority.label
            accepted = [i for res in results for i in res[label]["accepted"]]
            refused = sum(len(res[label]["overloaded"]) for res in results)
            assert [e for res in results for e in res[label]["other"]] == []
            assert len(accepted) + refused == total
            assert len(set(accepted)) == len(accepted)
            entries: Any = r.xrange(keys.stream("default", priority))
            in_stream = {f[b"id"].decode() for _, f in entries}
            assert len(in_stream) <= BOUND
            statuses: Counter[str] = Counter()
            for rid in accepted:
                status: Any = r.hget(keys.record(rid), "status")
                assert status is not None, f"accepted {rid} has no record"
                statuses[status.decode()] += 1
                if status == b"queued":
                    assert rid in in_stream
                else:
                    assert status == b"dropped" and policy == "drop_oldest"
                    dropped_ids.add(rid)
            assert statuses["queued"] == len(in_stream) == BOUND
            if policy == "drop_oldest":
                assert refused == 0 and statuses["dropped"] == total - BOUND
            else:
                assert refused == total - BOUND
        wait_for(
            lambda: len(events) >= len(dropped_ids),
            "a terminal event per dropped request",
            timeout_s=30,
            poll_s=0.05,
        )
    finally:
        stop.set()
        for t in threads:
            t.join()
        pubsub.close()
    per_channel = Counter(channel for channel, _ in events)
    assert set(per_channel) == {keys.channel(i) for i in dropped_ids}
    assert set(per_channel.values()) == {1}  # exactly one terminal event each
    assert {orjson.loads(data)["type"] for _, data in events} == {"dropped"}
    assert all(n <= BOUND for n in max_seen.values()), max_seen
    assert _waiting(r, keys) == dict.fromkeys(POLICIES, BOUND)
