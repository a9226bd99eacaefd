"""The job machine, driven by hand: every transition without a cluster (pure, fast)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import pytest

from nbtrain.core.faults import Fault
from nbtrain.core.job import JobSpec, JobState, user_actions
from nbtrain.core.lifecycle import JobMachine
from nbtrain.core.lifecycle_types import (
    Cancel,
    Command,
    Deliver,
    Diagnose,
    EndGeneration,
    HangDiagnosed,
    JobPolicy,
    JobSubmission,
    Launch,
    MachineConfig,
    Publish,
    RankExit,
    RankFailureInfo,
    Rejected,
    RestartWorkers,
    SetControl,
    Submitted,
    Tick,
    WorkerJoined,
    WorkerLeft,
)
from nbtrain.core.machine_events import rank_from_wire, request_from_wire
from nbtrain.core.sched_types import SchedulerConfig

POLICY = JobPolicy(hang_factor=20.0, hang_floor_s=3.0, peer_release_s=0.3, failure_grace_s=10.0)


class Harness:
    """A machine, a hand-driven clock, and everything it said."""

    def __init__(self, workers: int = 2, *, grace_s: float = 30.0, hosts: int = 1,
                 worker_return_s: float = 120.0, slot_forget_s: float = 3600.0) -> None:
        self.m = JobMachine(MachineConfig(worker_return_s=worker_return_s,
                                          slot_forget_s=slot_forget_s),
                            SchedulerConfig(preempt_grace_s=grace_s))
        self.t = 100.0
        self.out: list[Command] = []
        self.next_port = 4000
        self.reported: dict[tuple[str, int, int], int] = {}
        for i in range(workers):
            self.join(host=f"h{i % hosts}")

    # -- feeding ------------------------------------------------------------------------
    def feed(self, event_type: Any, *args: Any, **kwargs: Any) -> list[Command]:
        out = self.m.handle(event_type(self.t, 1e9 + self.t, *args, **kwargs))
        self.m.validate()  # the machine's invariants hold after every event
        self.out += out
        return out

    def advance(self, seconds: float) -> list[Command]:
        self.t += seconds
        return self.feed(Tick)

    def join(self, host: str = "h0", name: str = "") -> str:
        addr = f"tcp://{host}:{self.next_port}"
        self.next_port += 1
        self.feed(WorkerJoined, addr, host, name)
        return addr

    def submit(self, job_id: str, world_size: int = 2, *, priority: int = 0,
               team: str = "default", queue: bool = True, max_restarts: int = 3,
               faults: Iterable[Fault] = (), fail_fast: bool = True,
               **spec_fields: Any) -> list[Command]:
        spec = JobSpec(job_id=job_id, name=f"job-{job_id}", world_size=world_size, steps=1000,
                       priority=priority, team=team, queue=queue, max_restarts=max_restarts,
                       fail_fast=fail_fast, **spec_fields)
        return self.feed(Submitted, JobSubmission(spec=spec, policy=POLICY, faults=tuple(faults)))

    def steps(self, job_id: str, gen: int, upto: int, ranks: Iterable[int] = (0, 1),
              step_s: float = 0.01) -> None:
        for rank in ranks:
            first = self.reported.get((job_id, gen, rank), 0) + 1
            self.reported[(job_id, gen, rank)] = upto
            rows = [[s, 1e9 + self.t, step_s, 0.0, step_s * 0.8, 0.0, step_s * 0.2]
                    for s in range(first, upto + 1)]
            self.feed(rank_from_wire, job_id, {"kind": "steps", "rank": rank,
                                               "generation": gen, "rows": rows})

    def committed(self, job_id: str, gen: int, step: int) -> None:
        self.feed(rank_from_wire, job_id, {"kind": "checkpoint", "phase": "committed",
                                           "step": step, "rank": 0, "generation": gen})

    def exit(self, job_id: str, gen: int, rank: int, outcome: str = "completed",
             step: int = 1000) -> list[Command]:
        return self.feed(RankExit, job_id, gen, rank, {"outcome": outcome, "step": step})

    def fail(self, job_id: str, gen: int, rank: int, *, peer: bool = False, step: int = 10,
             error: str = "ValueError: boom") -> list[Command]:
        info = RankFailureInfo(error=error, traceback="Traceback...", host="h0", step=step,
                               when=1e9 + self.t - 0.01, peer=peer)
        return self.feed(RankExit, job_id, gen, rank, None, info)

    # -- reading ------------------------------------------------------------------------
    def state(self, job_id: str) -> str:
        return self.m.status(job_id).state

    def reason(self, job_id: str) -> str:
        return self.m.status(job_id).reason

    def of(self, kind: type, out: list[Command] | None = None) -> list[Any]:
        return [c for c in (self.out if out is None else out) if isinstance(c, kind)]

    def launches(self, job_id: str) -> list[Launch]:
        return [c for c in self.of(Launch) if c.job_id == job_id]

    def events(self, job_id: str, kind: str) -> list[dict[str, Any]]:
        return [dict(c.event) for c in self.of(Publish)
                if c.job_id == job_id and c.event.get("kind") == kind]


def run_to_running(h: Harness, job_id: str = "a", world_size: int = 2) -> Launch:
    h.submit(job_id, world_size)
    launch = h.launches(job_id)[-1]
    h.steps(job_id, launch.generation, 5, ranks=range(world_size))
    assert h.state(job_id) == "RUNNING"
    return launch


def test_no_workers_queues_then_starts_when_one_joins() -> None:
    h = Harness(workers=0)
    h.submit("a", 1)
    assert h.state("a") == "QUEUED" and "the cluster has 0" in h.reason("a")
    h.join()
    [launch] = h.launches("a")
    assert launch.generation == 0 and len(launch.addresses) == 1
    assert h.state("a") == "STARTING"


def test_gang_waits_whole_with_the_reason_and_starts_when_workers_join() -> None:
    h = Harness(workers=3)
    h.submit("a", 4)
    assert h.launches("a") == []
    assert h.reason("a") == ("needs 4 slots at once; the cluster has 3: waiting for workers "
                             "to join")
    h.join()
    [launch] = h.launches("a")
    assert len(set(launch.addresses)) == 4


def test_fail_fast_submission_is_rejected_with_the_numbers() -> None:
    h = Harness(workers=2)
    run_to_running(h, "a")
    out = h.submit("b", 2, queue=False)
    [rejected] = h.of(Rejected, out)
    assert rejected.reason.startswith("job job-b needs 2 slots at once but only 0 of the "
                                      "cluster's 2 are free (queue=False")
    assert "b" not in h.m.job_ids()


def test_run_to_completion() -> None:
    h = Harness()
    launch = run_to_running(h)
    h.exit("a", 0, 0)
    assert h.state("a") == "RUNNING"
    out = h.exit("a", 0, 1)
    assert h.of(EndGeneration, out) == [EndGeneration("a", 0)]
    assert h.state("a") == "SUCCEEDED" and h.reason("a") == "completed 1000 steps"
    assert len(launch.addresses) == 2
    # The slots are free again: the next job starts at once.
    h.submit("b")
    assert h.launches("b")


def test_exception_releases_peers_then_recovers_on_a_spare_avoiding_the_failed_slot() -> None:
    h = Harness(workers=3)
    launch = run_to_running(h)
    h.committed("a", 0, 4)
    h.steps("a", 0, 12)
    h.fail("a", 0, 1, step=12)
    # Peers blocked in gloo: the failed rank's worker is restarted after peer_release_s.
    assert h.of(RestartWorkers, h.advance(0.1)) == []
    [restart] = h.of(RestartWorkers, h.advance(0.3))
    assert restart.addresses == (launch.addresses[1],)
    h.fail("a", 0, 0, peer=True, step=12, error="DistBackendError: Connection closed by peer")
    [fault] = h.m.status("a").faults
    assert fault["what"] == "exception" and fault["rank"] == 1 and fault["resume_step"] == 4
    assert fault["lost_steps"] == 8  # steps 5..12 ran after the checkpoint of step 4
    assert "rank 1 raised at step 12" in fault["cause"]
    relaunch = h.launches("a")[-1]
    assert relaunch.generation == 1
    assert launch.addresses[1] not in relaunch.addresses  # the spare, not the restarting slot
    h.steps("a", 1, 7)
    [recovery] = h.events("a", "recovery")
    assert recovery["recovery_s"] is not None and recovery["recovery_s"] >= 0


def test_restart_budget_exhausted_fails_with_every_fault() -> None:
    h = Harness()
    h.submit("a", 2, max_restarts=1, fail_fast=False)
    for gen in (0, 1):
        h.steps("a", gen, 5)
        h.fail("a", gen, 0)
        h.fail("a", gen, 1, peer=True)
        h.advance(1.0)  # lets restarted workers come back
        for slot in h.m.slots():
            if slot["state"] == "restarting":
                h.join()
    assert h.state("a") == "FAILED"
    assert "restart budget spent (max_restarts=1" in h.reason("a")
    error = h.m.status("a").error or ""
    assert error.count("exception on rank 0") == 2 and "Traceback" in error


def _fail_twice(h: Harness, steps: tuple[int, int], errors: tuple[str, str]) -> None:
    for gen in (0, 1):
        h.steps("a", gen, 5)
        h.fail("a", gen, 1, step=steps[gen], error=errors[gen])
        h.fail("a", gen, 0, peer=True, step=steps[gen])
        h.advance(1.0)
        for slot in h.m.slots():
            if slot["state"] == "restarting":
                h.join()


def test_fail_fast_ends_a_job_whose_code_raises_the_same_at_the_same_step() -> None:
    h = Harness()
    h.submit("a", 2, max_restarts=3)
    _fail_twice(h, (7, 7), ("KeyError: 'lr'", "KeyError: 'lr'"))
    assert h.state("a") == "FAILED"
    assert h.reason("a").startswith("the same exception twice at step 7 on rank 1: KeyError")
    assert "fail_fast=False" in h.reason("a")
    assert h.m.status("a").restarts == 1  # one retry, not the whole budget


@pytest.mark.parametrize(("steps", "errors"), [
    ((7, 9), ("KeyError: 'lr'", "KeyError: 'lr'")),  # another step: not the same
    ((7, 7), ("OSError: disk", "OSError: network")),  # another message
])
def test_fail_fast_retries_exceptions_that_differ(steps: tuple[int, int],
                                                  errors: tuple[str, str]) -> None:
    h = Harness()
    h.submit("a", 2, max_restarts=3)
    _fail_twice(h, steps, errors)
    assert h.state("a") != "FAILED" and h.m.status("a").restarts == 2


def test_without_fail_fast_the_same_exception_is_retried() -> None:
    h = Harness()
    h.submit("a", 2, max_restarts=3, fail_fast=False)
    _fail_twice(h, (7, 7), ("KeyError: 'lr'", "KeyError: 'lr'"))
    assert h.state("a") != "FAILED" and h.m.status("a").restarts == 2


def test_zero_restarts_fails_at_the_first_fault() -> None:
    h = Harness()
    h.submit("a", 2, max_restarts=0)
    h.fail("a", 0, 1)
    h.fail("a", 0, 0, peer=True)
    assert h.state("a") == "FAILED" and "max_restarts=0" in h.reason("a")


def test_user_preempt_then_resume() -> None:
    h = Harness()
    run_to_running(h)
    out = h.feed(request_from_wire, "a", "preempt")
    assert h.of(SetControl, out)[-1].flags["preempt"] == 1
    assert h.state("a") == "STOPPING"
    h.exit("a", 0, 0, "preempted", 40)
    h.exit("a", 0, 1, "preempted", 40)
    assert h.state("a") == "PREEMPTED"
    assert h.reason("a") == "checkpointed at step 40 and released its slots; resume() to continue"
    h.submit("b")  # the slots are free while a is preempted
    assert h.launches("b")
    h.feed(request_from_wire, "a", "resume")
    assert h.state("a") == "QUEUED" and h.reason("a").startswith("resuming: ")


def test_what_a_worker_said_of_its_device_is_in_its_slot_view_after_a_rejoin_too() -> None:
    h = Harness(workers=0)
    about = (("gpu_name", "NVIDIA H100"), ("pci_bus_id", "00000000:5d:00.0"))
    h.feed(WorkerJoined, "tcp://h0:1", "h0", "w0", "", "", "GPU-1", about=about)
    view = h.m.slots()[0]
    assert view["gpu_name"] == "NVIDIA H100" and view["pci_bus_id"] == "00000000:5d:00.0"
    assert view["slot"] == "h0#0" and view["device"] == "gpu"
    h.feed(WorkerLeft, "tcp://h0:1")
    h.feed(WorkerJoined, "tcp://h0:2", "h0", "w0", "", "", "GPU-1",
           about=(("gpu_name", "NVIDIA H100"), ("gpu_note", "restarted")))
    [view] = h.m.slots()
    assert view["address"] == "tcp://h0:2" and view["gpu_note"] == "restarted"
    assert "pci_bus_id" not in view  # what the new worker said, not the old one's


def test_the_machine_owns_the_generations_control_flags_and_their_version() -> None:
    h = Harness()
    launch = run_to_running(h)
    held = h.m.control("a")
    assert held is not None and held.generation == launch.generation and held.version == 0
    assert held.flags == dict(launch.control)
    h.feed(request_from_wire, "a", "checkpoint")
    h.feed(request_from_wire, "a", "preempt")
    held = h.m.control("a")
    assert held is not None and held.version == 2  # each change a new version to long-poll
    assert held.flags["preempt"] == 1 and held.flags["checkpoint"] == 1
    assert held.flags == dict(h.of(SetControl)[-1].flags)
    h.exit("a", 0, 0, "preempted", 40)
    h.exit("a", 0, 1, "preempted", 40)
    assert h.m.control("a") is None  # no live generation: its rank 0's poll hears "ended"
    assert h.m.control("nope") is None


def _job_in(state: str) -> tuple[Harness, str]:
    """A harness with a job in ``state``, and that job's id."""
    h = Harness(workers=2)
    h.submit("a", max_restarts=0)
    if state == "QUEUED":
        h.submit("b")  # b waits behind a
        return h, "b"
    if state == "FAILED":
        h.fail("a", 0, 0)
        h.fail("a", 0, 1, peer=True)
        return h, "a"
    if state != "STARTING":
        h.steps("a", 0, 5)
    if state in ("STOPPING", "PREEMPTED"):
        h.feed(request_from_wire, "a", "preempt")
    if state == "CANCELLED":
        h.feed(request_from_wire, "a", "stop")
    if state in ("PREEMPTED", "SUCCEEDED", "CANCELLED"):
        outcome = {"PREEMPTED": "preempted", "SUCCEEDED": "completed"}.get(state, "stopped")
        for rank in (0, 1):
            h.exit("a", 0, rank, outcome, 5 if outcome != "completed" else 1000)
    return h, "a"


