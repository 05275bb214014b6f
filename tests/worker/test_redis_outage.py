"""Chaos: the fleet rides out Redis restarts and stalls (docs/redis-modes.md, "Redis outages").

Real processes and real signals: a private redis-server (with AOF, ``appendfsync always``, or
without persistence) is SIGKILLed and restarted on the same port and data directory, or
SIGSTOPped past the socket timeout, while two worker processes (the tiny Llama) stream greedy
generations to client threads reading through ``Handle.stream()`` on one shared ``Client``.
With AOF: no worker exits, every request ends exactly once, ``done``, and each stream is
gap-free, duplicate-free and equal to the uninterrupted in-process run. Without AOF: every
reader still ends visibly (a terminal event, or ``RequestLost`` / ``UnknownRequest``), never
hangs, and the workers serve new requests after the restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from worker_helpers import WorkerProc, enqueue, make_request, record, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.errors import RequestLost, UnknownRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.schema import SamplingParams, TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer
from tokenfleet.worker.engine.request import SamplingParams as EngineParams

pytestmark = pytest.mark.slow
PREFIX = "tfo"
MAX_TOKENS = 200
# the prompts of test_worker_recovery: no near-tie along their 200 greedy tokens (a resumed
# request recomputes its context in another batch; a near-tie could flip on rounding)
PROMPTS = ["Morning light", "Under the bridge", "Far across the valley", "The night train"]
STALL_TIMEOUT_S = 3  # the stall test's socket timeout (workers and client; default 10 s)
STALL_S = 6.0  # longer than that timeout: the stall is an outage, not a slow reply
READ_DEADLINE_S = 240.0  # a reader still reading after this is hanging


@pytest.fixture(scope="module")
def reference(ref_engine: Any) -> dict[str, list[int]]:
    """Per prompt, the uninterrupted in-process greedy run's token ids."""
    params = EngineParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref_engine.block_manager.reset_prefix_cache()
    runs = ref_engine.generate(PROMPTS, params)
    return {p: list(run.token_ids) for p, run in zip(PROMPTS, runs, strict=True)}


@dataclass
class Reader:
    """One client thread streaming one request with ``Handle.stream()``."""

    rid: str
    prompt: str
    events: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def run(self, client: Client) -> None:
        try:
            with client.handle(self.rid) as handle:
                for event in handle.stream():
                    self.events.append(event)
        except BaseException as exc:  # what the caller would see: checked by the test
            self.error = exc

    @property
    def tokens(self) -> list[TokenEvent]:
        return [e for e in self.events if isinstance(e, TokenEvent)]

    @property
    def terminals(self) -> list[TerminalEvent]:
        return [e for e in self.events if isinstance(e, TerminalEvent)]


@dataclass
class Fleet:
    server: RedisServer
    workers: list[WorkerProc]
    client: Client
    keys: Keys = field(default_factory=lambda: Keys(PREFIX))
    readers: list[Reader] = field(default_factory=list)

    def redis(self) -> redis.Redis:
        """A fresh command client (the server may have restarted since the last one)."""
        return redis.Redis.from_url(self.server.url, socket_timeout=10)

    def submit(self, rids: list[str]) -> None:
        """Enqueue greedy requests (``ignore_eos``: every one runs MAX_TOKENS) and start a
        reader on each."""
        r = self.redis()
        try:
            for i, rid in enumerate(rids):
                prompt = PROMPTS[i % len(PROMPTS)]
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                enqueue(r, self.keys, make_request(rid, prompt=prompt, sampling=params))
                reader = Reader(rid, prompt)
                reader.thread = threading.Thread(target=reader.run, args=(self.client,))
                reader.thread.start()
                self.readers.append(reader)
        finally:
            r.close()

    def wait_mid_stream(self) -> None:
        """Until some request is running with tokens published: the outage hits live streams."""
        r = self.redis()

        def running() -> bool:
            for reader in self.readers:
                rec = record(r, self.keys, reader.rid)
                if rec is not None and rec.status == "running" and rec.num_tokens >= 8:
                    return True
            return False

        try:
            wait_for(running, "a request running mid-stream", poll_s=0.005)
        finally:
            r.close()

    def join_readers(self) -> None:
        """Every reader ends (a hang fails the test)."""
        deadline = time.monotonic() + READ_DEADLINE_S
        for reader in self.readers:
            assert reader.thread is not None
            reader.thread.join(max(0.0, deadline - time.monotonic()))
            assert not reader.thread.is_alive(), f"reader of {reader.rid} hangs"

    def check_workers_alive(self) -> None:
        for w in self.workers:
            assert w.alive(), f"worker {w.name} exited:\n{w.output()}"
            assert "Traceback" not in w.output(), w.output()


