"""Bring your own loop: a training function, on a real cluster, with the guarantees of a
Recipe (exact results, recovery, stop at a step boundary) and its return value."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import nbtrain
from nbtrain import Fault, JobState
from nbtrain.ui.dashboard import TextProgress
from tests.conftest import wait_for
from tests.recipes import (
    Regression,
    assert_params_equal,
    diverging_train,
    make_model,
    regression_data,
    regression_train,
    single_process_params,
)

STEPS = 30


def test_function_and_recipe_train_the_same_parameters(free_cluster: nbtrain.Cluster,
                                                       tmp_path: Path) -> None:
    (tmp_path / "f").mkdir()
    (tmp_path / "r").mkdir()
    fn = free_cluster.submit(regression_train, world_size=2, steps=STEPS,
                             config={"out_dir": str(tmp_path / "f")})
    assert fn.wait(120) is JobState.SUCCEEDED, fn.error
    result = fn.result()
    assert result["steps"] == STEPS and result["final_loss"] > 0
    recipe = free_cluster.submit(Regression(out_dir=str(tmp_path / "r")), world_size=2,
                                 steps=STEPS)
    assert recipe.wait(120) is JobState.SUCCEEDED, recipe.error
    for rank in (0, 1):
        a = torch.load(tmp_path / "f" / f"rank{rank}.pt")
        b = torch.load(tmp_path / "r" / f"rank{rank}.pt")
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    assert_params_equal(tmp_path / "f", single_process_params(STEPS))
    m = fn.metrics
    assert {"data_s", "compute_s", "comm_s", "opt_s", "loss"} <= set(m.columns)
    assert (m["opt_s"] > 0).all()  # the optimizer tracked with ctx.track is timed


@pytest.mark.slow
def test_function_job_recovers_exactly_from_a_killed_rank(free_cluster: nbtrain.Cluster,
                                                          tmp_path: Path) -> None:
    job = free_cluster.submit(regression_train, world_size=2, steps=STEPS, checkpoint=4,
                              config={"out_dir": str(tmp_path), "step_sleep": 0.01},
                              faults=[Fault("kill", rank=1, step=17)], max_restarts=2)
    assert job.wait(180) is JobState.SUCCEEDED, job.error
    [fault] = job.faults
    assert fault["what"] == "worker died" and fault["rank"] == 1
    resumed = [e for e in job.events if e["kind"] == "rank_started" and e["generation"] == 1]
    assert {e["start_step"] for e in resumed} == {fault["resume_step"]}
    assert fault["resume_step"] >= 12
    assert_params_equal(tmp_path, single_process_params(STEPS))
    assert job.result()["steps"] == STEPS


def test_stop_ends_the_users_loop_at_a_step_boundary_and_skips_the_rest(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    job = free_cluster.submit(regression_train, world_size=2, steps=None,
                              config={"out_dir": str(tmp_path), "step_sleep": 0.01})
    wait_for(lambda: job.step >= 5, 120, "training progress")
    job.stop()
    assert job.wait(60) is JobState.CANCELLED
    assert list(tmp_path.iterdir()) == []  # the code after the loop did not run
    assert job.metrics.groupby("rank")["step"].max().nunique() == 1
    assert "/" not in repr(job).split("step ")[1].split()[0]  # no total for steps=None


def test_a_function_that_raises_fails_with_its_traceback(free_cluster: nbtrain.Cluster
                                                         ) -> None:
    def broken(ctx: nbtrain.RankContext, config: dict[str, object]) -> None:
        raise KeyError("no such column: 'label'")

    job = free_cluster.submit(broken, world_size=2, max_restarts=0)
    assert job.wait(60) is JobState.FAILED
    assert "no such column" in job.reason and "in broken" in (job.error or "")
    with pytest.raises(nbtrain.JobFailedError, match="no such column"):
        job.result()


def test_rank_output_reaches_the_notebook_attributed_to_its_rank(
        free_cluster: nbtrain.Cluster) -> None:
    def chatty(ctx: nbtrain.RankContext, config: dict[str, object]) -> None:
        import logging
        import sys
        import warnings

        print(f"hello from rank {ctx.rank}")
        logging.getLogger("mytrain").warning("rank %d is warming up", ctx.rank)
        warnings.warn(f"deprecated thing on rank {ctx.rank}", UserWarning, stacklevel=1)
        for i in range(500):  # a progress bar rewriting its line: one line, not 500
            sys.stderr.write(f"\r{i}/500")
        sys.stderr.write("\n")
        for i in range(1000):  # more than the rate limit allows
            print(f"spam {i}")

    job = free_cluster.submit(chatty, world_size=2)
    assert job.wait(60) is JobState.SUCCEEDED, job.error
    wait_for(lambda: any("dropped" in line for line in job.logs(rank=1, tail=None)), 30,
             "rank 1's output")
    for rank in (0, 1):
        lines = job.logs(rank=rank, tail=None)
        assert f"[rank {rank} g0] hello from rank {rank}" in lines
        assert any(f"WARNING mytrain: rank {rank} is warming up" in line for line in lines)
        assert any(f"deprecated thing on rank {rank}" in line and "stderr" in line
                   for line in lines)
        assert sum("/500" in line for line in lines) <= 3  # 499/500 and at most a refresh
        assert any(line.endswith("499/500") for line in lines)
        assert any("lines dropped" in line for line in lines)
        assert len(lines) < 400
    assert all(f"[rank {r}" in "\n".join(job.logs(rank=r)) for r in (0, 1))
    out = io.StringIO()
    TextProgress(job, interval_s=0.1, out=out).join(30)
    assert "[rank 1 g0] hello from rank 1" in out.getvalue()


def test_the_trained_model_comes_back_as_plain_state_dicts(free_cluster: nbtrain.Cluster,
                                                            tmp_path: Path) -> None:
    job = free_cluster.submit(regression_train, world_size=2, steps=STEPS, checkpoint=None)
    assert job.wait(120) is JobState.SUCCEEDED, job.error
    ckpt = nbtrain.load_checkpoint(job)
    assert ckpt.step == STEPS and ckpt.metadata["job"]["name"] == job.name
    assert not any(k.startswith("module.") for k in ckpt.state["model"])
    fresh = make_model()
    fresh.load_state_dict(ckpt.state["model"])
    trained = make_model()
    trained.load_state_dict(single_process_params(STEPS))
    x = regression_data().tensors[0][:16]
    torch.testing.assert_close(fresh(x), trained(x), rtol=0, atol=1e-6)
    assert set(job.state_dict()) == {"model", "optimizer"}
    path = nbtrain.export_checkpoint(job, tmp_path / "model.pt")
    exported = torch.load(path, weights_only=True)
    assert exported["step"] == STEPS
    torch.testing.assert_close(exported["state"]["model"]["0.weight"],
                               ckpt.state["model"]["0.weight"])
    with pytest.raises(ValueError, match="no committed checkpoint of step 5"):
        nbtrain.load_checkpoint(job, step=5)


def test_a_nan_loss_is_news_and_halt_keeps_the_last_good_checkpoint(
        free_cluster: nbtrain.Cluster) -> None:
    alerted = free_cluster.submit(diverging_train, world_size=2, steps=15,
                                  config={"nan_from": 1}, checkpoint=None)
    assert alerted.wait(120) is JobState.SUCCEEDED, alerted.error
    [event] = [e for e in alerted.events if e["kind"] == "nonfinite"][:1]
    assert event["step"] == 1 and event["value"] == "nan" and event["metric"] == "loss"
    halted = free_cluster.submit(diverging_train, world_size=2, steps=10**6,
                                 config={"nan_from": 11}, checkpoint=5, on_nonfinite="halt")
    assert halted.wait(120) is JobState.FAILED
    assert "halted at step" in halted.reason and "loss was nan at step 11" in halted.reason
    assert "newest committed checkpoint is step 10" in halted.reason
    assert halted.checkpoints[0]["step"] == 10  # nothing saved after the NaN
    state = halted.state_dict()["model"]
    assert all(torch.isfinite(v).all() for v in state.values())