@pytest.mark.parametrize("state", [s.value for s in JobState])
def test_resume_is_judged_by_the_rule_the_buttons_read(state: str) -> None:
    """Every state: the machine refuses ``resume`` exactly where ``user_actions`` (what the
    widget and the served page enable their Resume button by) says no."""
    h, job = _job_in(state)
    assert h.state(job) == state
    out = h.feed(request_from_wire, job, "resume")
    refused = [c for c in h.of(Rejected, out) if "only a PREEMPTED job can resume" in c.reason]
    assert bool(refused) is not user_actions(state)["resume"]
    if not refused:
        assert h.state(job) in ("QUEUED", "STARTING")  # resumed: queued, or started at once


def test_a_checkpoint_request_to_a_script_job_is_refused_and_one_without_a_policy_is_not(
        ) -> None:
    h = Harness(workers=4)
    h.submit("s", checkpoint=None, extra={"kind": "script"})
    h.submit("f", checkpoint=None, extra={"kind": "function"})
    for job in ("s", "f"):
        h.steps(job, 0, 5)
    out = h.feed(request_from_wire, "s", "checkpoint")
    [refused] = h.of(Rejected, out)
    assert "keeps its own snapshots" in refused.reason and not h.of(SetControl, out)
    assert h.state("s") == "RUNNING"  # refused in words; the job trains on
    # checkpoint=None means no checkpoints by policy: one on request is still taken
    out = h.feed(request_from_wire, "f", "checkpoint")
    assert not h.of(Rejected, out) and h.of(SetControl, out)[-1].flags["checkpoint"] == 1


