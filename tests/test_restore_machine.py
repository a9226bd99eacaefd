"""A restarted controller's machine continues the jobs an earlier one ran (pure, hand clock).

The engine journals ``JobMachine.carry(job_id)`` and resubmits live jobs with it; these tests
feed a first machine, carry its jobs over to a fresh one and check what the fresh one does.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from nbtrain.core.faults import Fault
from nbtrain.core.job import JobSpec
from nbtrain.core.lifecycle_types import JobSubmission, Launch, Rejected, Submitted
from nbtrain.core.machine_events import request_from_wire
from nbtrain.engine.controller import _carried_from
from nbtrain.engine.wire import plain
from tests.test_lifecycle import POLICY, Harness


def _spec(job_id: str, world_size: int = 2, **kw: object) -> JobSpec:
    return JobSpec(job_id=job_id, name=f"job-{job_id}", world_size=world_size, steps=1000,
                   **kw)  # type: ignore[arg-type]


def carry_over(old: Harness, job_ids: list[str], *, workers: int = 2) -> Harness:
    """A fresh machine (its workers joining after the jobs were restored, as after a real
    restart) fed each job's submission with what ``old`` knew of it, as journaled."""
    new = Harness(workers=0)
    new.t = old.t + 30.0
    for jid in job_ids:
        # Through the journal's path: plain JSON written, read back by the engine.
        journaled = json.loads(json.dumps(plain(old.m.carry(jid))))
        sub = replace(old.m._jobs[jid].sub, carried=_carried_from(journaled))
        new.feed(Submitted, sub)
    for i in range(workers):
        new.join(host=f"h{i}")
    return new


def test_running_job_resumes_with_history_and_a_fenced_generation() -> None:
    h = Harness()
    h.submit("a", max_restarts=1)
    h.steps("a", 0, 30)
    h.committed("a", 0, 20)
    h.fail("a", 0, 1, step=30)  # one restart charged to the budget
    h.fail("a", 0, 0, peer=True, step=30)
    h.advance(1.0)
    assert h.launches("a")[-1].generation == 1
    h.steps("a", 1, 40)
    h.committed("a", 1, 40)
    assert h.state("a") == "RUNNING"

    n = carry_over(h, ["a"])
    launch = n.launches("a")
    assert [c.generation for c in launch] == [2], "the next generation is above every old one"
    status = n.m.status("a")
    assert status.state == "STARTING"
    assert status.restarts == 1, "the old restart still counts; the controller's does not"
    whats = [f["what"] for f in status.faults]
    assert whats[-1] == "controller" and len(whats) == 2
    assert status.faults[-1]["resume_step"] == 40
    assert "controller restarted" in status.reason or "recovering" in status.reason
    # The budget was max_restarts=1 and is spent by the old failure: a new failure now
    # ends the job, which proves the restart itself charged nothing and the old one carried.
    n.fail("a", 2, 0, step=45)
    n.fail("a", 2, 1, peer=True, step=45)
    n.advance(1.0)
    assert n.state("a") == "FAILED"


def test_queued_jobs_keep_their_order_and_held_jobs_stay_held() -> None:
    h = Harness(workers=2)
    h.submit("run")
    for jid in ("q1", "q2", "q3"):
        h.submit(jid)
    h.feed(request_from_wire, "q2", "preempt")  # held while queued
    assert h.state("q2") == "PREEMPTED"
    n = carry_over(h, ["run", "q1", "q2", "q3"])
    assert [c.job_id for c in n.of(Launch)] == ["run"]
    assert n.state("q1") == "QUEUED" and n.state("q3") == "QUEUED"
    assert n.state("q2") == "PREEMPTED"
    # run ends: q1 starts (not q3, not the held q2)
    n.steps("run", 1, 1000)
    for r in (0, 1):
        n.exit("run", 1, r)
    n.advance(1.0)
    assert [c.job_id for c in n.of(Launch)] == ["run", "q1"]
    n.feed(request_from_wire, "q2", "resume")
    assert n.state("q2") == "QUEUED"
    for done in ("q1", "q3"):
        n.steps(done, 0, 1000)
        for r in (0, 1):
            n.exit(done, 0, r)
        n.advance(1.0)
    # A job held across a restart re-enters the queue when it is resumed (behind q3).
    assert [c.job_id for c in n.of(Launch)] == ["run", "q1", "q3", "q2"]


def test_a_held_job_can_be_stopped_and_a_queue_false_job_is_not_rejected() -> None:
    h = Harness(workers=2)
    h.submit("busy")
    h.feed(Submitted, JobSubmission(spec=_spec("held"), policy=POLICY))
    h.feed(request_from_wire, "held", "preempt")
    h.feed(Submitted, JobSubmission(spec=_spec("strict", 2, queue=False), policy=POLICY))
    n = Harness(workers=0)
    for jid in ("busy", "held"):
        n.feed(Submitted, replace(h.m._jobs[jid].sub, carried=h.m.carry(jid)))
    assert not n.of(Rejected)
    n.feed(request_from_wire, "held", "stop")
    assert n.state("held") == "CANCELLED"


