"""The worker's repair after a Redis rollback (worker/service/repair.py, worker_repair.lua), one
case at a time against the real server: each rollback is made by hand (the state an older
snapshot or a promoted replica holds), then the repair runs twice (the second changes nothing)."""

from __future__ import annotations

from typing import Any

import redis
from worker_helpers import enqueue, make_intake, make_request, record, subscribe, token_events

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.jobs import Entry, Job, record_published
from tokenfleet.worker.publish.publisher import Finish, Publisher
from tokenfleet.worker.service.adapter import StepEvents
from tokenfleet.worker.service.metrics import WorkerMetrics
from tokenfleet.worker.service.outbox import Outbox
from tokenfleet.worker.service.repair import FinishedLedger, Repairer, Target
from tokenfleet.worker.service.run_table import RunTable

W = "w1"


def _start(r: redis.Redis, settings: Settings, keys: Keys, rids: list[str]) -> list[Job]:
    for rid in rids:
        enqueue(r, keys, make_request(rid))
    intake = make_intake(r, settings, worker_name=W)
    jobs, _ = intake.starter.start(intake.streams.pull(len(rids)))
    return sorted(jobs, key=lambda j: rids.index(j.request_id))


def _event(job: Job, i: int) -> TokenEvent:
    return TokenEvent(job.request_id, i, 100 + i, f"<{i}>")


def _publish(publisher: Publisher, job: Job, count: int) -> None:
    first = job.num_published
    events = [TokenEvent(job.request_id, i, 100 + i, f"<{i}>") for i in range(first, first + count)]
    result = publisher.publish([(job, events)], [])
    assert not result.lost and not result.corrupt
    record_published(result.appended)


def _finish(publisher: Publisher, job: Job) -> Finish:
    event = TerminalEvent(
        job.request_id, TerminalStatus.DONE, num_tokens=job.num_published, finish_reason="length"
    )
    fin = Finish(event, job.entry.priority, job.entry.entry_id, job.text, job.entry.stream)
    assert publisher.publish([], [fin]).finished == [fin]
    return fin


def _repairer(r: redis.Redis, keys: Keys) -> Repairer:
    return Repairer(r, keys, worker_name=W, ttl_s=3600)


def _pending_of(r: redis.Redis, stream: str, consumer: str) -> list[str]:
    rows: Any = r.xpending_range(stream, CONSUMER_GROUP, "-", "+", 100, consumername=consumer)
    return [row["message_id"].decode() for row in rows]