def test_stop_during_user_preempt_cancels() -> None:
    h = Harness()
    run_to_running(h)
    h.feed(request_from_wire, "a", "preempt")
    h.feed(request_from_wire, "a", "stop")
    h.exit("a", 0, 0, "preempted", 40)
    h.exit("a", 0, 1, "preempted", 40)
    assert h.state("a") == "CANCELLED" and h.reason("a") == "stopped by user at step 40"


def test_stop_during_straggler_replacement_cancels() -> None:
    h = Harness(workers=3)
    run_to_running(h)
    h.m._jobs["a"].preempt = None  # (set below through the public path)
    # A confirmed straggler under the replace policy: simulate the machine's own decision by
    # preempting through the same path as a replacement.
    job = h.m._jobs["a"]
    from nbtrain.core.jobrecord import Preemption

    job.preempt = Preemption(cause="replace", reason="rank 1 slow", deadline=h.t + 30,
                             slot=job.gen.slots[1] if job.gen else None)
    h.feed(request_from_wire, "a", "stop")
    h.exit("a", 0, 0, "preempted", 40)
    h.exit("a", 0, 1, "preempted", 40)
    assert h.state("a") == "CANCELLED"
    assert len(h.launches("a")) == 1  # not relaunched


def test_stop_while_queued_and_while_failing() -> None:
    h = Harness()
    run_to_running(h)
    h.submit("b")
    h.feed(request_from_wire, "b", "stop")
    assert h.state("b") == "CANCELLED" and h.reason("b") == "stopped by user while queued"
    h.fail("a", 0, 1)
    h.feed(request_from_wire, "a", "stop")
    h.fail("a", 0, 0, peer=True)
    assert h.state("a") == "CANCELLED" and "a rank failed meanwhile" in h.reason("a")



