"""The step-job state machine: random event sequences never reach an illegal state; final states are final."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptd.client.protocol import PROTOCOL_VERSION, STEP_STATES, SaveRequest, StepState
from ckptd.daemon.arena import Lease
from ckptd.daemon.job import TRANSITIONS, NodeStep, RankSave, StepJob
from ckptd.writer.errors import DuplicateSaveError, SaveTimeoutError, StepFailedError, StepStateError

EVENTS = ("durable", "committed", "fail", "save")


def new_job(local_world_size: int = 2) -> StepJob:
    return StepJob(NodeStep(step=7, node=0, num_nodes=1, world_size=local_world_size,
                            local_world_size=local_world_size))


def rank_save(rank: int) -> RankSave:
    req = SaveRequest(v=PROTOCOL_VERSION, lease_id=rank, step=7, rank=rank, world_size=2, node=0, num_nodes=1,
                      local_world_size=2, shards=[], objects={})
    return RankSave(req, Lease(lease_id=rank, owner=1, offsets=[], sizes=[]))


def apply(job: StepJob, event: str, n: int) -> None:
    if event == "durable":
        job.mark_durable()
    elif event == "committed":
        job.mark_committed()
    elif event == "fail":
        job.fail(StepFailedError(f"failure {n}"))
    else:
        job.add_save(rank_save(n % 4), 1)


@given(st.lists(st.sampled_from(EVENTS), max_size=12))
def test_random_events_never_reach_an_illegal_state(events: list[str]) -> None:
    job = new_job()
    for n, event in enumerate(events):
        before, error_before = job.state, job.error
        try:
            apply(job, event, n)
        except (StepStateError, DuplicateSaveError):
            assert (job.state, job.error) == (before, error_before)  # a refused event changes nothing
        else:
            assert job.state is before or job.state in TRANSITIONS[before]
        if before.final:
            assert (job.state, job.error) == (before, error_before)  # final states are final
        assert job.state in TRANSITIONS
        assert job.finished.is_set() == job.final
        assert (job.error is not None) == (job.state is StepState.FAILED)


def test_a_rank_saved_twice_is_refused_and_counted_once() -> None:
    """Two connections saying one rank both pass the service's early check when each waits on storage
    before recording its save: the second to record it is refused, the first one's save stays."""
    job = new_job(local_world_size=3)
    first = rank_save(0)
    assert job.add_save(first, 10) is False
    with pytest.raises(DuplicateSaveError, match="rank 0 already saved step 7"):
        job.add_save(rank_save(0), 10)
    assert job.saves == {0: first} and job.nbytes == 10 and job.missing_ranks == 2


def test_the_happy_path_and_its_events() -> None:
    job = new_job()
    assert job.state is StepState.PENDING and not job.finished.is_set()
    assert job.add_save(rank_save(0), 10) is False and job.missing_ranks == 1
    assert job.add_save(rank_save(1), 5) is True and job.all_staged.is_set()
    assert job.nbytes == 15
    job.mark_durable()
    assert job.state is StepState.DURABLE and job.durable_at > 0 and not job.finished.is_set()
    job.mark_committed()
    assert job.state is StepState.COMMITTED and job.finished.is_set() and job.error is None


@pytest.mark.parametrize("event", ["committed", "durable", "save", "fail"])
def test_illegal_transitions_raise(event: str) -> None:
    job = new_job()
    job.mark_durable()
    job.mark_committed()
    if event == "fail":
        assert job.fail(StepFailedError("late")) is False  # the first outcome stands
        assert job.state is StepState.COMMITTED and job.error is None
        return
    with pytest.raises(StepStateError):
        apply(job, event, 0)
    assert new_job().state is StepState.PENDING
    with pytest.raises(StepStateError, match="pending -> committed"):
        new_job().mark_committed()


def test_fail_drops_held_blocks_and_wakes_waiters() -> None:
    async def scenario() -> None:
        job = new_job()
        waiter = asyncio.ensure_future(job.finished.wait())
        err = SaveTimeoutError("ranks missing")
        assert job.fail(err) is True
        await asyncio.wait_for(waiter, 1)
        assert job.state is StepState.FAILED and job.error is err and job.held.nbytes == 0
        assert job.fail(StepFailedError("second")) is False and job.error is err

    asyncio.run(scenario())


def test_wire_states_are_the_strings_of_protocol_one() -> None:
    assert [s.value for s in STEP_STATES] == ["pending", "durable", "committed", "failed", "unknown"]
    assert StepState.COMMITTED == "committed" and StepState("failed") is StepState.FAILED
    assert {s for s in StepState if s.final} == {StepState.COMMITTED, StepState.FAILED, StepState.SKIPPED}


def test_the_slots_a_step_still_waits_for() -> None:
    """What a lease granted ahead must leave room for: the other local ranks' saves of a step in flight, at
    their registered plan's span, else the largest save or plan seen; nothing for the asking rank itself,
    nor once every rank saved or the step failed."""
    job = StepJob(NodeStep(step=7, node=0, num_nodes=1, world_size=4, local_world_size=4))
    assert job.due_slots(0, {}) == []  # nobody saved yet: the step's first save leases the usual way
    first = rank_save(0)
    first.staged = 150
    job.add_save(first, 150)
    assert job.due_slots(0, {}) == [150] * 3  # three ranks still due, each as large as rank 0's save
    assert job.due_slots(1, {}) == [150] * 2  # rank 1 asks for its own next save: it is not counted
    assert job.due_slots(0, {2: 400}) == [400, 400, 400]  # rank 2's plan is known; the others as the largest
    assert job.due_slots(0, {1: 10, 2: 20, 3: 30}) == [10, 20, 30]
    assert job.due_slots(0, {0: 150, 1: 10, 2: 20, 3: 30, 9: 90}) == [10, 20, 30]  # never more than are due
    for r in (1, 2, 3):
        job.add_save(rank_save(r), 1)
    assert job.due_slots(0, {4: 99}) == []
    failed = new_job()
    failed.add_save(rank_save(0), 1)
    failed.fail(StepFailedError("gone"))
    assert failed.due_slots(0, {}) == []