def test_a_shortened_list_and_a_record_rolled_back_to_queued_are_put_back(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    (job,) = _start(r, settings, keys, ["a"])
    publisher = Publisher(r, settings, model_name="default", worker_name=W)
    _publish(publisher, job, 5)
    r.ltrim(keys.tokens("a"), 0, 1)  # the rollback: an older state
    r.hset(keys.record("a"), mapping={"status": "queued", "worker": "", "num_tokens": 2})
    log = subscribe(r, keys, ["a"])
    out = _repairer(r, keys).check([Target(job, job.events)])["a"]
    assert (out.kind, out.pushed, out.rewrote, out.ended) == ("repaired", 3, True, False)
    assert [e.text for e in token_events(r, keys, "a")] == [f"<{i}>" for i in range(5)]
    rec = record(r, keys, "a")
    assert rec is not None and (rec.status, rec.worker, rec.num_tokens) == ("running", W, 5)
    log.pump()
    assert [e.index for e in log.tokens("a")] == [2, 3, 4]  # the gap, published once
    again = _repairer(r, keys).check([Target(job, job.events)])["a"]
    assert again.kind == "intact"
    log.pump()
    assert [e.index for e in log.tokens("a")] == [2, 3, 4]
    _publish(publisher, job, 1)  # the worker goes on where it was
    assert len(token_events(r, keys, "a")) == 6


def test_a_record_list_and_entry_gone_are_rewritten_and_the_entry_is_ours_again(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    (job,) = _start(r, settings, keys, ["g"])
    publisher = Publisher(r, settings, model_name="default", worker_name=W)
    _publish(publisher, job, 3)
    stream = job.entry.stream
    r.delete(keys.record("g"), keys.tokens("g"))
    r.xack(stream, CONSUMER_GROUP, job.entry.entry_id)
    r.xdel(stream, job.entry.entry_id)
    out = _repairer(r, keys).check([Target(job, job.events)])["g"]
    assert out.kind == "repaired" and out.rewrote and out.pushed == 3 and out.new_entry
    rec = record(r, keys, "g")
    assert rec is not None and (rec.status, rec.worker, rec.num_tokens) == ("running", W, 3)
    assert _pending_of(r, stream, W) == [out.new_entry]  # nobody else reads it as new work
    assert r.hget(keys.record("g"), "stream_id") == out.new_entry.encode()
    job.entry.entry_id = out.new_entry
    assert _repairer(r, keys).check([Target(job, job.events)])["g"].kind == "intact"


def test_a_lost_end_is_written_again_once_and_a_reappeared_entry_dropped(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    (job,) = _start(r, settings, keys, ["f"])
    publisher = Publisher(r, settings, model_name="default", worker_name=W)
    _publish(publisher, job, 2)
    before: Any = r.hgetall(keys.record("f"))
    found: Any = r.xrange(job.entry.stream, job.entry.entry_id, job.entry.entry_id)
    entry = found[0][1]
    _publish(publisher, job, 2)
    fin = _finish(publisher, job)
    ledger = FinishedLedger(300.0)
    ledger.add(job, fin)
    # the rollback: the record as it was mid-run, two tokens, the entry back in w1's list
    r.delete(keys.record("f"))
    r.hset(keys.record("f"), mapping=before)
    r.ltrim(keys.tokens("f"), 0, 1)
    r.delete(job.entry.stream)  # (a stream only takes an old id again when made anew)
    r.xadd(job.entry.stream, entry, id=job.entry.entry_id)
    r.xgroup_create(job.entry.stream, CONSUMER_GROUP, id="0")
    r.xreadgroup(CONSUMER_GROUP, W, {job.entry.stream: ">"})
    log = subscribe(r, keys, ["f"])
    out = _repairer(r, keys).check(ledger.targets())["f"]
    assert (out.kind, out.pushed, out.ended, out.dropped) == ("repaired", 2, True, 1)
    rec = record(r, keys, "f")
    assert rec is not None and rec.status == "done" and rec.num_tokens == 4
    assert rec.text == "<0><1><2><3>" and rec.worker == ""
    assert r.xlen(job.entry.stream) == 0
    assert _repairer(r, keys).check(ledger.targets())["f"].kind == "intact"
    log.pump()
    assert [e.index for e in log.tokens("f")] == [2, 3]
    assert [e.status for e in log.events["f"] if isinstance(e, TerminalEvent)] == ["done"]


def test_a_resubmitted_request_is_taken_back_and_its_new_entry_dropped(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    """The record vanished, the producer submitted the request again (same id, new entry)
    before the worker repaired it: the worker's history wins, the new entry goes."""
    (job,) = _start(r, settings, keys, ["s"])
    publisher = Publisher(r, settings, model_name="default", worker_name=W)
    _publish(publisher, job, 3)
    r.delete(keys.record("s"), keys.tokens("s"))
    new = enqueue(r, keys, make_request("s"))
    out = _repairer(r, keys).check([Target(job, job.events)])["s"]
    assert out.kind == "repaired" and out.dropped == 1 and out.pushed == 3
    assert not r.xrange(job.entry.stream, new, new)
    rec = record(r, keys, "s")
    assert rec is not None and (rec.status, rec.worker) == ("running", W)
    assert r.hget(keys.record("s"), "stream_id") == job.entry.entry_id.encode()


def test_another_worker_further_along_keeps_it_and_a_divergent_list_is_named(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    ahead, diverged = _start(r, settings, keys, ["ahead", "div"])
    publisher = Publisher(r, settings, model_name="default", worker_name=W)
    for job in (ahead, diverged):
        _publish(publisher, job, 2)
    other = Publisher(r, settings, model_name="default", worker_name="w2")
    r.hset(keys.record("ahead"), mapping={"worker": "w2", "attempts": 2})
    theirs = Job(ahead.entry, ahead.request, 2, num_published=2)
    theirs.text_parts = ["<0>", "<1>"]
    _publish(other, theirs, 1)
    _publish(publisher, diverged, 1)
    r.ltrim(keys.tokens("div"), 0, 1)  # rolled back, and another event at index 1
    r.lset(keys.tokens("div"), 1, TokenEvent("div", 1, 999, "other").encode().decode())
    outs = _repairer(r, keys).check(
        [Target(ahead, ahead.events), Target(diverged, diverged.events)]
    )
    assert outs["ahead"].kind == "yield" and "w2" in outs["ahead"].why
    assert outs["div"].kind == "divergent" and "index 1" in outs["div"].why
    assert len(token_events(r, keys, "ahead")) == 3  # nothing written for either
    assert token_events(r, keys, "div")[1].text == "other"


class _Engine:
    """The engine side the outbox touches here: which runs it aborted."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def _outbox(r: redis.Redis, settings: Settings, keys: Keys, table: RunTable) -> tuple[Outbox, Any]:
    engine = _Engine()
    metrics = WorkerMetrics("default")
    publisher = Publisher(r, settings, model_name="default", worker_name=W)
    repairer = Repairer(r, keys, worker_name=W, ttl_s=3600, metrics=metrics)
    outbox = Outbox(
        publisher,
        table,
        engine,  # type: ignore[arg-type]
        metrics,
        None,
        worker_name=W,
        repairer=repairer,
        ledger=FinishedLedger(300.0),
    )
    return outbox, engine


def test_a_step_that_finds_its_list_rolled_back_is_repaired_and_goes_on(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    """The outbox's side: a publish answers ``corrupt`` (the list is shorter than the worker
    left it) or ``lost`` (the record is back at ``queued``); the outbox repairs and applies the
    step as if nothing had happened, and repairs the request it ended too (a rollback takes
    everything); nothing ends ``error``, nothing is aborted."""
    run, ended = _start(r, settings, keys, ["run", "end"])
    table = RunTable()
    table.run(run)
    table.run(ended)
    outbox, engine = _outbox(r, settings, keys, table)
    step = StepEvents(tokens=[(job, [_event(job, i) for i in range(3)]) for job in (run, ended)])
    outbox.send_step(step)
    event = TerminalEvent("end", TerminalStatus.DONE, num_tokens=3, finish_reason="length")
    outbox.send_step(StepEvents(finishes=[(ended, event, [])]))
    outbox.flush()
    assert "end" not in table.jobs and len(outbox.ledger) == 1
    r.ltrim(keys.tokens("run"), 0, 0)  # the rollback
    r.hset(keys.record("end"), mapping={"status": "running", "worker": W})
    r.ltrim(keys.tokens("end"), 0, 1)
    outbox.send_step(StepEvents(tokens=[(run, [_event(run, 3)])]))
    outbox.flush()
    assert run.num_published == 4 and "run" in table.jobs and not engine.aborted
    assert [e.index for e in token_events(r, keys, "run")] == [0, 1, 2, 3]
    rec = record(r, keys, "end")
    assert rec is not None and rec.status == "done" and len(token_events(r, keys, "end")) == 3
    assert outbox.repairer is not None and outbox.repairer.repaired == 2


def test_the_finished_ledger_keeps_ends_for_its_window_only() -> None:
    now = [100.0]
    ledger = FinishedLedger(10.0, clock=lambda: now[0])
    jobs = [
        Job(Entry("s", Priority.NORMAL, f"{i}-0", {}), make_request(f"r{i}"), 1) for i in range(3)
    ]
    event = TerminalEvent("r0", TerminalStatus.DONE)
    for i, job in enumerate(jobs):
        now[0] = 100.0 + 4 * i  # ended at 100, 104, 108
        ledger.add(job, Finish(event, Priority.NORMAL, job.entry.entry_id, "", "s"))
    now[0] = 112.0  # r0 ended 12 s ago: past the window
    assert [t.request_id for t in ledger.targets()] == ["r1", "r2"]
    ledger.forget("r1")
    assert [t.request_id for t in ledger.targets()] == ["r2"]
    off = FinishedLedger(0.0)
    off.add(jobs[0], Finish(event, Priority.NORMAL, "0-0", "", "s"))
    assert len(off) == 0