def test_a_stop_whose_ranks_do_not_end_within_its_grace_is_forced_with_its_cause() -> None:
    """A stop waits for a final checkpoint, not forever: a rank still running
    ``stop_grace_s`` after the stop request (stuck in a commit, a hung write, a lost control
    message) is stopped, its worker restarted, and the reason says so and why."""
    h = Harness(workers=2)
    run_to_running(h)
    h.committed("a", 0, 20)
    h.steps("a", 0, 27)
    h.feed(request_from_wire, "a", "stop")
    h.exit("a", 0, 1, "stopped", 28)  # rank 0 never ends
    h.advance(200)
    h.feed(request_from_wire, "a", "stop")  # asking again does not move the deadline
    assert h.of(Cancel, h.advance(99)) == [] and h.state("a") == "STOPPING"
    out = h.advance(2)
    assert h.of(Cancel, out) == [Cancel("a", 0, (0,))]
    [restart] = h.of(RestartWorkers, out)
    assert "stop_grace_s (300 s)" in restart.reason
    assert h.state("a") == "CANCELLED"
    reason = h.reason("a")
    assert reason.startswith("stopped by user at step 28; rank(s) 0 had not ended 300 s")
    assert "the newest committed checkpoint is step 20" in reason
    h.submit("b", 1)  # rank 1's slot is free again (rank 0's worker is restarting)
    assert len(h.launches("b")) == 1


def test_a_stop_that_ends_in_time_says_nothing_more() -> None:
    h = Harness(workers=2)
    run_to_running(h)
    h.feed(request_from_wire, "a", "stop")
    h.advance(250)
    h.exit("a", 0, 0, "stopped", 30)
    h.exit("a", 0, 1, "stopped", 30)
    assert h.reason("a") == "stopped by user at step 30"
    assert h.of(Cancel, h.advance(100)) == []


def test_stop_grace_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stop_grace_s must be > 0 seconds, got 0"):
        JobPolicy(stop_grace_s=0)


STUCK = 'File "nbtrain/runtime/faults.py", line 66, in fire\n  threading.Event().wait()'
WAITING = 'File "torch/distributed/distributed_c10d.py", line 2800, in all_reduce'


