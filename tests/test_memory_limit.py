"""A rank killed by Dask's per-worker memory limit is a fault whose cause says so."""

from __future__ import annotations

import nbtrain
from nbtrain import JobState
from tests.recipes import memory_hog_train


def test_a_rank_killed_for_memory_names_the_limit_and_the_fix() -> None:
    with nbtrain.connect(n_workers=1, gpus=False, memory_limit="800MiB") as cluster:
        assert "memory_limit=0.8GiB" in repr(cluster)
        assert "memory limit per worker 0.8GiB" in cluster._repr_html_()
        job = cluster.submit(memory_hog_train, world_size=1, steps=1000, max_restarts=0,
                             config={"mb": 64, "step_sleep": 0.1}, checkpoint=None)
        assert job.wait(120) is JobState.FAILED
        [fault] = job.faults
        assert "Dask's nanny killed worker" in fault["cause"], fault
        assert "memory limit 0.78 GiB" in fault["cause"]
        assert "give each worker more memory" in fault["cause"]
