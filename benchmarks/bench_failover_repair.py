"""A repair's cost: from Redis being back to every stream flowing again, 32 running requests.

One worker (tiny model, ``--max-num-seqs 32``, 1 thread) runs 32 greedy streaming requests
(``Handle.stream()`` on one ``Client``); once every one has tokens out, Redis is SIGKILLed and
started again on the same port. Two sides, alternating, each round a fresh server and worker:

* ``aof``: Redis with AOF (``appendfsync always``): the restart keeps everything, so nothing is
  repaired; the time is the outage's own (the worker's backoff, its restore, the clients'
  resync);
* ``snapshot``: no AOF; a snapshot (``SAVE``) is taken once every stream has tokens out, the run
  goes on for ``--after-s`` seconds, then the restart loads the snapshot: every list is short,
  every record older, and the worker repairs all 32 from its memory before it publishes again.

Per round: ``flowing`` = the time from the worker's reconnect (its log line "Redis answers
again", wall clock, ms) until every stream has received an index it did not have at the kill;
``pass`` = the worker's repair pass (its log: the read round trip and one ``REPAIR`` per request
needing it). Every
request must end ``done`` with all its tokens (else the round fails). Run::

    .venv/bin/python benchmarks/bench_failover_repair.py            # 3 rounds of each side
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from tokenfleet.producer import Client
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.schema import TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures
from tokenfleet.worker.devtools.local_redis import RedisServer

PREFIX = "bench-repair"
NUM_REQUESTS = 32
_BACK = re.compile(r"^(\S+ \S+) WARNING .*Redis answers again", re.MULTILINE)
_PUT_BACK = re.compile(r"after a Redis rollback: (\d+) tokens put back")
_PASS = re.compile(
    r"repair pass: (\d+) running and (\d+) ended .*?, (\d+) needed something, in ([\d.]+) ms"
)


class Stream:
    """One request read on a thread: each event's index and arrival time."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.seen: list[tuple[int, float]] = []
        self.end: TerminalEvent | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            for event in self.handle.stream(timeout=600):
                if isinstance(event, TokenEvent):
                    self.seen.append((event.index, time.time()))
                else:
                    self.end = event
        except BaseException as exc:  # reported by the round
            self.error = exc

    def count(self) -> int:
        return len(self.seen)

    def first_after(self, index: int) -> float | None:
        """When the first index >= ``index`` arrived (None: not yet)."""
        for i, at in self.seen:
            if i >= index:
                return at
        return None


def one_round(
    side: str, model: Path, max_tokens: int, after_s: float, log_dir: Path
) -> dict[str, float]:
    server = RedisServer(unix_socket=False, appendonly=side == "aof").start()
    log_path = log_dir / f"worker-{side}-{time.monotonic_ns()}.log"
    env = {**os.environ, "REDIS_URL": server.url, "TOKENFLEET_KEY_PREFIX": PREFIX}
    args = [sys.executable, "-m", "tokenfleet.worker.cli", "worker", "--model", str(model),
            "--name", "bench-w", "--threads", "1", "--max-num-seqs", str(NUM_REQUESTS)]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        r = redis.Redis.from_url(server.url)
        _wait(lambda: r.exists(Keys(PREFIX).worker("bench-w")), "the worker's heartbeat", 120)
        settings = Settings(redis_url=server.url, key_prefix=PREFIX)
        with Client.from_url(settings=settings) as client:
            streams = [
                Stream(
                    client.submit(
                        f"Stream {i} of the repair benchmark",
                        max_tokens=max_tokens,
                        temperature=0.0,
                        ignore_eos=True,
                    )
                )
                for i in range(NUM_REQUESTS)
            ]
            _wait(lambda: all(s.count() >= 4 for s in streams), "every stream's first tokens", 120)
            if side == "snapshot":
                r.save()
                time.sleep(after_s)  # the run goes on past the snapshot (a scenario step)
            had = [s.count() for s in streams]
            assert max(had) < max_tokens, "a stream ended before the restart: raise --max-tokens"
            r.close()
            server.restart()
            pairs = list(zip(streams, had, strict=True))
            _wait(lambda: all(s.first_after(h) for s, h in pairs), "streams flowing", 300)
            flowing_at = max(s.first_after(h) or 0.0 for s, h in pairs)
            for s in streams:
                s.thread.join(600)
                assert s.error is None, repr(s.error)
                assert s.end is not None and s.end.status == "done", s.end
                assert [i for i, _ in s.seen] == list(range(max_tokens))
        text = log_path.read_text(errors="replace")
        flowing = flowing_at - _reconnected_at(text)
        passes = [m.groups() for m in _PASS.finditer(text)]
        repaired_ms = [float(p[3]) for p in passes if int(p[2])]
        return {
            "flowing_s": flowing,
            "pass_ms": max(repaired_ms)
            if repaired_ms
            else (float(passes[-1][3]) if passes else 0.0),
            "needed": max((int(p[2]) for p in passes), default=0),
            "put_back": sum(int(n) for n in _PUT_BACK.findall(text)),
        }
    finally:
        proc.kill()
        proc.wait(10)
        server.stop()


def _reconnected_at(worker_log: str) -> float:
    """When the worker found Redis back (epoch seconds, from its log line's time)."""
    stamps = _BACK.findall(worker_log)
    if not stamps:
        raise RuntimeError("the worker's log has no 'Redis answers again' line")
    return datetime.datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _wait(predicate: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--after-s", type=float, default=1.0, help="run time after the snapshot")
    add_record_flag(parser)
    args = parser.parse_args()
    from tokenfleet.worker.devtools.tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-repair-"))
    model = make_tiny_model(tmp / "tiny", seed=0)
    rows: dict[str, list[dict[str, float]]] = {"aof": [], "snapshot": []}
    print(f"{NUM_REQUESTS} streams x {args.max_tokens} tokens, 1 worker (1 thread), tiny model; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(" round      side  flowing s  repair pass ms  requests repaired  tokens put back")
    for n in range(args.rounds):
        for side in ("aof", "snapshot") if n % 2 == 0 else ("snapshot", "aof"):
            row = one_round(side, model, args.max_tokens, args.after_s, tmp)
            rows[side].append(row)
            print(f"{n:6d} {side:>9} {row['flowing_s']:10.3f} {row['pass_ms']:15.1f} "
                  f"{int(row['needed']):18d} {int(row['put_back']):16d}", flush=True)  # fmt: skip
    for side, got in rows.items():
        flows = [r["flowing_s"] for r in got]
        passes = [r["pass_ms"] for r in got]
        print(
            f"{side:>9}: flowing again after median {statistics.median(flows):.3f} s "
            f"(max {max(flows):.3f}); repair pass median {statistics.median(passes):.1f} ms"
        )
    if args.record:
        record_figures(
            {HEADLINE_KEYS[0]: headline(rows)}, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS
        )


HEADLINE_KEYS = ("failover-repair",)  # its row in benchmarks/RESULTS.md


def headline(rows: dict[str, list[dict[str, float]]]) -> str:
    """The ``today`` cell: snapshot side's flowing-again time and repair pass, aof side's time."""
    snap, aof = rows["snapshot"], rows["aof"]
    med = statistics.median
    return (
        f"{med(r['flowing_s'] for r in snap):.2f} s (pass {med(r['pass_ms'] for r in snap):.0f} "
        f"ms); no repair {med(r['flowing_s'] for r in aof):.2f} s"
    )


if __name__ == "__main__":
    main()
