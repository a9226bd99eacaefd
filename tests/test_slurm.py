"""nbtrain on a real Slurm (issue 27, item 4): Debian's ``slurm-wlm`` runs ``slurmctld`` and
``slurmd`` on this machine; dask-jobqueue's ``SLURMCluster`` starts every worker as a batch
job. From an empty cluster a queued 2-rank job makes nbtrain's adaptive policy ask Slurm for
two workers; one of them has a lifetime (dask-jobqueue's ``--lifetime``, the walltime's
stand-in that Dask acts on) that ends mid-job: the job checkpoints, moves to the surviving
worker and a new one Slurm starts, and ends with an uninterrupted run's parameters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import nbtrain
from nbtrain import JobState
from tests.conftest import wait_for
from tests.recipes import Regression, assert_params_equal, single_process_params
from tests.slurm_local import LocalSlurm, SlurmMissing, slurm_cluster

jobqueue = pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is not installed "
                               "(pip install -e '.[dev]')")

#: The one worker's lifetime: long enough for the job to have started on it.
LIFETIME = "20s"


@pytest.fixture
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    try:
        s = LocalSlurm.start(tmp_path_factory.mktemp("slurm"))
    except SlurmMissing as exc:
        pytest.skip(f"no Slurm here: {exc}")
    yield s
    s.stop()


def test_slurm_scales_from_zero_and_a_walltime_is_a_preemption(
        slurm: LocalSlurm, tmp_path: Path) -> None:
    lifetime = tmp_path / "lifetime"
    lifetime.write_text(LIFETIME)
    fast = tmp_path / "fast"  # the recipe steps slowly until the walltime was seen
    steps = 600
    manager = slurm_cluster(tmp_path, lifetime)
    try:
        with nbtrain.connect(manager) as cluster:  # type: ignore[arg-type]
            assert cluster.slots == [] and slurm.jobs() == []
            adaptive = cluster.adapt(minimum=0, maximum=3, idle_s=1.0, interval="200ms",
                                     wait_count=2)
            job = cluster.submit(
                Regression(out_dir=str(tmp_path), step_sleep=0.05, slow_until=str(fast)),
                world_size=2, steps=steps, checkpoint=10)
            # Slurm is asked for exactly the gang: two batch jobs.
            wait_for(lambda: len(slurm.jobs()) == 2, 30, "two Slurm jobs for the gang")
            wait_for(lambda: any(e["kind"] == "preemption" for e in job.events), 120,
                     "the walltime's preemption")
            fast.touch()
            assert job.wait(120) is JobState.SUCCEEDED, job.error
            [pre] = [e for e in job.events if e["kind"] == "preemption"]
            assert pre["cause"] == "leaving" and "lifetime" in pre["reason"], pre
            assert pre["lost_steps"] == 0 and not pre["forced"], pre
            assert 0 < pre["step"] < steps
            assert job.restarts == 0 and not job.faults
            started = {e["generation"]: e["start_step"] for e in job.events
                       if e["kind"] == "rank_started"}
            assert started == {0: 0, 1: pre["step"]}
            assert_params_equal(tmp_path, single_process_params(steps))
            # The walltime worker's batch job ended; a third one replaced it.
            assert lifetime.exists() is False
            assert adaptive.rounds > 0
            wait_for(lambda: not manager.scheduler_info["workers"], 60,  # type: ignore[attr-defined]
                     "idle workers retired")
            adaptive.stop()
    finally:
        manager.close()  # type: ignore[attr-defined]