@contextmanager
def fleet(
    model_dir: Path,
    log_dir: Path,
    *,
    appendonly: bool,
    socket_timeout_s: int = 10,
    env: dict[str, str] | None = None,
) -> Iterator[Fleet]:
    server = RedisServer(unix_socket=False, appendonly=appendonly).start()
    workers: list[WorkerProc] = []
    client = None
    env = {"TOKENFLEET_REDIS_SOCKET_TIMEOUT_S": str(socket_timeout_s), **(env or {})}
    try:
        workers = [
            WorkerProc(model_dir, server.url, PREFIX, name, log_dir, env=env)
            for name in ("o-a", "o-b")
        ]
        r = redis.Redis.from_url(server.url)
        for w in workers:
            w.wait_ready(r)
        r.close()
        settings = Settings(
            redis_url=server.url, key_prefix=PREFIX, redis_socket_timeout_s=socket_timeout_s
        )
        client = Client.from_url(settings=settings)
        yield Fleet(server, workers, client)
    finally:
        if client is not None:
            client.close()
        for w in workers:
            w.close()
        server.stop()


def check_complete(f: Fleet, reference: dict[str, list[int]]) -> None:
    """Every request ended exactly once, ``done``, its stream equal to the reference."""
    f.join_readers()
    r = f.redis()
    try:
        for reader in f.readers:
            assert reader.error is None, f"{reader.rid}: {reader.error!r}"
            indices = [e.index for e in reader.tokens]
            assert indices == list(range(MAX_TOKENS)), reader.rid  # no gap, no duplicate
            assert [e.token_id for e in reader.tokens] == reference[reader.prompt], reader.rid
            assert len(reader.terminals) == 1 and reader.events[-1] is reader.terminals[0]
            assert reader.terminals[0].status == "done", reader.terminals[0]
            rec = record(r, f.keys, reader.rid)
            assert rec is not None and rec.status == "done" and rec.num_tokens == MAX_TOKENS
            assert len(r.lrange(f.keys.tokens(reader.rid), 0, -1)) == MAX_TOKENS
    finally:
        r.close()


def test_redis_killed_and_restarted_with_aof_under_load(
    tiny_model_dir: Path, reference: dict[str, list[int]], tmp_path: Path
) -> None:
    with fleet(tiny_model_dir, tmp_path, appendonly=True) as f:
        f.submit([f"k-{i}" for i in range(8)])
        f.wait_mid_stream()
        f.server.restart()  # SIGKILL, then the same port and data directory
        f.submit([f"k2-{i}" for i in range(4)])  # accepted by the restarted server
        check_complete(f, reference)
        f.check_workers_alive()
        logs = "".join(w.output() for w in f.workers)
        assert "lost Redis" in logs and "restored after the Redis outage" in logs, logs
        r = f.redis()  # each heartbeat (tokenfleet status) counts the outage it rode out
        for w in f.workers:
            beat = lambda w=w: int(r.hget(f.keys.worker(w.name), "redis_outages") or 0)  # noqa: E731
            wait_for(beat, f"{w.name}'s heartbeat to count the outage")
        r.close()


def test_redis_stalled_past_the_socket_timeout_under_load(
    tiny_model_dir: Path, reference: dict[str, list[int]], tmp_path: Path
) -> None:
    with fleet(tiny_model_dir, tmp_path, appendonly=True, socket_timeout_s=STALL_TIMEOUT_S) as f:
        f.submit([f"s-{i}" for i in range(8)])
        f.wait_mid_stream()
        f.server.pause()  # SIGSTOP: connections stay open, nothing answers
        time.sleep(STALL_S)  # the stall itself (not a wait for a condition)
        f.server.resume()
        check_complete(f, reference)
        f.check_workers_alive()
        logs = "".join(w.output() for w in f.workers)
        assert "lost Redis" in logs, logs  # the stall outlasted the socket timeout


def test_without_aof_and_without_repair_every_request_ends_visibly(
    tiny_model_dir: Path, reference: dict[str, list[int]], tmp_path: Path
) -> None:
    """The repair turned off (``TOKENFLEET_REPAIR_WINDOW_S=0``) and readers that did not submit
    (no resubmission): what Redis lost reaches the clients, visibly. With the defaults nothing
    is lost: tests/ha/test_failover_standalone.py."""
    off = {"TOKENFLEET_REPAIR_WINDOW_S": "0"}
    with fleet(tiny_model_dir, tmp_path, appendonly=False, env=off) as f:
        f.submit([f"n-{i}" for i in range(8)])
        f.wait_mid_stream()
        f.server.restart()  # everything Redis held is gone
        f.join_readers()
        lost = 0  # requests whose loss reached their client: an exception or an error end
        for reader in f.readers:
            indices = [e.index for e in reader.tokens]
            assert indices == list(range(len(indices))), reader.rid  # what came is gap-free
            if reader.error is None:
                assert len(reader.terminals) == 1 and reader.events[-1] is reader.terminals[0]
                end = reader.terminals[0]
                lost += end.status == "error" and end.code == "corrupt_state"
            else:  # a clear exception from the handle, never a hang or a bare socket error
                assert isinstance(reader.error, UnknownRequest), repr(reader.error)
                lost += isinstance(reader.error, RequestLost)
        assert lost, [(r.rid, r.error, r.terminals) for r in f.readers]
        f.check_workers_alive()
        after = [f"n2-{i}" for i in range(4)]  # the workers serve the restarted, empty Redis
        first = len(f.readers)
        f.submit(after)
        f.readers = f.readers[first:]
        check_complete(f, reference)
