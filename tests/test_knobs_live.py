"""Live knobs on a real cluster (LocalCluster worker processes, gloo, float64): changes made
while a 2-rank job trains apply on every rank at one agreed step, a recovery restores them,
``submit(replay=job)`` reproduces the steered run exactly; refusals say why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import nbtrain
from nbtrain.core.job import JobState
from nbtrain.core.knobs import values_at
from tests import recipes
from tests.conftest import wait_for


def _declared(job: nbtrain.JobHandle) -> None:
    wait_for(lambda: bool(job.knobs.declared) and job.step >= 3, 120, "the job's knobs")


def _per_step(job: nbtrain.JobHandle) -> pd.DataFrame:
    m = job.metrics
    return m[["rank", "step", "lr", "aux"]].dropna()


def _check_every_step(job: nbtrain.JobHandle) -> None:
    """Every rank trained every step with the same values, the ones the history says."""
    state = job.knobs
    m = _per_step(job)
    # The newest row of each (rank, step): a recovery trains some steps again.
    last = m.groupby(["rank", "step"]).last().reset_index()
    wide = last.pivot(index="step", columns="rank", values=["lr", "aux"])
    assert (wide["lr"][0] == wide["lr"][1]).all() and (wide["aux"][0] == wide["aux"][1]).all()
    defaults = {n: s.default for n, s in state.declared.items()}
    for step, row in last[last["rank"] == 0].set_index("step").iterrows():
        want = values_at(defaults, state.history, int(step) - 1)  # in force for this step
        assert row["lr"] == want["lr"] and row["aux"] == want["aux_weight"], (step, row, want)
    # And over all rows (recomputed steps too), rank by rank.
    for _, row in m.iterrows():
        want = values_at(defaults, state.history, int(row["step"]) - 1)
        assert row["lr"] == want["lr"] and row["aux"] == want["aux_weight"]


def _params(out: Path, rank: int) -> dict[str, Any]:
    return torch.load(out / f"rank{rank}.pt")


def test_live_changes_apply_on_every_rank_at_one_step_and_replay_exactly(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    live_out, replay_out = tmp_path / "live", tmp_path / "replay"
    live_out.mkdir()
    replay_out.mkdir()
    config = {"step_sleep": 0.01, "out_dir": str(live_out)}
    job = free_cluster.submit(recipes.steered_train, world_size=2, steps=400, config=config,
                              checkpoint=None, name="steered")
    _declared(job)
    assert set(job.knobs.declared) >= {"lr", "aux_weight", "lr_factor", "weight_decay"}
    assert job.knobs.declared["lr"].default == 0.05
    first = job.set(lr=0.02)
    assert first is not None and first >= 3
    wait_for(lambda: job.step >= first + 10, 60, "steps after the first change")
    second = job.set(aux_weight=0.5, ramp=20)
    assert second is not None and second > first
    wait_for(lambda: job.step >= second + 5, 60, "steps after the second change")
    third = job.set(lr=0.01, ramp=15, shape="cosine")  # while the aux ramp may still move
    assert third is not None and third > second
    assert job.wait(120) is JobState.SUCCEEDED, job.reason
    history = job.knobs.history
    assert [(c.step, dict(c.values)) for c in history] == [
        (first, {"lr": 0.02}), (second, {"aux_weight": 0.5}), (third, {"lr": 0.01})]
    assert all(c.who for c in history)
    assert job.knobs.values["lr"] == 0.01 and job.knobs.values["aux_weight"] == 0.5
    _check_every_step(job)
    assert _per_step(job)["step"].max() == 400

    # The replay applies the same changes at the same steps: the same parameters.
    again = free_cluster.submit(recipes.steered_train, world_size=2, steps=400,
                                config={**config, "out_dir": str(replay_out)},
                                checkpoint=None, name="steered-replay", replay=job)
    assert again.wait(120) is JobState.SUCCEEDED, again.reason
    assert [(c.step, dict(c.values)) for c in again.knobs.history] == [
        (c.step, dict(c.values)) for c in history]
    for rank in (0, 1):
        live, rerun = _params(live_out, rank), _params(replay_out, rank)
        for name, value in live.items():
            torch.testing.assert_close(rerun[name], value, rtol=0, atol=1e-12)
    def ordered(j: nbtrain.JobHandle) -> pd.DataFrame:
        return _per_step(j).sort_values(["rank", "step"]).reset_index(drop=True)

    pd.testing.assert_frame_equal(ordered(again), ordered(job))


def test_recovery_after_a_change_uses_the_changed_value(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(recipes.steered_train, world_size=2, steps=200,
                              config={"step_sleep": 0.01}, checkpoint=10, max_restarts=2,
                              name="steered-kill")
    _declared(job)
    applied = job.set(lr=0.02, aux_weight=0.25)
    assert applied is not None
    job.inject("kill", rank=1, step=applied + 25)
    assert job.wait(180) is JobState.SUCCEEDED, job.reason
    assert job.restarts == 1
    resumed = next(e for e in job.events if e["kind"] == "recovery")["resumed_step"]
    assert resumed is not None and resumed >= applied  # a checkpoint taken after the change
    m = _per_step(job)
    after = m[m["step"] > resumed]
    assert (after["lr"] == 0.02).all() and (after["aux"] == 0.25).all()
    _check_every_step(job)


def test_refusals_name_the_problem(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(recipes.steered_train, world_size=2, steps=100000,
                              config={"step_sleep": 0.01}, checkpoint=None, name="refusals")
    _declared(job)
    with pytest.raises(ValueError, match=r"aux_weight=2: 2 is above its max 1"):
        job.set(aux_weight=2.0)
    with pytest.raises(ValueError, match=r"'momentum' is not a knob of job refusals"):
        job.set(momentum=0.9)
    # The controller judges again what a client did not check.
    with pytest.raises(ValueError, match=r"lr=-1: -1 is below its min 0"):
        free_cluster.rpc("nbtrain_request", job_id=job.id, what="set",
                         arg={"values": {"lr": -1.0}}, token=job.token)
    with pytest.raises(PermissionError, match="belongs to"):
        free_cluster.rpc("nbtrain_request", job_id=job.id, what="set",
                         arg={"values": {"lr": 0.01}}, token="not-its-token")
    with pytest.raises(ValueError, match="more than"):
        free_cluster.rpc("nbtrain_request", job_id=job.id, what="set",
                         arg={"values": {f"k{i}": 0.0 for i in range(10_000)}},
                         token=job.token)
    assert job.knobs.history == () and job.knobs.pending == ()
    job.stop()
    job.wait(60)
    with pytest.raises(ValueError, match=r"has ended \(\w+\): its knobs can no longer change"):
        job.set(lr=0.01)


def test_a_ramp_continues_across_a_resize(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(recipes.steered_train, world_size=2, min_size=1, max_size=2,
                              steps=300, config={"step_sleep": 0.01}, checkpoint=50,
                              name="steered-resize")
    _declared(job)
    started = job.set(aux_weight=0.9, ramp=150)
    assert started is not None
    job.resize(1)
    job.wait_for_size(1, timeout=120)
    assert job.wait(180) is JobState.SUCCEEDED, job.reason
    m = job.metrics.dropna(subset=["aux"])
    assert m[m["step"] > started + 150]["aux"].eq(0.9).all()
    one = m[m["generation"] == m["generation"].max()]
    assert set(one["rank"]) == {0} and one["step"].min() < started + 150  # mid-ramp
    state = job.knobs
    defaults = {n: s.default for n, s in state.declared.items()}
    for _, row in m.iterrows():  # every step of every rank, at both sizes
        want = values_at(defaults, state.history, int(row["step"]) - 1)
        assert row["aux"] == want["aux_weight"], (row["step"], row["aux"], want)


def test_recovery_before_a_change_applies_it_again_at_its_step(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    """No checkpoint after the change: the recovered generation starts earlier and applies
    the change again at its recorded step; the run ends where its replay does."""
    live_out, replay_out = tmp_path / "live", tmp_path / "replay"
    live_out.mkdir()
    replay_out.mkdir()
    job = free_cluster.submit(recipes.steered_train, world_size=2, steps=150,
                              config={"step_sleep": 0.01, "out_dir": str(live_out)},
                              checkpoint=None, max_restarts=2, name="steered-rewind")
    _declared(job)
    applied = job.set(lr=0.02, aux_weight=0.3)
    assert applied is not None and applied < 130
    job.inject("kill", rank=1, step=applied + 10)
    assert job.wait(180) is JobState.SUCCEEDED, job.reason
    assert job.restarts == 1
    resumed = next(e for e in job.events if e["kind"] == "recovery")["resumed_step"]
    assert resumed is not None and resumed < applied
    last = job.metrics[job.metrics["generation"] == job.metrics["generation"].max()]
    assert last["step"].min() <= applied  # the new generation trained the step again
    _check_every_step(job)
    assert [c.step for c in job.knobs.history] == [applied]
    again = free_cluster.submit(recipes.steered_train, world_size=2, steps=150,
                                config={"step_sleep": 0.0, "out_dir": str(replay_out)},
                                checkpoint=None, name="steered-rewind-replay", replay=job)
    assert again.wait(180) is JobState.SUCCEEDED, again.reason
    for rank in (0, 1):
        live, rerun = _params(live_out, rank), _params(replay_out, rank)
        for name, value in live.items():
            torch.testing.assert_close(rerun[name], value, rtol=0, atol=1e-12)
