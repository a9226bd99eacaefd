"""Runtime foundation on a real LocalCluster with real gloo ranks."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import nbtrain
from nbtrain import JobState
from nbtrain.runtime.events import RANK_TOPIC
from tests.conftest import wait_for
from tests.engine_probe import live_job_objects, parent_command_line, tracked_train
from tests.recipes import Regression, assert_params_equal, single_process_params


def test_ddp_world_size_2_matches_single_process(free_cluster: nbtrain.Cluster,
                                                 tmp_path: Path) -> None:
    steps = 30  # > one epoch (256 samples / 32 per step = 8 steps): crosses epoch boundaries
    job = free_cluster.submit(Regression(out_dir=str(tmp_path)), world_size=2, steps=steps)
    assert job.wait(120) is JobState.SUCCEEDED, job.error
    assert_params_equal(tmp_path, single_process_params(steps))
    m = job.metrics
    assert sorted(m["rank"].unique()) == [0, 1]
    assert m.groupby("rank")["step"].max().tolist() == [steps, steps]
    assert {"data_s", "compute_s", "comm_s", "opt_s", "loss"} <= set(m.columns)
    assert (m["opt_s"] > 0).all() and (m["compute_s"] > 0).all()
    assert job.reason == f"completed {steps} steps"


def test_a_finished_job_leaves_no_model_or_process_group_on_its_workers(
        free_cluster: nbtrain.Cluster) -> None:
    # The rank's context and its driver refer to each other, so without a collection when
    # the rank ends its model, optimizer and process group (gloo threads, rank 0's store)
    # lived on in the worker until some later full collection.
    job = free_cluster.submit(tracked_train, world_size=2, steps=3, checkpoint=None)
    assert job.wait(120) is JobState.SUCCEEDED, job.error
    left = free_cluster.client.run(live_job_objects)
    assert len(left) == 2 and set(left.values()) == {0}, left


def test_submit_returns_before_ranks_start(free_cluster: nbtrain.Cluster,
                                           tmp_path: Path) -> None:
    # The ranks' setup blocks until a file exists, and only this test creates it after
    # submit() has returned: if submit waited for the ranks, this test would hang.
    gate = tmp_path / "go"
    job = free_cluster.submit(Regression(wait_file=str(gate)), world_size=2, steps=5)
    assert job.status in (JobState.QUEUED, JobState.STARTING)
    assert job.step == 0 and job.metrics.empty
    gate.touch()
    assert job.wait(120) is JobState.SUCCEEDED, job.error


def test_exception_on_one_rank_fails_job_and_frees_slots(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(raise_at=7, raise_rank=1), world_size=2, steps=10_000,
                              max_restarts=0)
    assert job.wait(60) is JobState.FAILED
    assert "rank 1" in job.reason and "step 7" in job.reason
    assert job.error is not None
    assert "injected failure at step 7" in job.error
    assert "Traceback" in job.error and "in step" in job.error
    kinds = [e["kind"] for e in job.events]
    assert "rank_failed" in kinds
    # The other rank did not sit in a collective: the generation ended, slots are free now.
    wait_for(lambda: len(free_cluster.free_slots) == 2, 30, "slots released")
    follow_up = free_cluster.submit(Regression(), world_size=2, steps=5)
    assert follow_up.wait(120) is JobState.SUCCEEDED, follow_up.error


def test_stop_mid_run_ends_at_step_boundary(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.005), world_size=2, steps=1_000_000)
    wait_for(lambda: job.step >= 5, 120, "training progress")
    assert job.status is JobState.RUNNING
    job.stop()
    assert job.wait(60) is JobState.CANCELLED
    assert job.reason.startswith("stopped by user at step")
    final = int(job.reason.rsplit(" ", 1)[1])
    m = job.metrics
    # Both ranks stopped after the same step: a step boundary, not mid-collective.
    assert m.groupby("rank")["step"].max().tolist() == [final, final]
    assert 5 <= final < 1_000_000


def test_stop_while_queued_cancels(free_cluster: nbtrain.Cluster) -> None:
    blocker = free_cluster.submit(Regression(step_sleep=0.005), world_size=2, steps=1_000_000)
    waiting = free_cluster.submit(Regression(), world_size=2, steps=5)
    wait_for(lambda: blocker.status is JobState.RUNNING, 120, "blocker running")
    assert waiting.status is JobState.QUEUED
    assert "needs 2 slots at once; 0 of 2 free" in waiting.reason
    waiting.stop()
    assert waiting.wait(10) is JobState.CANCELLED
    blocker.stop()
    assert blocker.wait(60) is JobState.CANCELLED


def test_invalid_sizes_raise_with_values(free_cluster: nbtrain.Cluster) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        free_cluster.submit(Regression(), world_size=0, steps=5)
    with pytest.raises(ValueError, match=r"steps must be a positive integer .*got -3"):
        free_cluster.submit(Regression(), world_size=1, steps=-3)
    with pytest.raises(ValueError, match=r"a Recipe job needs steps=N"):
        free_cluster.submit(Regression(), world_size=1)
    with pytest.raises(TypeError, match=r"a training function .* or an nbtrain\.Recipe"):
        free_cluster.submit(object(), world_size=1, steps=1)


def test_unpicklable_recipe_fails_before_launch(free_cluster: nbtrain.Cluster) -> None:
    recipe = Regression()
    recipe.lock = threading.Lock()  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"cannot be pickled.*lock"):
        free_cluster.submit(recipe, world_size=2, steps=5)
    assert all(j.status.terminal for j in free_cluster.jobs)


def test_cluster_repr_lists_slots_and_jobs(free_cluster: nbtrain.Cluster) -> None:
    text = free_cluster._repr_html_()
    assert text.count("<tr><td>tcp://") == 2
    assert "nbtrain cluster" in text


FORKED = """
import json, nbtrain
from nbtrain import JobState
from tests.engine_probe import parent_command_line
from tests.recipes import Regression
if __name__ == "__main__":
    with nbtrain.connect(n_workers=2, gpus=False) as c:
        parents = c.client.run(parent_command_line)
        job = c.submit(Regression(), world_size=2, steps=5, checkpoint=None, name="forked")
        print(json.dumps({"parents": parents, "state": job.wait(120).value}))