def test_hang_is_diagnosed_and_the_stuck_rank_restarted() -> None:
    h = Harness(workers=3)
    launch = run_to_running(h)
    h.steps("a", 0, 20)
    out = h.advance(2.0)
    assert h.of(Diagnose, out) == []
    out = h.advance(1.5)  # 3.5 s silent > floor 3 s: look at the stacks
    assert h.of(Diagnose, out) == [Diagnose("a", 0)]
    stacks = {0: WAITING, 1: STUCK}
    assert not h.of(RestartWorkers, h.feed(HangDiagnosed, "a", 0, (1,), stacks))
    out = h.advance(1.0)
    assert h.of(Diagnose, out) == []  # looks again only after the confirmation interval
    out = h.advance(1.5)
    assert h.of(Diagnose, out) == [Diagnose("a", 0)]
    out = h.feed(HangDiagnosed, "a", 0, (1,), stacks)  # rank 1's stack did not move
    [restart] = h.of(RestartWorkers, out)
    assert restart.addresses == (launch.addresses[1],)
    h.feed(WorkerLeft, launch.addresses[1])
    h.fail("a", 0, 0, peer=True)
    [fault] = h.m.status("a").faults
    assert fault["what"] == "hang" and fault["rank"] == 1
    assert "rank 1's call stack did not change in 2.5 s, outside a collective" in fault["cause"]
    assert "threading.Event().wait()" in fault["cause"]
    assert "floor 3 s" in fault["cause"] and "no step progress" in fault["error"]
    assert h.launches("a")[-1].generation == 1


def test_a_slow_but_busy_job_is_not_declared_hung() -> None:
    h = Harness(workers=2)
    run_to_running(h)
    h.steps("a", 0, 20)
    h.advance(3.5)
    h.feed(HangDiagnosed, "a", 0, (0, 1), {0: "forward: line 10", 1: "forward: line 12"})
    h.advance(2.5)
    # Moving stacks: slow, not stuck. Said once, and no restart.
    out = h.feed(HangDiagnosed, "a", 0, (0, 1), {0: "backward: line 40", 1: "step: line 7"})
    assert not h.of(RestartWorkers, out)
    [slow] = h.events("a", "slow")
    assert "slow, not hung" in slow["note"]
    h.advance(1.0)
    h.steps("a", 0, 21)  # it steps again: the look is over
    assert h.m.status("a").state == "RUNNING" and not h.m.status("a").faults
    assert h.m.job_ids() == ["a"] and h.launches("a")[-1].generation == 0


def test_the_hang_limit_grows_with_the_longest_step_seen() -> None:
    h = Harness(workers=2)
    launch = run_to_running(h)
    rows = [[s, 1e9 + h.t, 4.0 if s == 8 else 0.01, 0.0, 0.008, 0.0, 0.002] for s in range(6, 11)]
    for rank in (0, 1):
        h.feed(rank_from_wire, "a", {"kind": "steps", "rank": rank, "generation": 0, "rows": rows})
    out = h.advance(7.0)  # 7 s > floor 3 s, but a 4 s step was seen: the limit is 8 s
    assert h.of(Diagnose, out) == []
    out = h.advance(1.5)
    assert h.of(Diagnose, out) == [Diagnose("a", 0)]
    assert len(launch.addresses) == 2


def test_a_rank_stuck_in_setup_is_caught_by_its_own_bound() -> None:
    h = Harness(workers=3)
    policy = replace(POLICY, setup_timeout_s=30.0)
    spec = JobSpec(job_id="a", name="job-a", world_size=2, steps=100)
    h.feed(Submitted, JobSubmission(spec=spec, policy=policy))
    [launch] = h.launches("a")
    for rank in (0, 1):
        h.feed(rank_from_wire, "a",
               {"kind": "phase", "phase": "setup", "rank": rank, "generation": 0})
    h.feed(rank_from_wire, "a",
           {"kind": "rank_started", "rank": 0, "generation": 0, "start_step": 0})
    assert h.of(Diagnose, h.advance(29.0)) == []
    out = h.advance(2.0)  # rank 1 has been in setup for 31 s
    assert h.of(Diagnose, out) == [Diagnose("a", 0)]
    out = h.feed(HangDiagnosed, "a", 0, (), {})
    [restart] = h.of(RestartWorkers, out)
    assert restart.addresses == (launch.addresses[1],)
    h.feed(WorkerLeft, launch.addresses[1])
    h.fail("a", 0, 0, peer=True)
    [fault] = h.m.status("a").faults
    assert fault["what"] == "hang" and fault["rank"] == 1
    assert "rank 1 spent 31.0 s in setup (bound 30 s, setup_timeout_s)" in fault["cause"]


def test_ranks_that_never_exit_after_a_failure_are_force_ended() -> None:
    h = Harness(workers=3)
    run_to_running(h)
    h.fail("a", 0, 1)
    h.advance(0.5)
    out = h.advance(10.0)
    assert h.of(Cancel, out) == [Cancel("a", 0, (0,))]
    assert len(h.of(RestartWorkers)) == 2  # the failed rank's, then the stuck one's
    assert h.reason("a").endswith("the cluster has 1 (2 restarting): waiting for workers to join")
    h.join()
    h.join()
    assert h.launches("a")[-1].generation == 1


def test_worker_death_fails_the_rank_and_its_slot_comes_back_under_a_new_address() -> None:
    h = Harness(workers=2)
    launch = run_to_running(h)
    out = h.feed(WorkerLeft, launch.addresses[1])
    assert h.of(Cancel, out) == [Cancel("a", 0, (1,))]
    assert [s["state"] for s in h.m.slots()].count("offline") == 1
    h.fail("a", 0, 0, peer=True)
    [fault] = h.m.status("a").faults
    assert fault["what"] == "worker died"
    assert h.reason("a").startswith("restart 1/3 after worker died on rank 1")
    assert h.reason("a").endswith("the cluster has 1 (1 offline): waiting for workers to join")
    h.join()  # the nanny's new worker
    assert len(h.m.slots()) == 2  # the same slot, not a new one
    assert h.launches("a")[-1].generation == 1


