"""The checkpoint interval and the straggler settings as live knobs on a real cluster
(LocalCluster worker processes, gloo): a change applies on every rank at one agreed step,
the checkpoints follow the new interval from that step on, a recovery restores the interval
in force at the restored step, and the straggler change is in the history and its replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import nbtrain
from nbtrain.core.job import JobState
from tests import recipes
from tests.conftest import wait_for
from tests.recipes import parallel_train, single_process_params

STEPS = 400  # a multiple of both intervals: the final checkpoint is one of theirs


def _snapshots(job: nbtrain.JobHandle) -> dict[int, list[tuple[int, int]]]:
    """(generation, step) of every checkpoint each rank took, in order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for e in job.events:
        if e.get("kind") == "checkpoint" and e.get("phase") == "snapshot":
            gen = e.get("gen", e.get("generation"))  # the key is being renamed: either
            out.setdefault(int(e["rank"]), []).append((int(gen), int(e["step"])))
    return out


def _workers_import_this_tree(cluster: nbtrain.Cluster) -> None:
    here = nbtrain.__file__
    files: dict[str, Any] = cluster.client.run(lambda: __import__("nbtrain").__file__)
    assert set(files.values()) == {here}, files


def test_checkpoint_every_and_straggler_settings_change_live_and_survive_a_recovery(
        free_cluster: nbtrain.Cluster) -> None:
    _workers_import_this_tree(free_cluster)
    job = free_cluster.submit(recipes.steered_train, world_size=2, steps=STEPS,
                              config={"step_sleep": 0.02}, checkpoint=10, max_restarts=2,
                              name="builtin-knobs")
    # The change goes in once a checkpoint at the old interval committed, so the steps
    # before it hold one (under load the job can be slower than this thread: a change sent
    # at step 3 could apply before step 10, leaving nothing to compare before it).
    wait_for(lambda: "checkpoint_every" in job.knobs.declared and bool(job.checkpoints), 120,
             "the job's knobs and its first checkpoint")
    declared = job.knobs.declared
    assert declared["checkpoint_every"].default == 10 and declared["checkpoint_every"].integer
    assert declared["straggler_ratio"].by == "controller"
    assert declared["straggler_ratio"].default == 1.2
    applied = job.set(checkpoint_every=25, straggler_ratio=1.5, straggler_window=12)
    assert applied is not None
    # A kill once a checkpoint after the change committed: the recovery restores one taken
    # at a multiple of 25, and goes on checkpointing every 25 steps.
    wait_for(lambda: any(c["step"] > applied for c in job.checkpoints), 120,
             "a checkpoint after the change")
    job.inject("kill", rank=1, step=job.step + 10)
    assert job.wait(240) is JobState.SUCCEEDED, job.reason
    assert job.restarts == 1
    resumed = next(e for e in job.events if e["kind"] == "recovery")["resumed_step"]
    assert resumed is not None and resumed > applied and resumed % 25 == 0, (resumed, applied)
    [change] = job.knobs.history
    assert change.step == applied and dict(change.values) == {
        "checkpoint_every": 25.0, "straggler_ratio": 1.5, "straggler_window": 12.0}
    snaps = _snapshots(job)
    assert snaps[0] == snaps[1], snaps  # every rank checkpointed the same steps
    steps = [s for _, s in snaps[0]]
    before = [s for s in steps if s <= applied]
    after = [s for s in steps if s > applied]
    assert before and all(s % 10 == 0 for s in before), steps
    assert after and all(s % 25 == 0 for s in after), (steps, applied)
    last_gen = max(g for g, _ in snaps[0])
    assert [s for g, s in snaps[0] if g == last_gen] == list(
        range(resumed + 25, STEPS + 1, 25)), (steps, resumed)
    assert job.knobs.values["checkpoint_every"] == 25.0

    # A replay carries the same change at the same step: the same checkpoint steps.
    again = free_cluster.submit(recipes.steered_train, world_size=2, steps=STEPS,
                                config={"step_sleep": 0.0}, checkpoint=10,
                                name="builtin-knobs-replay", replay=job)
    assert again.wait(240) is JobState.SUCCEEDED, again.reason
    assert [(c.step, dict(c.values)) for c in again.knobs.history] == [
        (applied, dict(change.values))]
    replayed = [s for _, s in _snapshots(again)[0]]
    assert [s for s in replayed if s <= applied] == before
    assert [s for s in replayed if s > applied] == list(
        range((applied // 25 + 1) * 25, STEPS + 1, 25))


def test_grad_clip_under_fsdp_clips_by_the_global_norm(free_cluster: nbtrain.Cluster,
                                                      tmp_path: Path) -> None:
    """FSDP2 over 2 gloo ranks, float64, ``grad_clip`` in force from the first step (a
    change at step 0, given as the job's replay): the parameters equal one process's with
    torch's own clipping of the whole gradient, which a per-shard norm would not give."""
    clip, steps = 0.05, 12
    job = free_cluster.submit(parallel_train, world_size=2, steps=steps, checkpoint=None,
                              config={"strategy": "fsdp", "out_dir": str(tmp_path)},
                              name="fsdp-clip",
                              replay=[{"seq": 1, "values": {"grad_clip": clip}, "step": 0}])
    assert job.wait(300) is JobState.SUCCEEDED, job.error
    want = single_process_params(steps, clip=clip)
    unclipped = single_process_params(steps)
    assert max(float((want[k] - unclipped[k]).abs().max()) for k in want) > 1e-3  # it clips
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12)
