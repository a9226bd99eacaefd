"""Automatic recovery from crashes, exceptions and hangs on a real cluster (issue: recovery)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import nbtrain
from nbtrain import Fault, JobState
from tests.conftest import wait_for
from tests.recipes import Regression, assert_params_equal, single_process_params

STEPS = 30


def _committed_before(job: nbtrain.JobHandle, generation: int) -> int:
    """The newest step whose checkpoint committed during ``generation`` (0 if none)."""
    steps = [int(e["step"]) for e in job.events
             if e["kind"] == "checkpoint" and e.get("phase") == "committed"
             and e.get("generation") == generation]
    return max(steps, default=0)


@pytest.mark.slow
# Four random kill points; the long campaign (rank SIGKILLs at random moments, in a commit, a
# preemption's grace and a resize) is benchmarks/chaos.py.
@pytest.mark.parametrize("trial", range(4))
def test_sigkill_a_rank_worker_recovers_exactly(free_cluster: nbtrain.Cluster, tmp_path: Path,
                                               trial: int) -> None:
    rng = random.Random(trial)
    rank, step = rng.randrange(2), rng.randrange(3, STEPS - 2)
    job = free_cluster.submit(
        Regression(out_dir=str(tmp_path), step_sleep=0.01), world_size=2, steps=STEPS,
        checkpoint=4, faults=[Fault("kill", rank=rank, step=step)], max_restarts=2)
    assert job.wait(180) is JobState.SUCCEEDED, job.error
    assert job.restarts == 1
    [fault] = job.faults
    assert fault["what"] == "worker died" and fault["rank"] == rank
    assert fault["detect_s"] is not None and fault["detect_s"] >= 0
    # No committed step lost: the restart resumed from the newest checkpoint committed before
    # the kill (the kill can land between a snapshot and its commit, so >= the one before).
    assert fault["resume_step"] >= _committed_before(job, 0)
    assert fault["resume_step"] >= (step - 1) // 4 * 4 - 4
    resumed = [e for e in job.events if e["kind"] == "rank_started" and e["generation"] == 1]
    assert {e["start_step"] for e in resumed} == {fault["resume_step"]}
    assert_params_equal(tmp_path, single_process_params(STEPS))
    recovery = [e for e in job.events if e["kind"] == "recovery"]
    assert len(recovery) == 1 and recovery[0]["recovery_s"] > 0
    g = job.goodput()
    assert g["recovery_s"] > 0 and g["productive_s"] > 0
    assert g["lost_steps"] == fault["lost_steps"]


def test_hang_is_detected_and_recovered(free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    job = free_cluster.submit(
        Regression(out_dir=str(tmp_path), step_sleep=0.01), world_size=2, steps=STEPS,
        checkpoint=5, faults=[Fault("hang", rank=1, step=12)], max_restarts=2)
    assert job.wait(180) is JobState.SUCCEEDED, job.error
    [fault] = job.faults
    assert fault["what"] == "hang" and fault["rank"] == 1  # the stuck rank, not its waiting peer
    assert "no step progress" in fault["error"]
    assert_params_equal(tmp_path, single_process_params(STEPS))


def test_injected_exception_recovers_with_budget(free_cluster: nbtrain.Cluster,
                                                 tmp_path: Path) -> None:
    job = free_cluster.submit(
        Regression(out_dir=str(tmp_path)), world_size=2, steps=STEPS, checkpoint=5,
        faults=[Fault("raise", rank=0, step=9)], max_restarts=2)
    assert job.wait(180) is JobState.SUCCEEDED, job.error
    [fault] = job.faults
    assert fault["what"] == "exception" and "injected exception on rank 0" in fault["error"]
    assert_params_equal(tmp_path, single_process_params(STEPS))


def test_exception_with_no_restarts_fails_with_report(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(), world_size=2, steps=STEPS, checkpoint=5,
                              faults=[Fault("raise", rank=1, step=4)], max_restarts=0)
    assert job.wait(60) is JobState.FAILED
    assert "max_restarts=0" in job.reason and "rank 1" in job.reason
    assert job.error is not None and "InjectedFault" in job.error


def test_budget_exhausted_lists_faults_and_frees_slots(free_cluster: nbtrain.Cluster) -> None:
    # The recipe raises at step 7 in every generation: one restart, then FAILED.
    job = free_cluster.submit(Regression(raise_at=7, raise_rank=1), world_size=2, steps=STEPS,
                              checkpoint=3, max_restarts=1, fail_fast=False)
    assert job.wait(120) is JobState.FAILED
    assert "restart budget spent (max_restarts=1" in job.reason
    assert len(job.faults) == 2
    assert job.error is not None
    assert job.error.count("exception on rank 1 (127.0.0.1) at step 7") == 2
    wait_for(lambda: len(free_cluster.free_slots) == 2, 60, "every slot free")


def test_fail_fast_ends_a_job_that_raises_at_the_same_step_again(
        free_cluster: nbtrain.Cluster) -> None:
    # The default: one retry shows it is the code, not the node; the budget is not spent.
    job = free_cluster.submit(Regression(raise_at=7, raise_rank=1), world_size=2, steps=STEPS,
                              checkpoint=3, max_restarts=3)
    assert job.wait(120) is JobState.FAILED
    assert job.reason.startswith("the same exception twice at step 7 on rank 1"), job.reason
    assert len(job.faults) == 2 and job.restarts == 1
    wait_for(lambda: len(free_cluster.free_slots) == 2, 60, "every slot free")


def test_inject_slow_at_runtime_and_clear(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.005), world_size=2, steps=1_000_000)
    wait_for(lambda: job.step >= 10, 120, "training")
    job.inject("slow", rank=1, factor=3.0)
    wait_for(lambda: any(e["kind"] == "fault_injected" for e in job.events), 60,
             "the slow fault to fire")
    fired_at = next(int(e["step"]) for e in job.events if e["kind"] == "fault_injected")
    wait_for(lambda: job.step >= fired_at + 30, 120, "steps after the slowdown")
    m = job.metrics
    after = m[m["step"] > fired_at + 5]
    by_rank = after.groupby("rank")[["compute_s", "comm_s"]].median()
    # The slowed rank computes longer; its peer waits for it in the all-reduce.
    assert by_rank.loc[1, "compute_s"] > by_rank.loc[0, "compute_s"]
    assert by_rank.loc[0, "comm_s"] > by_rank.loc[1, "comm_s"]
    job.stop()
    assert job.wait(60) is JobState.CANCELLED
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1, got 5"):
        job.inject("kill", rank=5)
