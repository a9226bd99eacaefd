"""Other frameworks' training inside an nbtrain job, on 2 real gloo ranks: a Hugging Face
``Trainer`` (through ``nbtrain.runtime.hf.run_trainer``), an ``accelerate`` loop and a
Lightning Fabric loop. Each sees a distributed run (the ranks look like torchrun's) and
recovers bit-exactly from a rank killed mid-run: its parameters equal an uninterrupted run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import nbtrain
from nbtrain import Fault, JobState
from nbtrain.framework_examples import accelerate_train, fabric_train, hf_trainer_train

pytestmark = pytest.mark.slow
STEPS = 12


def _run(cluster: nbtrain.Cluster, fn: Any, out: Path, *, kill: bool) -> nbtrain.JobHandle:
    out.mkdir()
    job = cluster.submit(fn, world_size=2, steps=STEPS, checkpoint=4, name=out.name,
                         config={"work_dir": str(out), "out_dir": str(out)},
                         faults=[Fault("kill", rank=1, step=7)] if kill else [])
    assert job.wait(300) is JobState.SUCCEEDED, job.error
    if kill:
        [fault] = job.faults
        # From step 4's checkpoint, or from the start when its commit (asynchronous) was still
        # in flight at the kill (a loaded machine): exact either way.
        assert fault["what"] == "worker died" and fault["resume_step"] in (0, 4), job.faults
    return job


def _same_params(a: Path, b: Path) -> None:
    for rank in (0, 1):
        want, got = torch.load(a / f"rank{rank}.pt"), torch.load(b / f"rank{rank}.pt")
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_hf_trainer_trains_distributed_and_recovers_exactly(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    clean = _run(free_cluster, hf_trainer_train, tmp_path / "clean", kill=False)
    info = clean.result()
    assert info["world_size"] == 2 and info["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    assert info["global_step"] == STEPS
    m = clean.metrics
    assert sorted(m["rank"].unique()) == [0, 1] and m["step"].max() == STEPS
    assert m["loss"].notna().all() and m["learning_rate"].notna().all()  # the Trainer's logs
    # ... printed once, by rank 0, as torchrun on one host prints them (each rank is a
    # torchrun node of its own, LOCAL_RANK 0, so the Trainer alone would print on both)
    printed = [line for line in clean.logs(tail=None) if "{'loss'" in line]
    assert printed and all(line.startswith("[rank 0 ") for line in printed), printed[:4]
    killed = _run(free_cluster, hf_trainer_train, tmp_path / "killed", kill=True)
    assert killed.result()["global_step"] == STEPS  # counted on from the restored step
    _same_params(tmp_path / "clean", tmp_path / "killed")


def test_accelerate_and_fabric_loops_recover_exactly(free_cluster: nbtrain.Cluster,
                                                     tmp_path: Path) -> None:
    # Both run the same loop (nbtrain's batches, DDP over nbtrain's group): one uninterrupted
    # accelerate run is the reference of both killed runs.
    clean = _run(free_cluster, accelerate_train, tmp_path / "clean", kill=False)
    assert clean.result()["num_processes"] == 2
    assert clean.result()["distributed_type"] == "DistributedType.MULTI_CPU"
    acc = _run(free_cluster, accelerate_train, tmp_path / "accelerate", kill=True)
    fab = _run(free_cluster, fabric_train, tmp_path / "fabric", kill=True)
    assert fab.result()["world_size"] == 2 and fab.result()["strategy"] == "DDPStrategy"
    assert acc.result()["loss"] == fab.result()["loss"] == clean.result()["loss"]
    _same_params(tmp_path / "clean", tmp_path / "accelerate")
    _same_params(tmp_path / "clean", tmp_path / "fabric")


def test_run_trainer_names_what_it_needs(free_cluster: nbtrain.Cluster,
                                         tmp_path: Path) -> None:
    job = free_cluster.submit(hf_trainer_train, world_size=1, steps=5, checkpoint=None,
                              max_restarts=0,
                              config={"work_dir": str(tmp_path), "accumulate": 2,
                                      "max_steps": 7})
    assert job.wait(300) is JobState.FAILED
    assert "gradient_accumulation_steps=2: use 1" in job.error
    assert "max_steps=7 but the job has steps=5" in job.error
