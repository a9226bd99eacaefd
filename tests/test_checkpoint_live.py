"""Checkpoints, resume and preempt/resume on a real cluster with real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

import nbtrain
from nbtrain import Fault, JobState
from tests.conftest import wait_for
from tests.recipes import Regression, assert_params_equal, single_process_params


def test_resume_continues_exactly(free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    """run N, stop, resume, run N == run 2N (float64, 1e-6): model, momentum, data position."""
    n = 13  # not a multiple of the 8-step epoch: the data cursor sits mid-epoch
    (tmp_path / "a").mkdir()
    first = free_cluster.submit(Regression(out_dir=str(tmp_path / "a")), world_size=2,
                                steps=n, name="resume-me", checkpoint=None)
    assert first.wait(120) is JobState.SUCCEEDED, first.error
    saved = first.checkpoints
    assert [c["step"] for c in saved] == [n]  # the checkpoint taken at the end
    (tmp_path / "b").mkdir()
    second = free_cluster.submit(Regression(out_dir=str(tmp_path / "b")), world_size=2,
                                 steps=2 * n, name="resume-me", resume="latest")
    assert second.wait(120) is JobState.SUCCEEDED, second.error
    started = [e for e in second.events if e["kind"] == "rank_started"]
    assert {e["start_step"] for e in started} == {n}
    assert second.metrics["step"].min() == n + 1  # no step was recomputed
    assert_params_equal(tmp_path / "b", single_process_params(2 * n))


def test_resume_from_explicit_step_url(free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    first = free_cluster.submit(Regression(), world_size=2, steps=12, name="explicit",
                                checkpoint=4)
    assert first.wait(120) is JobState.SUCCEEDED, first.error
    steps = [c["step"] for c in first.checkpoints]
    assert steps == [12, 8, 4][: len(steps)] and 12 in steps
    url = next(c["url"] for c in first.checkpoints if c["step"] == 8)
    (tmp_path / "out").mkdir()
    again = free_cluster.submit(Regression(out_dir=str(tmp_path / "out")), world_size=2,
                                steps=20, name="explicit-2", resume=url)
    assert again.wait(120) is JobState.SUCCEEDED, again.error
    assert again.metrics["step"].min() == 9
    assert_params_equal(tmp_path / "out", single_process_params(20))


def test_a_resume_source_deleted_while_the_job_waits_is_an_error_not_a_fresh_start(
        free_cluster: nbtrain.Cluster) -> None:
    """It used to start silently at step 0."""
    import shutil

    first = free_cluster.submit(Regression(), world_size=2, steps=8, name="gone-source",
                                checkpoint=4)
    assert first.wait(120) is JobState.SUCCEEDED, first.error
    blocker = free_cluster.submit(Regression(step_sleep=0.02), world_size=2, steps=10**6,
                                  name="blocker", checkpoint=None)
    wait_for(lambda: blocker.status is JobState.RUNNING, 120, "the blocker to run")
    waiting = free_cluster.submit(Regression(), world_size=2, steps=20, name="gone-2",
                                  resume=first.checkpoint_dir, max_restarts=0)
    assert waiting.status is JobState.QUEUED
    shutil.rmtree(first.checkpoint_dir)
    blocker.stop()
    assert waiting.wait(180) is JobState.FAILED
    assert "held a committed checkpoint when the job was submitted but holds none now" in (
        waiting.error or ""), waiting.error
    assert not len(waiting.metrics) and blocker.wait(60) is JobState.CANCELLED


def test_storage_that_not_every_rank_sees_fails_at_once_naming_who_saw_what(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    """A ``memory://`` root is one per process, as a local path is one per host: each rank
    writes where the others cannot see. The job used to train and then wait out every
    commit's 300 s timeout; now its first generation fails at once, saying why."""
    with nbtrain.connect(free_cluster.address, settings=nbtrain.Settings.load(
            checkpoint_root="memory://per-process", token_file="")) as own:
        job = own.submit(Regression(), world_size=2, steps=50, name="unshared",
                         checkpoint=10, max_restarts=0)
        assert job.wait(120) is JobState.FAILED
        error = job.error or ""
    assert "do not share the checkpoint storage memory://per-process" in error, error
    assert "does not see the files of ranks" in error and "object store URL" in error
    assert len(free_cluster.free_slots) == 2


