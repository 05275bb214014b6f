"""``min-replicas-to-write``, the server's side of "what the worker counts as written is on a
replica" (docs/redis-modes.md, ``shared.replica_wait``): a primary that has lost its replica
refuses every write with ``NOREPLICAS``. tokenfleet must take that as a wait, not as an error:
a real worker in sentinel mode streams a request; the worker is held (SIGSTOP) so the request
is certainly running, and the replica is stopped until the primary refuses writes; a submit
made then waits instead of failing; the worker, let go, pauses as in an outage (its log says so)
without ending or losing anything; once the replica runs again (SIGCONT) both requests end
``done``, the stream gap-free and duplicate-free. The counts are printed."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from ha_helpers import HAWorker, ha_settings
from waiting import DEADLINE_S, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import TerminalEvent, TokenEvent
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel

pytestmark = pytest.mark.slow
PREFIX = "haminrep"
MAX_TOKENS = 600


@pytest.fixture
def guarded() -> Iterator[LocalSentinel]:
    """A Sentinel setup of its own whose data nodes refuse writes without a replica that
    acknowledged within two seconds."""
    with LocalSentinel(service="tfminrep") as setup:
        for port in setup.data_ports:
            with redis.Redis(port=port) as node:
                node.config_set("min-replicas-to-write", 1)
                node.config_set("min-replicas-max-lag", 2)
        yield setup


@pytest.fixture
def worker(guarded: LocalSentinel, tiny_llama_dir: Path, tmp_path: Path) -> Iterator[HAWorker]:
    w = HAWorker(tiny_llama_dir, guarded, PREFIX, "minrep-w", tmp_path, "--max-num-seqs", "4")
    try:
        with redis.Redis(port=guarded.primary_port()) as r:
            wait_for(lambda: w.ready(r), "the worker's heartbeat")
        yield w
    finally:
        w.close()


def test_a_primary_without_replicas_refuses_writes_and_the_fleet_waits(
    guarded: LocalSentinel, worker: HAWorker
) -> None:
    settings = dataclasses.replace(ha_settings(guarded, PREFIX), redis_retry_s=int(DEADLINE_S))
    keys = Keys(PREFIX)
    primary, replica = guarded.primary_port(), guarded.data_ports[1]
    direct = redis.Redis(port=primary)
    events: list[Any] = []
    late: list[Any] = []
    errors: list[BaseException] = []

    def submit_late(client: Client) -> None:
        try:
            late.append(client.submit("late", max_tokens=8, ignore_eos=True).result(DEADLINE_S))
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    with Client.from_url(settings=settings) as client:
        handle = client.submit("Refused writes", max_tokens=MAX_TOKENS, ignore_eos=True)
        stream = handle.stream(timeout=DEADLINE_S)
        events.append(next(stream))  # it runs
        worker.signal(signal.SIGSTOP)  # held mid-request: it cannot end meanwhile
        os.kill(guarded.procs[replica].pid, signal.SIGSTOP)
        submitter = threading.Thread(target=submit_late, args=(client,))
        try:

            def refused() -> bool:
                try:
                    direct.set(keys.root + ":probe", 1)
                except redis.ResponseError as exc:
                    return str(exc).startswith("NOREPLICAS")
                return False

            wait_for(refused, "the primary to refuse writes")
            submitter.start()
            worker.signal(signal.SIGCONT)
            wait_for(lambda: "lost Redis" in worker.output(), "the worker to pause as in an outage")
            rec = RequestRecord.from_hash(
                handle.request_id, direct.hgetall(keys.record(handle.request_id))
            )
            assert rec is not None and rec.status == "running", rec  # paused, not ended
            assert submitter.is_alive() and not late and not errors  # waiting, not failed
        finally:
            worker.signal(signal.SIGCONT)
            os.kill(guarded.procs[replica].pid, signal.SIGCONT)
        events.extend(stream)
        submitter.join(DEADLINE_S)
        assert not errors, errors
    assert worker.alive(), worker.output()  # the worker rode it out
    idx = [e.index for e in events if isinstance(e, TokenEvent)]
    assert idx == list(range(MAX_TOKENS)), idx
    ends = [e for e in events if isinstance(e, TerminalEvent)]
    assert len(ends) == 1 and events[-1] is ends[0] and ends[0].status == "done"
    assert len(late) == 1 and len(late[0].token_ids) == 8
    rec = RequestRecord.from_hash(handle.request_id, direct.hgetall(keys.record(handle.request_id)))
    assert rec is not None and rec.status == "done" and rec.num_tokens == MAX_TOKENS
    outages = worker.log_path.read_text(errors="replace").count("lost Redis")
    # PING answers while writes are refused: the worker waits on a write probe instead of
    # spinning through restores (hundreds of outages a second were logged without one)
    assert 1 <= outages < 10, worker.output()
    print(
        f"[counts] replica stopped on {replica}, primary {primary} refused writes: the worker "
        f"paused ({outages} outages logged), a submit waited; after: 2/2 requests done, "
        f"{MAX_TOKENS} tokens gap-free and duplicate-free"
    )
    direct.close()
