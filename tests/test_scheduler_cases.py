"""Decisions real cluster schedulers got wrong (after Volcano and Kueue bug reports), each
driven by hand against the pure gang scheduler."""

from __future__ import annotations

import pytest

from nbtrain.core.sched_types import (
    Decision,
    Finished,
    JobRequest,
    PreemptJob,
    Released,
    ResizeJob,
    SchedulerConfig,
    StartJob,
    Submit,
    Tick,
)
from nbtrain.core.scheduler import Scheduler
from nbtrain.core.topology import Topology


def _job(job_id: str, size: int, **kw: object) -> JobRequest:
    return JobRequest(job_id=job_id, size=size, **kw)  # type: ignore[arg-type]


def _started(ds: list[Decision]) -> dict[str, tuple[object, ...]]:
    return {d.job_id: d.placement.slots for d in ds if isinstance(d, StartJob)}


def _preempted(ds: list[Decision]) -> list[str]:
    return [d.job_id for d in ds if isinstance(d, PreemptJob)]


def test_a_later_high_priority_job_preempts_when_the_head_cannot_start() -> None:
    """Kueue #5243's priority inversion: only the head of the queue could preempt, so a
    priority-10 one-slot job waited behind a blocked large head while priority-0 jobs ran."""
    s = Scheduler(Topology.declare(2, 4), SchedulerConfig())
    s.handle(Submit(0, _job("vip", 4, priority=20)))  # holds host 0; the head cannot move it
    for i in range(4):
        s.handle(Submit(0, _job(f"low{i}", 1)))  # priority 0, host 1
    ds = s.handle(Submit(1, _job("head", 8, priority=10)))  # needs everything: blocked
    assert _preempted(ds) == [] and "head" in s.queued()
    ds = s.handle(Submit(2, _job("small", 1, priority=10)))
    [victim] = _preempted(ds)
    assert victim.startswith("low")
    ds = s.handle(Released(3, victim))
    assert "small" in _started(ds)
    assert s.queued()[0] == "head"  # still first in line
    s.check_invariants()


def test_the_later_job_leaves_alone_what_is_reserved_for_the_head() -> None:
    """When the head will start at a known time, a later job may not take its slots by
    preemption: the head could then wait behind it for ever."""
    s = Scheduler(Topology.declare(1, 4), SchedulerConfig())
    s.handle(Submit(0, _job("vip", 2, priority=9, est_duration_s=100)))
    s.handle(Submit(0, _job("low", 2, est_duration_s=200)))
    ds = s.handle(Submit(1, _job("head", 4, priority=5)))  # cannot preempt vip: waits for t=200
    assert _preempted(ds) == []
    ds = s.handle(Submit(2, _job("later", 2, priority=5)))  # low's slots are the head's at 200
    assert _preempted(ds) == [] and s.queued() == ["head", "later"]
    s.check_invariants()


def test_an_elastic_job_is_shrunk_rather_than_stopped_when_that_and_a_preemption_suffice(
) -> None:
    s = Scheduler(Topology.declare(1, 8), SchedulerConfig())
    s.handle(Submit(0, _job("elastic", 4, min_size=2)))
    s.handle(Submit(0, _job("rigid", 2)))
    ds = s.handle(Submit(10, _job("head", 6, priority=5)))
    resized = {d.job_id: d.placement.world_size for d in ds if isinstance(d, ResizeJob)}
    assert resized == {"elastic": 2}
    assert _preempted(ds) == ["rigid"]
    ds = s.handle(Released(11, "rigid"))
    assert "head" in _started(ds)
    assert s.job("elastic").size == 2 and s.job("elastic").state == "running"
    s.check_invariants()


def test_victims_are_the_fewest_that_free_room_at_any_level() -> None:
    """Not four jobs on one host when two plus the free slots of the neighbour host do."""
    s = Scheduler(Topology.declare(2, 4), SchedulerConfig())
    for i in range(4):
        s.handle(Submit(0, _job(f"low{i}", 1)))  # fill host 0
    s.handle(Submit(0, _job("keep", 2, priority=9)))  # host 1: 2 held (not preemptible by 5)
    ds = s.handle(Submit(1, _job("head", 4, priority=5)))
    assert len(_preempted(ds)) == 2
    released: list[Decision] = []
    for victim in _preempted(ds):
        released += s.handle(Released(2, victim))
    assert "head" in _started(released)
    s.check_invariants()


