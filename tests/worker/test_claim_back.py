"""A request claimed back by the worker that still runs it (or still holds its aborted run).

A starved worker (its loop stalled past its heartbeat TTL) looks dead: another worker claims its
request and starts it; that one stalls in turn and the first claims the request back. By then
the first worker's engine may still hold its own run of the request: either its publishes have
not answered yet (it still runs it), or they answered ``lost`` and its abort has not been
reported by a step yet. Either way the newer ``START`` rules: the old run ends, the request is
added again from the tokens Redis holds, and it ends exactly once, ``done``, with every token
(before the fix it ended ``error`` with "already in the engine", or its new start was dropped and
left for an orphan claim, one more attempt toward the poison limit).

Both workers' loops are driven by hand (``_step``, ``feed.claim``), in process against the real
server with real scripts and the tiny model: each ordering is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from worker_helpers import (
    enqueue,
    make_request,
    record,
    subscribe,
    token_events,
    worker_service,
)

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import SamplingParams, TerminalEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.engine.request import SamplingParams as EngineParams
from tokenfleet.worker.service import WorkerService

PROMPT = [5, 17, 42, 99, 7, 23]
MAX_TOKENS = 12


def _start_here(r: redis.Redis, keys: Keys, service: WorkerService, rid: str) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    enqueue(r, keys, make_request(rid, prompt_token_ids=PROMPT, sampling=params))
    service.feed.admit(service.intake.streams.pull(4))
    assert rid in service.table.jobs
    for _ in range(3):  # a few tokens published (and answered) by w1
        _step(service)
    service.outbox.flush()


def _step(service: WorkerService) -> None:
    service._step()
    service.table.check_invariants()


@pytest.fixture
def peer(r: redis.Redis, settings: Settings, tiny_model_dir: Path) -> Iterator[WorkerService]:
    """Worker "w2", in process like ``service``."""
    svc = worker_service(r, settings, tiny_model_dir, "w2")
    yield svc
    svc.table.check_invariants()


def _taken_over(peer: WorkerService, rid: str) -> None:
    """w2 finds w1 dead (no heartbeat), claims ``rid``, starts it and carries it further than
    w1 will (so w1's repair leaves it to w2: ``yield``), then stalls."""
    peer.feed.claimer.min_idle_ms = 0
    peer.feed.claim(1.0)
    assert rid in peer.table.jobs and peer.table.jobs[rid].attempts == 2
    for _ in range(5):
        _step(peer)
    peer.outbox.flush()


def _claim_back(service: WorkerService, rid: str) -> None:
    """w1's claim round finds w2 dead and takes ``rid`` back."""
    service.feed.claimer.min_idle_ms = 0
    service.feed.claim(1.0)
    service.table.check_invariants()
    assert service.table.jobs.get(rid) is None or service.table.jobs[rid].attempts == 3


def _check_one_done_end(
    r: redis.Redis, keys: Keys, service: WorkerService, log: Any, rid: str, ref: list[int]
) -> None:
    for _ in range(10 * MAX_TOKENS):
        if not service.engine.has_unfinished():
            break
        _step(service)
    service.outbox.flush()
    assert not service.engine.has_unfinished() and not service.table.knows(rid)
    rec = record(r, keys, rid)
    assert rec is not None and rec.status == "done", rec
    assert rec.attempts == 3  # w1, w2, w1 again: no start lost to an orphan claim
    assert [e.token_id for e in token_events(r, keys, rid)] == ref  # every token, once
    term = log.wait_terminal(rid)
    assert term.status == "done" and term.num_tokens == MAX_TOKENS
    assert [e for e in log.events[rid] if isinstance(e, TerminalEvent)] == [term]  # one end
    assert [e.index for e in log.tokens(rid)] == list(range(MAX_TOKENS))
    stream = service.intake.streams.stream_of[Priority.NORMAL]
    assert r.xpending(stream, CONSUMER_GROUP)["pending"] == 0  # acked, nothing left to claim


def _reference(ref_engine: Any) -> list[int]:
    ref_engine.block_manager.reset_prefix_cache()
    params = EngineParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return list(ref_engine.generate([PROMPT], params)[0].token_ids)


@dataclass
class Race:
    """w1 (``service``) and w2 (``peer``) on one request, and the uninterrupted run's tokens."""

    r: redis.Redis
    keys: Keys
    service: WorkerService
    peer: WorkerService
    reference: list[int]

    def taken_over(self, rid: str) -> Any:
        """Start ``rid`` on w1, then w2 takes it over (``_taken_over``); the request's events."""
        log = subscribe(self.r, self.keys, [rid])
        _start_here(self.r, self.keys, self.service, rid)
        _taken_over(self.peer, rid)
        return log

    def check_one_done_end(self, log: Any, rid: str) -> None:
        _check_one_done_end(self.r, self.keys, self.service, log, rid, self.reference)


@pytest.fixture
def race(
    r: redis.Redis, keys: Keys, service: WorkerService, peer: WorkerService, ref_engine: Any
) -> Race:
    return Race(r, keys, service, peer, _reference(ref_engine))


def test_claimed_back_while_its_aborted_run_is_still_in_the_engine(race: Race) -> None:
    """The reported failure: w1's publish answered ``lost`` (w2 holds it) and w1 aborted its
    run; before the next step reports that abort, w1's claim round takes the request back."""
    service, log = race.service, race.taken_over("cb1")
    _step(service)  # its tokens' publish is sent: w2 holds the request now
    _step(service)  # ... and answered lost: out of jobs, aborted, the abort not reported yet
    assert "cb1" not in service.table.jobs and service.engine.has_unfinished()
    _claim_back(service, "cb1")
    assert "cb1" in service.table.aborting  # added again once the engine has reported the end
    race.check_one_done_end(log, "cb1")


def test_claimed_back_while_it_still_runs_here(race: Race) -> None:
    """w1's claim round comes while its own publish for it (sent after w2's start) is in flight:
    it still runs the request. The publish answers ``lost`` before the claim (were the START
    first, w1 would hold the request again and the publish's repair would take it for its own),
    and the new start replaces the old run instead of being dropped as a duplicate."""
    service, log = race.service, race.taken_over("cb2")
    _step(service)  # its tokens' publish is in flight, to be answered lost
    assert "cb2" in service.table.jobs and service.outbox.in_flight
    _claim_back(service, "cb2")
    assert "cb2" in service.table.aborting and service.table.aborting["cb2"] is not None
    race.check_one_done_end(log, "cb2")


def test_claimed_back_before_any_publish_told_it_was_taken(race: Race) -> None:
    """w1 published nothing for the request since w2 took it (e.g. its run was preempted) and
    claims it back: still in ``jobs``. The newer start (attempt 3) replaces the run."""
    service, log = race.service, race.taken_over("cb3")
    assert "cb3" in service.table.jobs and not service.outbox.in_flight
    _claim_back(service, "cb3")
    assert "cb3" not in service.table.jobs and service.table.aborting["cb3"] is not None
    race.check_one_done_end(log, "cb3")
