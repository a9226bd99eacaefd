"""Elastic jobs in the job machine, driven by hand (pure, fast): user resizes, shrink on a lost
worker and growth when it returns, slots handed over by a shrinking job, invalid requests."""

from __future__ import annotations

from typing import Any

from nbtrain.core.job import JobSpec
from nbtrain.core.lifecycle import JobMachine
from nbtrain.core.lifecycle_types import (
    JobSubmission,
    Launch,
    MachineConfig,
    Rejected,
    SetControl,
    Submitted,
    WorkerLeft,
)
from nbtrain.core.machine_events import request_from_wire
from nbtrain.core.sched_types import SchedulerConfig
from tests.test_lifecycle import POLICY, Harness, uncommitted_exit


def submit(h: Harness, job_id: str, world_size: int, *, min_size: int | None = None,
           max_size: int | None = None, priority: int = 0) -> None:
    spec = JobSpec(job_id=job_id, name=f"job-{job_id}", world_size=world_size, steps=1000,
                   min_size=min_size, max_size=max_size, priority=priority)
    h.feed(Submitted, JobSubmission(spec=spec, policy=POLICY))


def resize(h: Harness, job_id: str, size: int, wait_for_workers: bool = False) -> list[Any]:
    return h.feed(request_from_wire, job_id, "resize",
                  {"size": size, "wait_for_workers": wait_for_workers})


def running(h: Harness, job_id: str, upto: int = 5) -> Launch:
    launch = h.launches(job_id)[-1]
    h.steps(job_id, launch.generation, upto, ranks=range(len(launch.addresses)))
    assert h.state(job_id) == "RUNNING"
    return launch


def hand_over(h: Harness, job_id: str, launch: Launch, step: int) -> None:
    """The ranks of ``launch`` checkpoint at ``step`` and exit preempted."""
    h.committed(job_id, launch.generation, step)
    for rank in range(len(launch.addresses)):
        h.exit(job_id, launch.generation, rank, outcome="preempted", step=step)


def phases(h: Harness, job_id: str) -> list[tuple[str, int, int]]:
    return [(e["phase"], e["old"], e["new"]) for e in h.events(job_id, "resize")]


def test_user_shrinks_then_grows_a_running_job() -> None:
    h = Harness(workers=2)
    submit(h, "a", 2, min_size=1)
    first = running(h, "a")
    out = resize(h, "a", 1)
    assert not h.of(Rejected, out)
    assert h.state("a") == "STOPPING" and "resizing from 2 to 1" in h.reason("a")
    assert [c.flags.get("preempt") for c in h.of(SetControl, out)] == [1]
    hand_over(h, "a", first, 7)
    second = h.launches("a")[-1]
    assert second.generation == first.generation + 1 and len(second.addresses) == 1
    h.steps("a", second.generation, 9, ranks=[0])
    status = h.m.status("a")
    assert (status.state, status.size, status.target_size) == ("RUNNING", 1, 1)
    assert phases(h, "a") == [("requested", 2, 1), ("started", 2, 1), ("done", 2, 1)]
    assert h.events("a", "resize")[-1]["duration_s"] >= 0
    assert not h.events("a", "preemption")  # a resize is not reported as a preemption
    # Growing back: the slot it gave up is free, so at once.
    resize(h, "a", 2)
    hand_over(h, "a", second, 9)
    third = h.launches("a")[-1]
    assert len(third.addresses) == 2
    h.steps("a", third.generation, 11, ranks=[0, 1])
    assert h.m.status("a").size == 2
    assert h.m.status("a").restarts == 0  # resizes spend no restart budget


def test_a_resize_whose_checkpoint_does_not_commit_resumes_from_the_last_one() -> None:
    h = Harness(workers=2)
    submit(h, "a", 2, min_size=1)
    first = running(h, "a", upto=9)
    h.committed("a", first.generation, 6)
    resize(h, "a", 1)
    uncommitted_exit(h, "a", first.generation, 2, 9, error="the checkpoint at step 9 did "
                     "not persist and commit within 90 s")
    second = h.launches("a")[-1]
    assert second.generation == first.generation + 1 and len(second.addresses) == 1
    [lost] = h.events("a", "uncommitted")
    assert (lost["cause"], lost["step"], lost["lost_steps"]) == ("resize", 6, 3)
    h.steps("a", second.generation, 8, ranks=[0])
    status = h.m.status("a")
    assert (status.state, status.size, status.restarts) == ("RUNNING", 1, 0)