def test_one_shot_faults_that_fired_do_not_fire_again() -> None:
    h = Harness()
    fault = Fault(kind="raise", rank=1, step=5)
    h.submit("f", faults=[fault])
    h.steps("f", 0, 5)
    h.fail("f", 0, 1, step=5)
    h.fail("f", 0, 0, peer=True, step=5)
    h.advance(1.0)
    assert h.launches("f")[-1].faults == ()
    n = carry_over(h, ["f"])
    assert n.launches("f")[-1].faults == ()


def test_a_controller_error_fails_only_its_job() -> None:
    from nbtrain.core.lifecycle_types import ControllerFailed, EndGeneration, RestartWorkers

    h = Harness(workers=4)
    h.submit("bad")
    h.submit("good")
    h.steps("bad", 0, 10)
    h.steps("good", 0, 10, ranks=(0, 1))
    out = h.feed(ControllerFailed, "bad", "Traceback ...\nValueError: boom")
    assert h.state("bad") == "FAILED"
    assert "ValueError: boom" in h.reason("bad")
    assert h.m.status("bad").error and "Traceback" in h.m.status("bad").error
    assert [c.generation for c in h.of(EndGeneration, out) if c.job_id == "bad"] == [0]
    assert h.of(RestartWorkers, out), "the bad job's ranks are stopped"
    assert h.state("good") == "RUNNING"
    h.submit("next")
    h.advance(1.0)
    assert h.state("next") == "QUEUED", "the failed job's slots wait for their workers"


def test_an_elastic_job_restarts_at_the_size_its_user_asked_for() -> None:
    h = Harness(workers=2)
    h.feed(Submitted, JobSubmission(spec=_spec("el", 2, min_size=1, max_size=2),
                                    policy=POLICY))
    h.steps("el", 0, 10)
    h.feed(request_from_wire, "el", "resize", {"size": 1})
    n = carry_over(h, ["el"])
    [launch] = n.launches("el")
    assert len(launch.addresses) == 1


def test_requests_are_judged_by_the_machine() -> None:
    """Resume only a PREEMPTED job; inject only into a rank the job has (a grown elastic job's
    new ranks included, the size it runs at when running)."""
    h = Harness(workers=3)
    h.feed(Submitted, JobSubmission(spec=_spec("el", 2, min_size=1, max_size=3),
                                    policy=POLICY))
    out = h.feed(request_from_wire, "el", "resume")
    assert [c.reason for c in h.of(Rejected, out)] == [
        "job job-el is STARTING: only a PREEMPTED job can resume(); to continue an ended job "
        "submit it again with resume='latest'"]
    out = h.feed(request_from_wire, "el", "inject", Fault(kind="raise", rank=2))
    assert [c.reason for c in h.of(Rejected, out)] == ["rank must be in 0..1, got 2"]
    h.steps("el", 0, 5)
    h.feed(request_from_wire, "el", "resize", {"size": 3})
    h.steps("el", 0, 6)
    h.committed("el", 0, 6)
    for r in (0, 1):
        h.exit("el", 0, r, outcome="preempted", step=6)
    h.advance(1.0)
    assert len(h.launches("el")[-1].addresses) == 3
    out = h.feed(request_from_wire, "el", "inject", Fault(kind="raise", rank=2))
    assert not h.of(Rejected, out), "rank 2 of the grown job is a real rank"


def test_a_job_stopping_when_the_controller_restarts_ends_instead_of_training_on() -> None:
    """The user's stop is part of what is carried: a restarted controller ends the job at its
    newest committed checkpoint instead of queueing it to train again."""
    h = Harness()
    h.submit("a")
    h.steps("a", 0, 30)
    h.committed("a", 0, 20)
    h.feed(request_from_wire, "a", "stop")
    assert h.state("a") == "STOPPING"

    n = carry_over(h, ["a"])
    assert n.launches("a") == []
    assert n.state("a") == "CANCELLED"
    assert n.reason("a") == ("stopped by user at step 20: the controller restarted while it "
                             "was stopping, so it ends at its newest committed checkpoint")
    n.submit("b")  # the cluster is free for others
    assert len(n.launches("b")) == 1


def test_the_goodput_continues_from_the_journal_and_agrees_with_the_restart_fault() -> None:
    """Steps 1-30 of 0.01 s trained over 10 s, 20 committed, journaled; back 30 s later: the
    job's goodput goes on from the old totals (not from 0), the 30 s down are recovery, and
    the ledger and the controller's fault both count steps 21-30 as lost."""
    h = Harness()
    h.submit("a")
    h.advance(1.0)
    h.steps("a", 0, 10)
    h.advance(9.0)
    h.steps("a", 0, 30)
    h.committed("a", 0, 20)
    before = h.m.status("a").goodput
    assert before["productive_s"] > 0 and before["lost_steps"] == 0
    n = carry_over(h, ["a"])
    after = n.m.status("a").goodput
    assert after["wall_s"] == pytest.approx(before["wall_s"] + 30.0)
    assert after["recovery_s"] == pytest.approx(before["recovery_s"] + 30.0)
    assert after["queued_s"] == pytest.approx(before["queued_s"])
    assert after["startup_s"] == pytest.approx(before["startup_s"])
    assert after["lost_steps"] == 10 and after["lost_s"] == pytest.approx(0.1)
    assert after["productive_s"] == pytest.approx(before["productive_s"] - 0.1)
    [restart] = [f for f in n.m.status("a").faults if f["what"] == "controller"]
    assert restart["lost_steps"] == 10 and restart["resume_step"] == 20
