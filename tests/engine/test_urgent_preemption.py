"""Issue 15 item 8: a request short of KV blocks preempts less urgent running work, one rule each.

Scheduler tests use the fake "model" of test_scheduler (token 7 for every sequence); 4-token
blocks, no prefix caching, so every request's blocks are its own.
"""

from __future__ import annotations

from test_scheduler import check, make_request, make_scheduler, step

from tokenfleet.shared.priority import Priority
from tokenfleet.worker.engine.request import RequestStatus
from tokenfleet.worker.engine.scheduler import Scheduler


def _sched(num_blocks: int, **config: object) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    return make_scheduler(num_blocks=num_blocks, block_size=4, prefix_caching=False, **config)


def _ids(reqs: list) -> list[str]:
    return [r.request_id for r in reqs]


def test_urgent_request_preempts_the_lowest_priority_latest_arrival() -> None:
    # 7 blocks; three 7-token requests hold 2 each; "crit" (8 tokens, 2 blocks) finds 1 free
    sched = _sched(7)
    sched.add(make_request("normal", 7, priority=Priority.NORMAL, arrival=0.0))
    sched.add(make_request("batch_early", 7, priority=Priority.BATCH, arrival=1.0))
    sched.add(make_request("batch_late", 7, priority=Priority.BATCH, arrival=2.0))
    step(sched)
    assert sched.block_manager.num_free_blocks == 1
    sched.add(make_request("crit", 8, priority=Priority.CRITICAL, arrival=3.0))
    out = step(sched)
    assert out.num_preemptions == 1
    assert _ids(sched.waiting) == ["batch_late"]
    assert sched.waiting[0].status is RequestStatus.PREEMPTED
    assert _ids(sched.running) == ["crit", "normal", "batch_early"]
    assert "crit" in {s.request_id for s in out.batch.seqs}  # admitted in the same step


def test_equal_or_more_urgent_priority_is_never_preempted() -> None:
    # "late" is NORMAL and arrived later than the waiting NORMAL "early": same priority, kept
    sched = _sched(4)
    # (5-token prompts: 2 blocks each, room to decode 3 tokens without growing)
    sched.add(make_request("late", 5, priority=Priority.NORMAL, arrival=5.0))
    sched.add(make_request("crit", 5, priority=Priority.CRITICAL, arrival=6.0))
    step(sched)
    sched.add(make_request("early", 8, priority=Priority.NORMAL, arrival=0.0))
    for _ in range(3):
        assert step(sched).num_preemptions == 0
    assert _ids(sched.running) == ["crit", "late"]
    assert _ids(sched.waiting) == ["early"]


def test_a_boosted_running_request_is_not_preempted_for_urgency() -> None:
    sched = _sched(4)
    sched.add(make_request("old", 7, priority=Priority.BATCH, arrival=0.0))
    step(sched)
    sched.running[0].boosted = True  # it waited too long before it got in: the starvation guard
    sched.add(make_request("crit", 12, priority=Priority.CRITICAL, arrival=1.0))
    for _ in range(3):
        assert step(sched).num_preemptions == 0
    assert _ids(sched.running) == ["old"]
    assert _ids(sched.waiting) == ["crit"]


def test_a_full_batch_of_sequences_alone_preempts_nothing() -> None:
    """Urgency preempts for blocks, not for a slot (only batch work gives slots back to more
    urgent work, tests/engine/test_background_yield.py)."""
    sched = _sched(64, max_num_seqs=1)
    sched.add(make_request("normal", 7, priority=Priority.NORMAL))
    step(sched)
    sched.add(make_request("crit", 7, priority=Priority.CRITICAL))
    for _ in range(3):
        assert step(sched).num_preemptions == 0
    assert _ids(sched.waiting) == ["crit"]


def test_no_futile_preemption_when_less_urgent_work_cannot_make_room() -> None:
    # "crit0" holds 3 of 5 blocks, "batch" 1; "crit" needs 3: preempting "batch" gives only 2
    sched = _sched(5)
    sched.add(make_request("crit0", 11, priority=Priority.CRITICAL, arrival=0.0))
    sched.add(make_request("batch", 3, priority=Priority.BATCH, arrival=1.0))
    step(sched)
    sched.add(make_request("crit", 12, priority=Priority.CRITICAL, arrival=2.0))
    assert sched.block_manager.num_free_blocks == 1
    assert step(sched).num_preemptions == 0
    assert _ids(sched.running) == ["crit0", "batch"]
    assert _ids(sched.waiting) == ["crit"]


def test_no_ping_pong_and_the_preempted_request_is_not_starved() -> None:
    """crit preempts low; low is not re-admitted over crit; after max_wait_steps low is boosted
    and preempts crit back once (anti-starvation); crit then waits for low: two preemptions."""
    sched = _sched(4, max_wait_steps=3)
    sched.add(make_request("low", 7, priority=Priority.BATCH, arrival=0.0, max_tokens=6))
    step(sched)
    sched.add(make_request("crit", 12, priority=Priority.CRITICAL, arrival=1.0, max_tokens=20))
    events: list[tuple[int, list[str]]] = []
    finished: list[str] = []
    for i in range(60):
        before = {r.request_id for r in sched.running}
        out = step(sched)
        if out.num_preemptions:
            events.append((i, sorted(before - {r.request_id for r in sched.running})))
        finished += [r.request_id for r in out.requests if r.status is RequestStatus.FINISHED]
        if not sched.has_unfinished():
            break
    assert [victims for _, victims in events] == [["low"], ["crit"]]
    assert events[0][0] == 0  # at once, not through crit's own starvation boost
    assert events[1][0] - events[0][0] >= 3  # low waited max_wait_steps before it came back
    assert finished == ["low", "crit"]
    check(sched)