"""


def test_workers_fork_from_one_preloaded_forkserver_when_asked(tmp_path: Path) -> None:
    """NBTRAIN_WORKER_START=fork: connect()'s CPU workers are children of one forkserver (not
    of their nannies, as spawned ones are) that preloaded torch, and they train. In a fresh
    process: one that runs a forkserver already (an in-process DataLoader's, say) forks from
    that one, whose preload list is not nbtrain's."""
    import json
    import subprocess
    import sys

    from nbtrain.engine.forkstart import PRELOAD

    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    env = dict(os.environ, NBTRAIN_WORKER_START="fork",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["state"] == "SUCCEEDED", out
    parents = out["parents"]
    assert len(parents) == 2, parents
    assert len(set(parents.values())) == 1, parents  # one forkserver for both
    [parent] = set(parents.values())
    # the forkserver's command line carries its preload list
    assert "multiprocessing.forkserver" in parent, parent
    assert all(repr(module) in parent for module in PRELOAD), (PRELOAD, parent)


def test_workers_spawn_by_default(free_cluster: nbtrain.Cluster) -> None:
    parents = free_cluster.client.run(parent_command_line)
    assert not any("forkserver" in p for p in parents.values()), parents


def test_gang_never_starts_partially_and_fail_fast() -> None:
    with nbtrain.connect(n_workers=3) as c:
        with pytest.raises(ValueError, match="needs 4 slots at once but only 3 of the "
                                             "cluster's 3 are free"):
            c.submit(Regression(), world_size=4, steps=5, queue=False)
        job = c.submit(Regression(), world_size=4, steps=5)
        assert job.status is JobState.QUEUED
        assert "the cluster has 3" in job.reason

        def rank_tasks(dask_scheduler) -> list[str]:  # type: ignore[no-untyped-def]
            return [str(k) for k in dask_scheduler.tasks if str(k).startswith("nbtrain-")]

        # Let the controller run several admission rounds: still nothing may start.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert c.client.run_on_scheduler(rank_tasks) == []
            assert job.status is JobState.QUEUED
        c.scale(4)
        assert job.wait(180) is JobState.SUCCEEDED, job.error
        assert sorted(job.metrics["rank"].unique()) == [0, 1, 2, 3]


def test_step_records_are_batched_per_rank() -> None:
    """Rows travel in batches: with a long flush interval and batches of 10, 35 steps make
    exactly 4 messages per rank (3 full, 1 flushed at the end)."""
    settings = nbtrain.Settings.load(event_flush_s=1000.0, event_batch_max=10)
    with nbtrain.connect(n_workers=2, settings=settings) as c:
        job = c.submit(Regression(), world_size=2, steps=35, checkpoint=None)
        assert job.wait(120) is JobState.SUCCEEDED, job.error
        events = c.client.get_events(RANK_TOPIC)
        batches = [msg for _, msg in events
                   if msg.get("kind") == "steps" and msg.get("job") == job.id]
        per_rank = {r: [len(m["rows"]) for m in batches if m["rank"] == r] for r in (0, 1)}
        assert per_rank == {0: [10, 10, 10, 5], 1: [10, 10, 10, 5]}
        assert len(job.metrics) == 70