def test_a_backfilled_job_that_overruns_its_estimate_is_preempted_for_the_head() -> None:
    s = Scheduler(Topology.declare(1, 4), SchedulerConfig())
    s.handle(Submit(0, _job("a", 2, est_duration_s=100)))
    ds = s.handle(Submit(0, _job("head", 4)))
    assert "head" not in _started(ds)
    ds = s.handle(Submit(0, _job("filler", 2, est_duration_s=50)))  # ends before t=100: ok
    assert "filler" in _started(ds)
    assert _preempted(s.handle(Tick(60))) == []
    ds = s.handle(Finished(100, "a"))
    assert "head" not in _started(ds)
    # filler promised to be done at t=50; at t=100 it holds the head's slots.
    assert _preempted(ds) == ["filler"] or _preempted(s.handle(Tick(101))) == ["filler"]
    ds = s.handle(Released(102, "filler"))
    assert "head" in _started(ds)
    s.check_invariants()


def test_a_preemption_plan_without_victims_does_not_crash_the_pass() -> None:
    """Found by fuzzing the job machine: behind a blocked head, ``choose_victims`` can return
    a plan with no victims; the pass used to raise (``np.concatenate`` of nothing), and inside
    the machine that read as a worker whose labels do not fit."""
    from nbtrain.core.sched_types import WorkersAdded

    s = Scheduler(Topology.from_hosts({"h0": ["h0#0"]}),
                  SchedulerConfig(preempt_grace_s=3.0, can_grow=True))

    def job(i: str, n: int, p: int, t: str, mn: int | None = None) -> JobRequest:
        return JobRequest(job_id=i, size=n, priority=p, team=t, min_size=mn)

    for ev in [Submit(367.8, job("j8", 1, 2, "a")), WorkersAdded(399.8, {"hx": ("hx#1",)}),
               Submit(407.8, job("j10", 2, 1, "b", 1)), WorkersAdded(481.0, {"h0": ("h0#3",)}),
               Submit(595.0, job("j13", 3, 3, "a", 2)), WorkersAdded(793.7, {"hx": ("hx#0",)}),
               Submit(794.9, job("j17", 4, 3, "a", 4)), Released(802.9, "j8", avoid=frozenset())]:
        s.handle(ev)  # raised ValueError before the fix
        s.check_invariants()
    assert set(s.queued()) >= {"j17"}


@pytest.mark.xfail(strict=True, reason=(
    "issue 24: open. A victim of a later preemptor restarts on the slots that preemptor waits "
    "for; preventing it moves most pinned schedule hashes (tests/test_sched_hashes.py), so "
    "it waits for a decision on the policy"))
def test_the_victims_of_a_later_preemptor_do_not_take_turns() -> None:
    """Found by tests/test_scheduler_property.py (seed 173, when its drain releases stopping
    jobs before running ones end): behind a head that cannot start, a later job preempts two
    jobs for itself; the first victim to release starts again on its own slots, so when the
    second releases the preemptor is still short and preempts the first again, and so on for
    as long as nothing else ends."""
    s = Scheduler(Topology.declare(1, 4), SchedulerConfig(can_grow=True))
    s.handle(Submit(0, _job("a", 2, priority=1)))
    s.handle(Submit(1, _job("head", 8, priority=2)))  # more than the cluster: waits for workers
    s.handle(Submit(2, _job("b", 2, priority=1)))
    ds = s.handle(Submit(3, _job("urgent", 4, priority=2)))
    assert sorted(_preempted(ds)) == ["a", "b"]
    ds = s.handle(Released(4, "a"))
    assert "a" not in _started(ds), "the victim took back the slots its preemptor waits for"
    ds = s.handle(Released(5, "b"))
    assert "urgent" in _started(ds)
