"""The job lifecycle's transition table and the machine's invariants (pure, fast)."""

from __future__ import annotations

import pytest

from nbtrain.core.job import TRANSITIONS, JobSpec, JobState, TransitionError
from nbtrain.core.jobrecord import LiveJob
from nbtrain.core.lifecycle_types import JobSubmission
from nbtrain.core.outbox import Outbox
from tests.test_lifecycle import Harness, run_to_running


def test_every_state_has_its_moves_and_ended_jobs_have_none() -> None:
    assert set(TRANSITIONS) == set(JobState)
    for state, moves in TRANSITIONS.items():
        assert (moves == frozenset()) is state.terminal
        assert state.terminal or state.can_become(state)  # a new reason, same state
    assert JobState.STOPPING.can_become(JobState.STARTING)  # a resize's next generation
    assert not JobState.QUEUED.can_become(JobState.RUNNING)  # only through STARTING


def test_a_move_the_table_does_not_allow_raises_with_the_allowed_ones() -> None:
    spec = JobSpec(job_id="a", name="job-a", world_size=1, steps=10)
    job = LiveJob(JobSubmission(spec=spec), now=0.0, wall=0.0)
    out = Outbox()
    out.set_state(job, JobState.CANCELLED, "stopped by user while queued")
    with pytest.raises(TransitionError, match="from CANCELLED it may go to none: it ended"):
        out.set_state(job, JobState.QUEUED, "resuming: waiting for slots")
    job = LiveJob(JobSubmission(spec=spec), now=0.0, wall=0.0)
    with pytest.raises(TransitionError, match="job job-a cannot go from QUEUED to RUNNING"):
        out.set_state(job, JobState.RUNNING, "training")
    assert job.state is JobState.QUEUED


def test_validate_names_a_broken_invariant() -> None:
    h = Harness(workers=2)
    run_to_running(h)
    h.m.validate()
    job = h.m._live.pop("a")
    with pytest.raises(AssertionError, match=r"the live jobs \[\] are not the jobs with a "
                                             r"generation \['a'\]"):
        h.m.validate()
    h.m._live["a"] = job
    job.state = JobState.QUEUED  # behind the outbox's back
    with pytest.raises(AssertionError, match="job a is QUEUED with generation 0 running"):
        h.m.validate()