def test_a_stop_whose_rank_hangs_ends_after_its_grace_saying_so(
        free_cluster: nbtrain.Cluster) -> None:
    """A stop waits for the ranks' final checkpoint, not forever: with rank 1 hung (and the
    hang watchdog set out of reach) the job ends CANCELLED ``stop_grace_s`` after the stop,
    its stuck ranks stopped and their workers restarted, and the reason says which and why."""
    settings = nbtrain.Settings.load(token_file="", hang_floor_s=3600.0,
                                     checkpoint_commit_timeout_s=2.0, stop_grace_s=5.0)
    with nbtrain.connect(free_cluster.address, settings=settings) as own:
        job = own.submit(Regression(step_sleep=0.01), world_size=2, steps=10**6,
                         checkpoint=None, name="hung-stop", faults=[Fault("hang", rank=1,
                                                                           step=6)])
        wait_for(lambda: any(e["kind"] == "fault_injected" for e in job.events), 120,
                 "rank 1 hanging as step 6 starts (rank 0 then waits for it)")
        job.stop()
        assert job.wait(120) is JobState.CANCELLED
        reason = job.reason
    assert reason.startswith("stopped by user at step "), reason
    assert "rank(s) 0, 1 had not ended 5 s after the stop request (stop_grace_s)" in reason
    assert "their workers restarted" in reason


def test_preempt_then_resume_matches_uninterrupted(free_cluster: nbtrain.Cluster,
                                                   tmp_path: Path) -> None:
    steps = 60
    job = free_cluster.submit(Regression(out_dir=str(tmp_path), step_sleep=0.02),
                              world_size=2, steps=steps, checkpoint=None)
    wait_for(lambda: job.step >= 10, 120, "training progress")
    job.preempt()
    wait_for(lambda: job.status is JobState.PREEMPTED, 60, "PREEMPTED")
    assert "checkpointed at step" in job.reason
    at = int(job.reason.split("checkpointed at step ")[1].split()[0])
    assert 10 <= at < steps
    assert job.checkpoints[0]["step"] == at  # committed before the slots were released
    wait_for(lambda: len(free_cluster.free_slots) == 2, 30, "slots released")
    job.resume()
    assert job.wait(180) is JobState.SUCCEEDED, job.error
    assert job.generation == 1
    resumed = [e for e in job.events if e["kind"] == "rank_started" and e["generation"] == 1]
    assert {e["start_step"] for e in resumed} == {at}  # no committed step lost
    assert_params_equal(tmp_path, single_process_params(steps))


def test_checkpoint_now_and_events(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.01), world_size=2, steps=1_000_000,
                              checkpoint=None)
    try:
        wait_for(lambda: job.step >= 5, 120, "training progress")
        job.checkpoint()
        wait_for(lambda: len(job.checkpoints) == 1, 60, "an on-demand checkpoint to commit")

        def phases() -> set[str]:
            return {e["phase"] for e in job.events if e["kind"] == "checkpoint"}

        # The files are on disk first; the events follow over the event stream.
        wait_for(lambda: {"snapshot", "persisted", "committed"} <= phases(), 30,
                 "the checkpoint's events")
        snap = next(e for e in job.events
                    if e["kind"] == "checkpoint" and e["phase"] == "snapshot")
        assert snap["bytes"] > 0 and snap["blocking_ms"] >= 0
    finally:
        job.stop()
    assert job.wait(60) is JobState.CANCELLED
    assert len(job.checkpoints) == 2  # plus the one taken at stop


def test_resume_with_nothing_to_resume_is_a_clear_error(free_cluster: nbtrain.Cluster,
                                                        tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"does not hold a committed checkpoint \(committed "
                                         r"steps: none\)"):
        free_cluster.submit(Regression(), world_size=2, steps=5, resume=str(tmp_path))