def test_restarted_worker_that_never_returns_is_reported_lost() -> None:
    h = Harness(workers=2, worker_return_s=60)
    launch = run_to_running(h)
    h.fail("a", 0, 1)
    h.advance(0.5)
    h.feed(WorkerLeft, launch.addresses[1])
    h.advance(61)
    lost = [c.event for c in h.of(Publish) if c.job_id is None
            and c.event.get("kind") == "slot_lost"]
    assert len(lost) == 1 and "did not come back within 60 s" in lost[0]["reason"]


def test_fifty_restarts_keep_the_slot_count() -> None:
    h = Harness(workers=2)
    for i in range(50):
        addr = next(s["address"] for s in h.m.slots() if s["address"])
        h.feed(WorkerLeft, addr)
        h.join(name="")
        assert sum(1 for s in h.m.slots() if s["state"] == "free") == 2, i
    assert len(h.m.slots()) == 2


def test_priority_preemption_checkpoints_releases_and_resumes_the_victim() -> None:
    h = Harness(workers=2, grace_s=30)
    run_to_running(h, "low")
    h.committed("low", 0, 20)
    h.submit("high", 2, priority=5)
    assert h.state("low") == "STOPPING" and "preempted for 'high'" in h.reason("low")
    assert h.of(SetControl)[-1].flags["preempt"] == 1
    assert "low releasing its slots" in h.reason("high")
    h.exit("low", 0, 0, "preempted", 25)
    h.exit("low", 0, 1, "preempted", 25)
    assert h.launches("high")
    assert h.state("low") == "QUEUED"
    assert h.reason("low").startswith("preempted for job job-high at step 25")
    [pre] = h.events("low", "preemption")
    assert pre["cause"] == "scheduler" and not pre["forced"] and pre["lost_steps"] == 0
    h.steps("high", 0, 5)
    h.exit("high", 0, 0)
    h.exit("high", 0, 1)
    [_, again] = h.launches("low")
    assert again.generation == 1


def test_preemption_grace_runs_out_and_the_victim_is_forced_off() -> None:
    h = Harness(workers=2, grace_s=30)
    run_to_running(h, "low")
    h.committed("low", 0, 20)
    h.steps("low", 0, 27)
    h.submit("high", 2, priority=5)
    assert h.of(Cancel, h.advance(29)) == []
    out = h.advance(2)
    assert h.of(Cancel, out) == [Cancel("low", 0, (0, 1))]
    assert len(h.of(RestartWorkers, out)) == 1
    [pre] = h.events("low", "preemption")
    assert pre["forced"] and pre["lost_steps"] == 7 and pre["step"] == 20
    assert "forced: 7 uncommitted steps lost" in h.reason("low")


def test_failure_during_the_preemption_checkpoint_keeps_the_job_preempted() -> None:
    h = Harness()
    run_to_running(h)
    h.committed("a", 0, 20)
    h.feed(request_from_wire, "a", "preempt")
    h.exit("a", 0, 1, "preempted", 30)
    h.fail("a", 0, 0, step=30, error="RuntimeError: preemption checkpoint at step 30 did not "
                                    "commit")
    assert h.state("a") == "PREEMPTED"
    assert "resumes from step 20" in h.reason("a")


def uncommitted_exit(h: Harness, job_id: str, gen: int, ranks: int, step: int,
                     error: str = "CheckpointError: receipts of ranks [1] missing") -> None:
    """Every rank exits preempted at ``step``; the committer says its checkpoint did not
    commit (what ``run_rank`` reports when the final commit fails or runs out of time)."""
    for rank in range(ranks):
        summary: dict[str, Any] = {"outcome": "preempted", "step": step,
                                   "checkpoint_step": step,
                                   "checkpoint_committed": rank != 0,
                                   "checkpoint_error": error if rank == 0 else None}
        h.feed(RankExit, job_id, gen, rank, summary)


def test_a_preemption_checkpoint_that_does_not_commit_costs_only_uncommitted_steps() -> None:
    h = Harness(workers=2, grace_s=30)
    run_to_running(h, "low")
    h.committed("low", 0, 20)
    h.steps("low", 0, 27)
    h.submit("high", 2, priority=5)
    uncommitted_exit(h, "low", 0, 2, 27)
    assert h.state("low") == "QUEUED"
    assert h.m.status("low").restarts == 0  # no restart charged
    assert "its checkpoint did not commit: 7 steps lost" in h.reason("low")
    [lost] = h.events("low", "uncommitted")
    assert lost["step"] == 20 and lost["lost_steps"] == 7 and lost["cause"] == "scheduler"
    assert "receipts of ranks [1] missing" in lost["reason"]
    [pre] = h.events("low", "preemption")
    assert pre["step"] == 20 and pre["lost_steps"] == 7 and not pre["forced"]
    assert not h.events("low", "fault")
    assert h.launches("high")