def test_growth_takes_what_is_free_and_says_what_it_waits_for() -> None:
    h = Harness(workers=3)
    submit(h, "a", 1, max_size=3)
    a1 = running(h, "a")
    submit(h, "b", 1)
    b = running(h, "b")
    out = resize(h, "a", 3)
    assert not h.of(Rejected, out)
    # One slot is free: a grows onto it now (a whole gang of 2), and waits for the third.
    assert phases(h, "a") == [("requested", 1, 2), ("waiting", 1, 3)]
    note = h.m.status("a").resize_note
    assert note == "growing to 3 ranks (2 now) when 1 more slot is free", note
    hand_over(h, "a", a1, 6)
    a2 = h.launches("a")[-1]
    assert len(a2.addresses) == 2
    h.steps("a", a2.generation, 8, ranks=[0, 1])
    assert h.state("a") == "RUNNING"  # trains at 2 meanwhile
    h.exit("b", b.generation, 0)  # b completes: its slot is free
    assert h.state("a") == "STOPPING"
    hand_over(h, "a", a2, 8)
    assert len(h.launches("a")[-1].addresses) == 3
    assert h.m.status("a").resize_note == ""


def test_invalid_resizes_are_refused_with_the_numbers() -> None:
    h = Harness(workers=2)
    submit(h, "fixed", 1)
    submit(h, "a", 1, min_size=1, max_size=4)

    def refusal(job_id: str, size: int) -> str:
        [rejected] = h.of(Rejected, resize(h, job_id, size))
        return rejected.reason

    assert "submitted with a fixed size of 1" in refusal("fixed", 2)
    assert "may run with 1 to 4 ranks (min_size=1, max_size=4), not 5" in refusal("a", 5)
    assert "not 0" in refusal("a", 0)
    assert "the cluster has 2 slots, fewer than the 3 asked" in refusal("a", 3)
    assert h.m.status("a").target_size == 1  # a refused request changes nothing
    assert not h.of(Rejected, resize(h, "a", 3, wait_for_workers=True))
    assert h.m.status("a").target_size == 3
    h.join()  # the third slot: it grows
    assert h.state("a") == "STOPPING"


def test_lost_worker_without_a_spare_shrinks_and_grows_back() -> None:
    h = Harness(workers=2, worker_return_s=600.0)
    submit(h, "a", 2, min_size=1)
    first = running(h, "a")
    gone = first.addresses[1]
    h.feed(WorkerLeft, gone)
    h.fail("a", first.generation, 0, peer=True, error="gloo: connection closed")
    second = h.launches("a")[-1]
    assert len(second.addresses) == 1 and second.addresses[0] == first.addresses[0]
    assert "recovering" in h.reason("a")
    h.steps("a", second.generation, 8, ranks=[0])
    [started, done] = h.events("a", "resize")
    assert (started["phase"], started["old"], started["new"]) == ("started", 2, 1)
    assert "1 of 2 ranks fit now" in started["reason"]
    assert done["phase"] == "done"
    h.join(host="h9")  # a worker joins: the job grows back toward its 2 ranks
    assert h.state("a") == "STOPPING"
    hand_over(h, "a", second, 8)
    assert len(h.launches("a")[-1].addresses) == 2


def test_a_job_placed_on_a_shrinking_jobs_slot_starts_after_the_hand_over() -> None:
    h = Harness(workers=2)
    submit(h, "a", 2, min_size=1)
    first = running(h, "a")
    submit(h, "b", 1, priority=5)
    # The scheduler shrank a to make room: b waits for the slot a still trains on.
    assert not h.launches("b")
    assert h.state("b") == "STARTING" and "waiting for job-a to hand over 1 slot" in h.reason("b")
    assert phases(h, "a")[0][:3] == ("requested", 2, 1)
    hand_over(h, "a", first, 6)
    [b] = h.launches("b")
    [a_now] = [launch for launch in h.launches("a") if launch.generation == 1]
    assert set(b.addresses).isdisjoint(a_now.addresses)
    assert set(b.addresses) | set(a_now.addresses) == set(first.addresses)


def test_resize_interval_holds_growth_back() -> None:
    m = JobMachine(MachineConfig(), SchedulerConfig(min_resize_interval_s=60.0))
    h = Harness(workers=1)
    h.m = m
    h.join()
    submit(h, "a", 2, min_size=1)
    first = running(h, "a")
    assert len(first.addresses) == 1
    h.join()
    assert h.state("a") == "RUNNING"  # started moments ago: no growth yet
    for second in range(1, 62):  # a minute of training
        h.advance(1.0)
        h.steps("a", first.generation, 5 + second, ranks=[0])
    assert h.state("a") == "STOPPING"
    assert phases(h, "a") == [("requested", 1, 2)]
