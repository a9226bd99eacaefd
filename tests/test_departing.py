"""A worker that announces it leaves, in the pure job machine (``WorkerLeaving``)."""

from __future__ import annotations

from nbtrain.core.lifecycle_types import SetControl, WorkerLeaving, WorkerLeft
from tests.test_lifecycle import Harness, run_to_running


def test_a_leaving_worker_preempts_its_job_which_moves_to_other_slots_losing_nothing() -> None:
    h = Harness(workers=3)
    launch = run_to_running(h)
    h.committed("a", 0, 40)
    leaving = launch.addresses[1]
    out = h.feed(WorkerLeaving, leaving, "its lifetime ended")
    assert h.of(SetControl, out)[-1].flags["preempt"] == 1
    assert h.state("a") == "STOPPING" and "its lifetime ended" in h.reason("a")
    h.exit("a", 0, 0, "preempted", 44)
    h.exit("a", 0, 1, "preempted", 44)
    [pre] = h.events("a", "preemption")
    assert pre["cause"] == "leaving" and pre["lost_steps"] == 0 and pre["step"] == 44
    relaunch = h.launches("a")[-1]
    assert relaunch.generation == 1 and leaving not in relaunch.addresses
    h.feed(WorkerLeft, leaving)  # it goes: no fault, no restart charged
    assert not h.m.status("a").faults and h.m.status("a").restarts == 0


def test_a_leaving_idle_worker_takes_no_new_rank() -> None:
    h = Harness(workers=2)
    leaving = sorted(s["address"] for s in h.m.slots())[0]
    h.feed(WorkerLeaving, leaving, "retired")
    h.submit("a", 2)
    assert h.launches("a") == [] and h.state("a") == "QUEUED"
    h.join()
    assert leaving not in h.launches("a")[-1].addresses
