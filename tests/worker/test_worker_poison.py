"""Issue 15 item 4 with a real worker process: poisoned or inconsistent per-request state ends
that request ``error`` / ``corrupt_state`` naming the cause, frees its entry, and the worker
goes on serving (it never stays ``running`` forever, logged as held by another worker). What
the worker can put back from its own memory while it runs the request (a record deleted, a
status scribbled over: what a Redis rollback also looks like) it puts back, and the request
ends ``done`` (issue 28, worker/service/repair.py); a list holding another's event cannot be
put back and ends it ``error``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from worker_helpers import (
    WorkerProc,
    enqueue,
    make_request,
    record,
    subscribe,
    wait_for,
)

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import SamplingParams, TerminalEvent, TokenEvent
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow
PREFIX = "tfpoison"
KEYS = Keys(PREFIX)
STREAM = KEYS.stream("default", Priority.NORMAL)
SHORT = SamplingParams(max_tokens=3, temperature=0.0)
LONG = SamplingParams(max_tokens=20000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path,
    redis_server: RedisServer,
    rr: redis.Redis,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProc]:
    w = WorkerProc(
        tiny_model_dir, redis_server.url, PREFIX, "poison-1", tmp_path_factory.mktemp("poison")
    )
    try:
        w.wait_ready(rr)
        yield w
    finally:
        w.close()


def _event(rid: str, index: int) -> bytes:
    return TokenEvent(rid, index, 5, "x").encode()


def _assert_freed_and_serving(rr: redis.Redis, worker: WorkerProc, rid: str) -> None:
    """The poisoned request's entry is acked and deleted and the worker serves the next one."""
    wait_for(lambda: rr.xlen(STREAM) == 0, f"{rid}'s entry to be deleted", 30)
    assert rr.xpending(STREAM, CONSUMER_GROUP)["pending"] == 0
    after = f"{rid}-after"
    log = subscribe(rr, KEYS, [after])
    enqueue(rr, KEYS, make_request(after, sampling=SHORT))
    assert log.wait_terminal(after).status == "done"
    assert worker.alive()
    assert "held by another worker" not in worker.output()


# -- poison found when the worker starts the request -------------------------------------------
def _preexisting_list(rr: redis.Redis, rid: str) -> dict[str, object]:
    rr.rpush(KEYS.tokens(rid), _event(rid, 0), _event(rid, 1))
    return {}


def _list_shorter_than_record(rr: redis.Redis, rid: str) -> dict[str, object]:
    rr.rpush(KEYS.tokens(rid), _event(rid, 0))
    return {"num_tokens": 4, "attempts": 1, "started_at": "1.0", "h": True}


def _undecodable_event(rr: redis.Redis, rid: str) -> dict[str, object]:
    rr.rpush(KEYS.tokens(rid), _event(rid, 0), b"\x80 not json")
    return {"num_tokens": 2, "attempts": 1, "started_at": "1.0", "h": True}


def _event_out_of_place(rr: redis.Redis, rid: str) -> dict[str, object]:
    rr.rpush(KEYS.tokens(rid), _event(rid, 1))
    return {"num_tokens": 1, "attempts": 1, "started_at": "1.0", "h": True}


_HANDED_BACK_LUA = """
local id = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'd', ARGV[2], 'dl', '', 'h', '1')
redis.call('HSET', KEYS[2], 'status', 'queued', 'stream_id', id, 'model', 'default',
           'priority', 'normal', 'worker', '')
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
return id
"""


def _enqueue_handed_back(rr: redis.Redis, rid: str, fields: dict[str, object]) -> None:
    """A request handed back by a worker that had published tokens (entry with ``h`` = 1),
    written atomically so the running worker never sees half of it."""
    args: list[object] = [rid, make_request(rid, sampling=SHORT).encode()]
    for k, v in fields.items():
        args += [k, v]
    rr.eval(_HANDED_BACK_LUA, 2, STREAM, KEYS.record(rid), *args)  # type: ignore[arg-type]


START_POISONS: dict[str, tuple[Callable[[redis.Redis, str], dict[str, object]], str]] = {
    "preexisting-list": (_preexisting_list, "token list holds 2 events but its record says 0"),
    "list-vs-num-tokens": (
        _list_shorter_than_record,
        "token list holds 1 events but its record says 4",
    ),
    "undecodable-event": (_undecodable_event, "its token list's event 1 does not decode"),
    "event-out-of-place": (_event_out_of_place, "holds no token event 0 at index 0"),
    "attempts-not-a-number": (lambda rr, rid: {"attempts": "many"}, "attempts 'many'"),
    "unknown-status": (lambda rr, rid: {"status": "paused"}, "status 'paused'"),
    "record-for-another-model": (lambda rr, rid: {"model": "other"}, "model 'other'"),
    "record-for-another-priority": (lambda rr, rid: {"priority": "batch"}, "priority 'batch'"),
}


