"""The per-step publisher against the real server: one round trip per step on its own connection."""

from __future__ import annotations

import redis
from worker_helpers import enqueue, make_intake, make_request, record, subscribe, token_events

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake import Job
from tokenfleet.worker.intake.jobs import record_published
from tokenfleet.worker.publish.publisher import Finish, Publisher, StepResult


def _started(r: redis.Redis, settings: Settings, keys: Keys, rids: list[str]) -> list[Job]:
    for rid in rids:
        enqueue(r, keys, make_request(rid))
    intake = make_intake(r, settings)
    jobs, _ = intake.starter.start(intake.streams.pull(len(rids)))
    assert [j.request_id for j in jobs] == rids
    return jobs


def _tokens(job: Job, n: int) -> list[TokenEvent]:
    first = job.num_published
    return [TokenEvent(job.request_id, first + i, 100 + i, f"<{first + i}>") for i in range(n)]


def test_a_step_is_one_round_trip_for_every_request(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    jobs = _started(r, settings, keys, ["a", "b", "c", "warm"])
    warm = jobs.pop()
    log = subscribe(r, keys, ["a", "b", "c"])
    publisher = Publisher(r, settings, model_name="default", worker_name="w1")
    publisher.publish([(warm, _tokens(warm, 1))], [])  # loads the script (NOSCRIPT, then retry)
    r.config_resetstat()
    pending = publisher.send([(j, _tokens(j, 2 if j.request_id == "b" else 1)) for j in jobs], [])
    result = pending.result()
    assert r.info("commandstats")["cmdstat_evalsha"]["calls"] == 1
    assert not result.lost
    assert [j.num_published for j in jobs] == [0, 0, 0]  # the publisher changes no job
    assert [job for job, _ in result.appended] == jobs
    record_published(result.appended)  # the owner applies what took effect
    assert [j.num_published for j in jobs] == [1, 2, 1]
    assert [j.text for j in jobs] == ["<0>", "<0><1>", "<0>"]
    assert [len(token_events(r, keys, j.request_id)) for j in jobs] == [1, 2, 1]
    log.pump()
    assert [e.index for e in log.tokens("b")] == [0, 1]
    publisher.close()


def test_a_publish_sent_while_another_is_in_flight_reads_that_ones_replies_first(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    """The worker's synchronous finish can run while the step's publish is unread: both end
    right, and the step's result is the one its caller reads later."""
    a, b = _started(r, settings, keys, ["a", "b"])
    publisher = Publisher(r, settings, model_name="default", worker_name="w1")
    step = publisher.send([(a, _tokens(a, 1)), (b, _tokens(b, 1))], [], ["a", "b"])
    r.sadd(keys.cancel_set, "b")  # asked after the step's cancel check was sent
    event = TerminalEvent("b", TerminalStatus.CANCELLED, num_tokens=1)
    finish = Finish(event, b.entry.priority, b.entry.entry_id, "<0>")  # its text: the step's
    done: StepResult[Job] = publisher.publish([], [finish])
    assert done.finished == [finish] and not done.lost
    assert step.received  # the step's replies were read before the finish's
    result = step.result()
    record_published(result.appended)
    assert b.num_published == 1
    assert not result.lost and result.cancel_requested == []
    assert step.result() is result
    rec_a, rec_b = record(r, keys, "a"), record(r, keys, "b")
    assert rec_a is not None and rec_a.status == "running" and rec_a.num_tokens == 1
    assert rec_b is not None and rec_b.status == "cancelled" and rec_b.text == "<0>"
    publisher.close()


def test_the_publisher_reconnects_after_its_connection_drops(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    (a,) = _started(r, settings, keys, ["a"])
    publisher = Publisher(r, settings, model_name="default", worker_name="w1")
    record_published(publisher.publish([(a, _tokens(a, 1))], []).appended)
    publisher.close()  # e.g. the worker's shutdown path, or a broken socket
    result = publisher.publish([(a, _tokens(a, 1))], [])
    assert result.lost == set()
    record_published(result.appended)
    assert a.num_published == 2
    publisher.close()