def test_preempted_over_and_over_with_failing_commits_never_fails_the_job() -> None:
    """More failed preemption commits than the restart budget allows faults: still uncharged."""
    h = Harness(workers=2, grace_s=30)
    run_to_running(h, "low")
    h.committed("low", 0, 10)
    for gen in range(JobSpec.max_restarts + 2):
        h.feed(request_from_wire, "low", "preempt")
        uncommitted_exit(h, "low", gen, 2, 12 + gen)
        assert h.state("low") == "PREEMPTED", gen
        h.feed(request_from_wire, "low", "resume")
        h.steps("low", gen + 1, 12 + gen + 1)
    assert h.state("low") == "RUNNING" and h.m.status("low").restarts == 0
    assert len(h.events("low", "uncommitted")) == JobSpec.max_restarts + 2


def test_inject_delivers_to_the_rank_and_planned_faults_travel_with_the_launch() -> None:
    h = Harness()
    planned = Fault("kill", rank=1, step=7)
    h.submit("a", faults=[planned])
    assert h.launches("a")[0].faults == (planned,)
    h.steps("a", 0, 5)
    fault = Fault("slow", rank=0, factor=2.0)
    out = h.feed(request_from_wire, "a", "inject", fault)
    assert h.of(Deliver, out) == [Deliver("a", h.launches("a")[0].addresses[0], fault)]


def test_consumed_planned_fault_does_not_fire_after_the_restart() -> None:
    h = Harness(workers=3)
    h.submit("a", faults=[Fault("raise", rank=1, step=7)])
    h.steps("a", 0, 6)
    h.fail("a", 0, 1, step=6)
    h.fail("a", 0, 0, peer=True)
    assert h.launches("a")[-1].faults == ()


def test_queue_order_is_explained() -> None:
    h = Harness(workers=2)
    run_to_running(h, "a")
    h.submit("b")
    h.submit("c")
    assert h.reason("b") == "needs 2 slots at once; 0 of 2 free"
    assert h.reason("c") == "waiting behind job job-b (needs 2 slots at once; 0 of 2 free)"


def test_unknown_request_is_an_error() -> None:
    h = Harness()
    run_to_running(h)
    with pytest.raises(ValueError, match="unknown request 'frobnicate'"):
        h.feed(request_from_wire, "a", "frobnicate")


def test_forgotten_jobs_leave_the_machine_and_the_scheduler() -> None:
    """A controller that runs for weeks keeps only live jobs (and a bounded history that the
    engine chooses), in the machine and in the gang scheduler."""
    h = Harness()
    for i in range(30):
        jid = f"j{i}"
        h.submit(jid)
        h.exit(jid, 0, 0)
        h.exit(jid, 0, 1)
        assert h.state(jid) == "SUCCEEDED"
        h.m.forget(jid)
    assert h.m.job_ids() == []
    assert h.m.sched is not None and h.m.sched.job_ids() == []
    h.submit("live")
    h.m.forget("live")  # a live job is never forgotten
    assert h.m.job_ids() == ["live"]


def test_a_nonfinite_metric_is_alerted_once_and_halts_when_asked() -> None:
    for mode in ("alert", "halt"):
        h = Harness()
        spec = JobSpec(job_id="a", name="job-a", world_size=2, steps=1000, on_nonfinite=mode)
        h.feed(Submitted, JobSubmission(spec=spec, policy=POLICY))
        h.committed("a", 0, 4)
        for step in (5, 6):
            for rank in (0, 1):
                row = [step, 0.0, 0.01, 0.0, 0.008, 0.0, 0.002, {"loss": float("nan")}]
                h.feed(rank_from_wire, "a",
                       {"kind": "steps", "rank": rank, "generation": 0, "rows": [row]})
        [event] = h.events("a", "nonfinite")
        assert event["metric"] == "loss" and event["value"] == "nan" and event["step"] == 5
        assert event["halting"] is (mode == "halt")
        halts = [c.flags["halt"] for c in h.of(SetControl)]
        if mode == "alert":
            assert halts == [] and h.state("a") == "RUNNING"
            continue
        assert halts == [1] and h.state("a") == "STOPPING"
        h.exit("a", 0, 0, "halted", 7)
        h.exit("a", 0, 1, "halted", 7)
        assert h.state("a") == "FAILED"
        assert h.reason("a") == ("halted at step 7: loss was nan at step 5 on rank 0; the "
                                 "newest committed checkpoint is step 4 (resubmit with "
                                 "resume='latest' to continue from it)")


def test_a_halt_whose_ranks_do_not_end_within_the_stop_grace_is_forced_with_its_cause() -> None:
    """A halt (a NaN metric) ends the job as a stop does, not whenever its ranks please: a
    rank still running ``stop_grace_s`` after the halt was asked for is stopped, its worker
    restarted, and the reason says so."""
    h = Harness()
    spec = JobSpec(job_id="a", name="job-a", world_size=2, steps=1000, on_nonfinite="halt")
    h.feed(Submitted, JobSubmission(spec=spec, policy=POLICY))
    h.committed("a", 0, 4)
    for rank in (0, 1):
        row = [5, 0.0, 0.01, 0.0, 0.008, 0.0, 0.002, {"loss": float("nan")}]
        h.feed(rank_from_wire, "a", {"kind": "steps", "rank": rank, "generation": 0,
                                     "rows": [row]})
    assert h.state("a") == "STOPPING"
    h.exit("a", 0, 1, "halted", 7)  # rank 0 never ends
    assert h.of(Cancel, h.advance(299)) == [] and h.state("a") == "STOPPING"
    out = h.advance(2)
    assert h.of(Cancel, out) == [Cancel("a", 0, (0,))]
    [restart] = h.of(RestartWorkers, out)
    assert "of its halt" in restart.reason and "stop_grace_s (300 s)" in restart.reason
    assert h.state("a") == "FAILED"
    assert h.reason("a") == ("halted at step 7: loss was nan at step 5 on rank 0; rank(s) 0 "
                             "had not ended 300 s after the halt (stop_grace_s), so they "
                             "were stopped and their workers restarted; the newest committed "
                             "checkpoint is step 4 (resubmit with resume='latest' to "
                             "continue from it)")