@pytest.mark.parametrize("kind", list(START_POISONS))
def test_poison_found_at_start_ends_the_request(
    worker: WorkerProc, rr: redis.Redis, kind: str
) -> None:
    rid = f"start-{kind}"
    poison, cause = START_POISONS[kind]
    fields = poison(rr, rid)
    handed_back = bool(fields.pop("h", False))
    log = subscribe(rr, KEYS, [rid])
    if handed_back:  # a resumed request's entry carries h=1 (no early start)
        _enqueue_handed_back(rr, rid, fields)
    else:
        enqueue(rr, KEYS, make_request(rid, sampling=SHORT), **fields)
    term = log.wait_terminal(rid, 60)
    assert isinstance(term, TerminalEvent)
    assert term.status == "error" and term.code == "corrupt_state", term
    assert "inconsistent request state" in (term.message or "")
    assert cause in (term.message or ""), term.message
    rec = record(rr, KEYS, rid)
    assert rec is not None and rec.status == "error" and rec.code == "corrupt_state"
    assert not log.tokens(rid)  # nothing of the poisoned state was replayed to the client
    _assert_freed_and_serving(rr, worker, rid)


# -- poison that appears while the request runs ---------------------------------------------------
def _foreign_event(rr: redis.Redis, rid: str) -> str:
    rr.rpush(KEYS.tokens(rid), _event(rid, 10**6))  # someone else wrote into its list
    return "than the one this worker published"


def _record_deleted(rr: redis.Redis, rid: str) -> str:
    rr.delete(KEYS.record(rid))
    return "its record is gone"


def _status_scribbled(rr: redis.Redis, rid: str) -> str:
    rr.hset(KEYS.record(rid), "status", "paused")
    return "status 'paused'"


RUN_POISONS: dict[str, Callable[[redis.Redis, str], str]] = {
    "foreign-event-in-list": _foreign_event,
}
RUN_REPAIRED: dict[str, Callable[[redis.Redis, str], str]] = {
    "record-deleted": _record_deleted,
    "status-scribbled": _status_scribbled,
}
MEDIUM = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kind", list(RUN_REPAIRED))
def test_state_the_worker_can_put_back_is_repaired_and_the_request_ends_done(
    worker: WorkerProc, rr: redis.Redis, kind: str
) -> None:
    rid = f"fix-{kind}"
    log = subscribe(rr, KEYS, [rid])
    enqueue(rr, KEYS, make_request(rid, sampling=MEDIUM))
    wait_for(lambda: len(log.tokens(rid)) >= 2, f"{rid}'s first tokens", 60)
    RUN_REPAIRED[kind](rr, rid)
    term = log.wait_terminal(rid, 120)
    assert isinstance(term, TerminalEvent) and term.status == "done", term
    indices = [e.index for e in log.tokens(rid)]
    assert sorted(set(indices)) == list(range(300)), indices[-5:]  # (republished: duplicates)
    rec = record(rr, KEYS, rid)
    assert rec is not None and rec.status == "done" and rec.num_tokens == 300
    assert rr.llen(KEYS.tokens(rid)) == 300
    assert f"repaired {rid} after a Redis rollback" in worker.output()
    _assert_freed_and_serving(rr, worker, rid)


@pytest.mark.parametrize("kind", list(RUN_POISONS))
def test_poison_while_running_ends_the_request(
    worker: WorkerProc, rr: redis.Redis, kind: str
) -> None:
    rid = f"run-{kind}"
    log = subscribe(rr, KEYS, [rid])
    enqueue(rr, KEYS, make_request(rid, sampling=LONG))
    wait_for(lambda: len(log.tokens(rid)) >= 2, f"{rid}'s first tokens", 60)
    cause = RUN_POISONS[kind](rr, rid)
    term = log.wait_terminal(rid, 60)
    assert isinstance(term, TerminalEvent)
    assert term.status == "error" and term.code == "corrupt_state", term
    assert cause in (term.message or ""), term.message
    rec = record(rr, KEYS, rid)
    assert rec is not None and rec.status == "error"
    _assert_freed_and_serving(rr, worker, rid)
