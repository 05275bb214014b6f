"""The run table on its own (no Redis, no engine): each transition keeps its invariants, and
``check_invariants`` catches a violation of each."""

from __future__ import annotations

import pytest
from worker_helpers import make_request

from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TokenEvent
from tokenfleet.worker.intake.jobs import Entry, Job, record_published
from tokenfleet.worker.service.run_table import InvariantViolation, RunTable

STREAM = "tft:q:default:normal"


def _job(rid: str, entry_id: str = "1-0", *, resume: int = 0, attempts: int = 1) -> Job:
    """A job as ``START`` makes it: ``resume`` tokens already published by an earlier worker."""
    entry = Entry(STREAM, Priority.NORMAL, entry_id, {"id": rid.encode()})
    job = Job(entry=entry, request=make_request(rid), attempts=attempts)
    job.resume_token_ids = list(range(resume))
    job.text_parts = [f"<{i}>" for i in range(resume)]
    job.num_published = resume
    return job


def _early(rid: str) -> Job:
    """A job as ``early_jobs`` makes it: not started yet."""
    return _job(rid, attempts=0)


def test_the_early_start_transitions_keep_the_invariants() -> None:
    table = RunTable()
    table.check_invariants()  # empty
    table.start_early(_early("a"))
    table.start_early(_early("b"))
    table.start_early(_early("c"))
    assert table.knows("a") and not table.knows("z")
    table.check_invariants()
    # a: START answered ok; b: refused; c: answered with tokens to resume from
    started_a = _job("a")
    assert table.take_early("a") is not None
    table.run(started_a)
    table.abort_early("b", None)
    resumed_c = _job("c", resume=2)
    assert table.take_early("c") is not None
    table.abort_early("c", resumed_c)
    table.check_invariants()
    assert table.jobs == {"a": started_a} and not table.early
    assert table.aborting == {"b": None, "c": resumed_c}
    # the engine reports the aborted runs' ends: c is added again
    assert table.end_reported("b") is None
    assert table.end_reported("c") is resumed_c
    table.run(resumed_c)
    table.check_invariants()
    assert set(table.jobs) == {"a", "c"} and not table.aborting


def test_a_started_job_waits_for_the_end_of_an_aborted_run_of_its_id() -> None:
    table = RunTable()
    table.start_early(_early("a"))
    table.abort_early("a", None)
    again = _job("a", "2-0")
    assert table.restart_after_abort(again)
    assert not table.restart_after_abort(_job("other"))
    table.check_invariants()
    assert table.end_reported("a") is again and not table.aborting


def test_progress_cancels_and_removal_keep_the_invariants() -> None:
    table = RunTable()
    job = _job("a", resume=1)
    table.run(job)
    record_published([(job, [TokenEvent("a", 1, 7, "<1>"), TokenEvent("a", 2, 8, "<2>")])])
    table.check_invariants()
    assert job.num_published == 3 and job.text == "<0><1><2>"
    table.request_cancels(["a", "gone"])
    assert table.take_cancels() == {"a", "gone"} and table.take_cancels() == set()
    assert table.remove("a") is job and table.remove("a") is None
    table.check_invariants()


def test_hand_back_takes_running_jobs_and_those_waiting_to_restart() -> None:
    table = RunTable()
    running, waiting = _job("a"), _job("b", resume=1)
    table.run(running)
    table.start_early(_early("b"))
    table.abort_early("b", waiting)
    table.abort_early("c", None)
    assert table.to_hand_back() == [running, waiting]
    assert table.aborting == {"b": None, "c": None}  # their ends are still to be dropped
    table.handed_back()
    table.check_invariants()
    assert not table.jobs


@pytest.mark.parametrize("other", ["early", "aborting"])
def test_invariant_1_catches_an_id_in_jobs_and_another_map(other: str) -> None:
    table = RunTable()
    table.run(_job("a"))
    if other == "early":
        table.early["a"] = _early("a")
    else:
        table.aborting["a"] = None
    with pytest.raises(InvariantViolation, match="invariant 1"):
        table.check_invariants()


def test_invariant_1_catches_an_id_early_and_aborting() -> None:
    table = RunTable()
    table.start_early(_early("a"))
    table.aborting["a"] = None
    with pytest.raises(InvariantViolation, match="invariant 1"):
        table.check_invariants()


@pytest.mark.parametrize("other", ["jobs", "early", "aborting"])
def test_invariant_1_catches_a_preparing_id_in_another_map(other: str) -> None:
    table = RunTable()
    table.prepare(_job("a"))
    table.check_invariants()
    getattr(table, other)["a"] = _early("a") if other == "early" else _job("a")
    with pytest.raises(InvariantViolation, match="invariant 1"):
        table.check_invariants()


def test_preparing_jobs_are_handed_back_and_leave_once_prepared() -> None:
    table = RunTable()
    table.run(_job("a"))
    table.prepare(_job("b"))
    assert table.knows("b") and table.take_prepared("b") is not None
    assert table.take_prepared("b") is None and not table.knows("b")
    table.prepare(_job("c"))
    assert [j.request_id for j in table.to_hand_back()] == ["a", "c"]
    table.handed_back()
    assert not table.jobs and not table.preparing
    table.check_invariants()


@pytest.mark.parametrize("where", ["jobs", "early", "aborting"])
def test_invariant_2_catches_a_job_filed_under_another_id(where: str) -> None:
    table = RunTable()
    if where == "jobs":
        table.jobs["x"] = _job("a")
    elif where == "early":
        table.early["x"] = _early("a")
    else:
        table.aborting["x"] = _job("a")
    with pytest.raises(InvariantViolation, match="invariant 2"):
        table.check_invariants()


@pytest.mark.parametrize("started", ["attempts", "resume", "published"])
def test_invariant_3_catches_an_early_job_that_was_started(started: str) -> None:
    job = _early("a")
    if started == "attempts":
        job.attempts = 1
    elif started == "resume":
        job.resume_token_ids = [5]
    else:
        job.num_published, job.text_parts = 1, ["<0>"]
    table = RunTable()
    table.start_early(job)
    with pytest.raises(InvariantViolation, match="invariant 3"):
        table.check_invariants()


def test_invariant_4_catches_progress_without_its_texts() -> None:
    job = _job("a")
    job.num_published = 2  # advanced without the texts of its tokens
    table = RunTable()
    table.run(job)
    with pytest.raises(InvariantViolation, match="invariant 4"):
        table.check_invariants()


def test_invariant_4_catches_resumed_tokens_that_were_never_published() -> None:
    job = _job("a", resume=2)
    job.num_published, job.text_parts = 1, ["<0>"]
    table = RunTable()
    table.abort_early("a", job)  # a job waiting to be added again is checked too
    with pytest.raises(InvariantViolation, match="invariant 4"):
        table.check_invariants()
