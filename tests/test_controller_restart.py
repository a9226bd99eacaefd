"""The controller survives its own death: SIGKILL the scheduler of a supervised standalone
cluster (``nbtrain cluster``'s supervision) and every job comes back from the journal.

Real processes throughout: ``dask scheduler --preload nbtrain.engine.preload``, ``dask worker``
processes that Dask ends with their scheduler and the supervisor starts again, torch gloo
ranks, and a client that follows through the outage.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import nbtrain
from nbtrain import JobState, Settings
from nbtrain.engine.standalone import standalone_cluster
from tests.conftest import wait_for
from tests.recipes import Regression, assert_params_equal, single_process_params


def _connect(address: str, token_file: Path) -> nbtrain.Cluster:
    return nbtrain.connect(address, settings=Settings.load(token_file=str(token_file)))


def _faults(job: nbtrain.JobHandle) -> list[str]:
    return [f["what"] for f in job.faults]


@pytest.mark.slow
def test_scheduler_killed_while_training_the_job_resumes_exactly(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with standalone_cluster(2, logs=tmp_path / "logs", supervise=True) as cc, \
            _connect(cc.address, tmp_path / "tokens.json") as c:
        job = c.submit(Regression(out_dir=str(out), step_sleep=0.02), world_size=2, steps=200,
                       checkpoint=10, name="durable")
        wait_for(lambda: job.step >= 60, 180, "the job training")
        killed = time.time()
        cc.kill_scheduler()
        wait_for(lambda: job.unreachable_since is not None, 30, "the handle noticing")
        assert "controller unreachable since" in job.reason
        assert "controller unreachable" in repr(job)
        assert job.wait(300) is JobState.SUCCEEDED, job.reason
        assert job.unreachable_since is None
        assert "controller" in _faults(job), job.faults
        [restart] = [f for f in job.faults if f["what"] == "controller"]
        assert restart["resume_step"] >= 60 - 10 and restart["time"] >= killed - 1
        assert job.restarts == 0, "a controller restart is charged to no restart budget"
        assert job.generation >= 1, "the resumed generation is numbered above the old one"
        assert_params_equal(out, single_process_params(200))
        # The owner (this handle's token) still steers; a stranger cannot.
        other = _connect(cc.address, tmp_path / "stranger.json")
        with other:
            seen = other.job("durable")
            assert seen.status is JobState.SUCCEEDED and seen.id == job.id
