"""nbtrain on a Dask cluster manager: ``connect(LocalCluster(...))``, scaling from nbtrain's
queue (:class:`nbtrain.engine.adaptive.QueueAdaptive`), retirement as a preemption."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import LocalCluster

import nbtrain
from nbtrain import JobState
from tests.conftest import wait_for
from tests.recipes import Regression, assert_params_equal, single_process_params


@pytest.fixture
def manager() -> Iterator[LocalCluster]:
    """An empty LocalCluster of worker processes, as a user would make one."""
    lc = LocalCluster(n_workers=0, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0", silence_logs=40)
    yield lc
    lc.close()


def test_connect_takes_a_cluster_manager_and_scales_from_the_queue(
        manager: LocalCluster, tmp_path: Path) -> None:
    with nbtrain.connect(manager) as cluster:
        assert cluster.manager is manager and len(cluster.slots) == 0
        adaptive = cluster.adapt(minimum=0, maximum=3, idle_s=0.5, interval="100ms",
                                 wait_count=2)
        # From 0 workers: a 2-rank gang (A) and a 1-rank job (C) are asked for whole; B (2
        # ranks) does not fit beside them under maximum=3 and waits.
        a = cluster.submit(Regression(step_sleep=0.05), world_size=2, steps=100_000,
                           name="a", checkpoint=None)
        c = cluster.submit(Regression(), world_size=1, steps=5, name="c", checkpoint=None)
        b = cluster.submit(Regression(out_dir=str(tmp_path)), world_size=2, steps=8,
                           name="b", checkpoint=None)
        assert c.wait(90) is JobState.SUCCEEDED, c.error
        wait_for(lambda: a.status is JobState.RUNNING, 90, "A running")
        # C's slot is free now and B waits for one of A's: the free slot is reserved for B
        # and stays while Dask's adapt looks again and again.
        wait_for(lambda: adaptive.last.get("reserved") == 1, 30, "B's reserved slot")
        seen = adaptive.rounds
        wait_for(lambda: adaptive.rounds >= seen + 10, 30, "ten more adapt rounds")
        assert len(manager.scheduler_info["workers"]) == 3
        assert b.status is JobState.QUEUED
        a.stop()
        assert b.wait(90) is JobState.SUCCEEDED, b.error
        assert_params_equal(tmp_path, single_process_params(8))
        # Nothing queued or running: every slot retires after idle_s.
        wait_for(lambda: len(manager.scheduler_info["workers"]) == 0, 60, "retired to 0")
        assert all(j.status is not JobState.FAILED for j in (a, b, c))
        adaptive.stop()


def test_scale_and_adapt_say_where_they_cannot() -> None:
    from distributed import Client

    lc = LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None, silence_logs=40)
    try:
        with Client(lc, set_as_default=False) as client, nbtrain.connect(client) as cluster:
            with pytest.raises(RuntimeError, match="connect\\(SLURMCluster"):
                cluster.scale(2)
            with pytest.raises(RuntimeError, match="cluster manager"):
                cluster.adapt(maximum=2)
    finally:
        lc.close()
    with pytest.raises(TypeError, match=r"distributed\.deploy\.Cluster"):
        nbtrain.connect(42)  # type: ignore[arg-type]


def test_a_retired_worker_moves_its_job_checkpoint_first(tmp_path: Path) -> None:
    """``retire_workers`` on a rank's worker (what a cluster manager scaling down, Dask's
    ``lifetime`` and a SIGTERM'd ``dask worker`` all call) is a preemption: the job
    checkpoints, moves to the other slots and ends with an uninterrupted run's parameters;
    no committed step is lost, no restart charged."""
    lc = LocalCluster(n_workers=3, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0", silence_logs=40)
    try:
        with nbtrain.connect(lc) as cluster:
            steps = 40
            job = cluster.submit(Regression(out_dir=str(tmp_path), step_sleep=0.02),
                                 world_size=2, steps=steps, checkpoint=4)
            wait_for(lambda: job.step >= 8, 90, "step 8")
            leaving = job.slots[1]
            retired = cluster.client.retire_workers([leaving])  # returns once it has gone
            assert list(retired) == [leaving]
            assert job.wait(90) is JobState.SUCCEEDED, job.error
            assert job.restarts == 0 and not job.faults
            [pre] = [e for e in job.events if e["kind"] == "preemption"]
            assert pre["cause"] == "leaving" and pre["lost_steps"] == 0, pre
            assert "retire" in pre["reason"] and not pre["forced"]
            started = [e for e in job.events if e["kind"] == "rank_started"
                       and e["generation"] == 1]
            assert {e["start_step"] for e in started} == {pre["step"]}
            assert leaving not in {e.get("address") for e in started}
            assert_params_equal(tmp_path, single_process_params(steps))
    finally:
        lc.close()


def test_a_sigterm_to_a_dask_worker_moves_its_job_checkpoint_first(tmp_path: Path) -> None:
    """``dask worker`` processes, as a pod or a batch job runs them: a SIGTERM to the one
    under rank 1 (a pod being stopped, ``scancel``) retires its worker (nbtrain's nanny
    plugin) instead of killing it, so the job checkpoints, moves to the spare and ends with an
    uninterrupted run's parameters, with no fault."""
    import os
    import signal

    from nbtrain.engine.standalone import standalone_cluster

    with standalone_cluster(0, logs=tmp_path / "logs") as sc:
        procs = {name: sc.add_workers(1, name=name) for name in ("a", "b", "c")}
        with nbtrain.connect(sc.address) as cluster:
            wait_for(lambda: len(cluster.free_slots) == 3, 120, "three slots")
            steps = 40
            job = cluster.submit(Regression(out_dir=str(tmp_path), step_sleep=0.02),
                                 world_size=2, steps=steps, checkpoint=4)
            wait_for(lambda: job.step >= 8, 90, "step 8")
            leaving = job.slots[1]
            name = cluster.client.scheduler_info()["workers"][leaving]["name"]
            os.kill(procs[str(name)].pid, signal.SIGTERM)
            assert job.wait(120) is JobState.SUCCEEDED, job.error
            assert job.restarts == 0 and not job.faults, job.faults
            [pre] = [e for e in job.events if e["kind"] == "preemption"]
            assert pre["cause"] == "leaving" and pre["lost_steps"] == 0, pre
            started = [e for e in job.events if e["kind"] == "rank_started"
                       and e["generation"] == 1]
            assert {e["start_step"] for e in started} == {pre["step"]}
            assert leaving not in {e.get("address") for e in started}
            assert_params_equal(tmp_path, single_process_params(steps))