def test_a_rank_waiting_for_its_checkpoint_writer_is_not_a_hang_culprit() -> None:
    from nbtrain.core.health import hung_ranks

    loop = ['File "/x/nbtrain/runtime/loop.py", line 10, in run', "  step()"]
    writer_wait = [*loop, 'File "/x/nbtrain/runtime/async_ckpt.py", line 215, in wait',
                   "  return fut.result(timeout=timeout)"]
    collective = [*loop, 'File "/x/torch/distributed/distributed_c10d.py", line 2, in all_reduce']
    own = [*loop, 'File "/x/user/train.py", line 3, in step', "  while True: pass"]
    keys = {0: "k0", 1: "k1"}
    assert hung_ranks(keys, {"w0": {"k0": writer_wait}, "w1": {"k1": collective}}) == []
    assert hung_ranks(keys, {"w0": {"k0": own}, "w1": {"k1": collective}}) == [0]


def test_a_rank_waiting_for_its_checkpoint_writer_makes_the_job_slow_not_hung() -> None:
    """Rank 0 waits for its (starved) writer thread to commit the previous checkpoint, rank 1
    waits for rank 0 in the all-reduce: neither stack moves, yet nothing is stuck."""
    h = Harness(workers=2)
    run_to_running(h)
    h.steps("a", 0, 20)
    writer = 'File "/x/nbtrain/runtime/async_ckpt.py", line 215, in wait'
    stacks = {0: writer, 1: WAITING}
    h.advance(3.5)
    h.feed(HangDiagnosed, "a", 0, (), stacks)
    h.advance(2.5)
    out = h.feed(HangDiagnosed, "a", 0, (), stacks)
    assert not h.of(RestartWorkers, out)
    [slow] = h.events("a", "slow")
    assert "slow, not hung" in slow["note"]
    h.steps("a", 0, 21)  # the commit landed, the step finished
    assert h.m.status("a").state == "RUNNING" and not h.m.status("a").faults


@pytest.mark.parametrize(("committed", "restored", "lost"), [
    ((10,), 12, 3),    # 12 committed, and rank 0 died before its message got out
    ((5, 10), 5, 10),  # 10 was unreadable: the ranks fell back to 5
])
def test_the_checkpoint_the_ranks_restore_corrects_the_fault_and_the_goodput(
        committed: tuple[int, ...], restored: int, lost: int) -> None:
    """Rank 0 dies at step 15; the newest commit the controller heard of is 10, so it expects
    the job to resume from 10 (5 steps lost). The ranks restore another step: the fault and
    the job's goodput then both say where the job resumed and what it lost, and the next
    fault resumes from that step."""
    h = Harness()
    h.submit("a", 2)
    h.steps("a", 0, 15)
    for step in committed:
        h.committed("a", 0, step)
    h.fail("a", 0, 0, step=15)
    h.fail("a", 0, 1, peer=True, step=15)
    h.advance(1.0)
    for slot in h.m.slots():
        if slot["state"] == "restarting":
            h.join()
    [fault] = h.m.status("a").faults
    assert (fault["resume_step"], fault["lost_steps"]) == (10, 5)
    assert h.m.status("a").goodput["lost_steps"] == 5
    h.feed(rank_from_wire, "a",
           {"kind": "rank_started", "rank": 0, "generation": 1, "start_step": restored})
    [fault] = h.m.status("a").faults
    assert (fault["resume_step"], fault["lost_steps"]) == (restored, lost)
    assert h.m.status("a").goodput["lost_steps"] == lost
    # The next fault resumes from the step the ranks restored (not from an unreadable newer
    # one) and loses the steps trained since.
    h.steps("a", 1, restored + 4)  # (not at step 15 again: fail_fast would end the job)
    h.fail("a", 1, 0, step=restored + 4)
    h.fail("a", 1, 1, peer=True, step=restored + 4)
    h.advance(1.0)
    second = h.m.status("a").faults[-1]
    assert (second["resume_step"], second["lost_steps"]) == (restored, 4)
    assert h.m.status("a").goodput["lost_steps"] == lost + 4


def test_a_dead_worker_is_the_cause_even_when_a_peers_error_came_first() -> None:
    """The worker of rank 1 is killed; rank 0's DataLoader child goes with the broken job and
    rank 0 reports that before the scheduler notices the worker gone: the fault is the lost
    worker, not rank 0's consequence."""
    h = Harness()
    h.submit("a", 2)
    h.steps("a", 0, 10)
    h.fail("a", 0, 0, error="RuntimeError: DataLoader worker (pid(s) 1) exited unexpectedly")
    [launch] = h.launches("a")
    h.feed(WorkerLeft, launch.addresses[1])
    h.advance(15.0)  # past the failure grace
    fault = h.m.status("a").faults[0]
    assert "left the cluster" in fault["error"], fault
