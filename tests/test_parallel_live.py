"""Beyond DDP on real clusters (gloo, CPU): FSDP2, TP + FSDP on a declared NVLink topology,
sharded DCP checkpoints that reshard across world sizes and mesh shapes, recovery, bf16 and
compile. Float64 wherever exactness is asserted: every run is compared with plain
single-process SGD over the same global batches (``tests.recipes.single_process_params``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import nbtrain
from nbtrain import Fault, JobState, Settings
from nbtrain.engine.standalone import standalone_cluster
from tests.conftest import wait_for
from tests.recipes import (
    TP_PLAN,
    assert_params_equal,
    make_model,
    parallel_train,
    single_process_params,
)

STEPS = 12


def _out(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    out.mkdir()
    return out


def _run(cluster: nbtrain.Cluster, out: Path | None, *, world_size: int, steps: int = STEPS,
         **kwargs: Any) -> nbtrain.JobHandle:
    config: dict[str, Any] = {"out_dir": str(out) if out else None,
                              **kwargs.pop("config", {})}
    job = cluster.submit(parallel_train, world_size=world_size, steps=steps, config=config,
                         **kwargs)
    assert job.wait(300) is JobState.SUCCEEDED, job.error
    return job


def _rank_losses(job: nbtrain.JobHandle, rank: int = 0) -> list[float]:
    rows = job.metrics
    mine = rows[rows["rank"] == rank].sort_values("step")
    return [float(v) for v in mine["loss"]]


# -- two ranks (the session cluster) ---------------------------------------------------------
def test_fsdp_equals_ddp_and_its_checkpoint_reads_with_plain_dcp(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    expected = single_process_params(STEPS)
    ddp_out, fsdp_out = _out(tmp_path, "ddp"), _out(tmp_path, "fsdp")
    ddp = _run(free_cluster, ddp_out, world_size=2, checkpoint=None)
    fsdp = _run(free_cluster, fsdp_out, world_size=2, checkpoint=5,
                config={"strategy": "fsdp"})
    assert_params_equal(ddp_out, expected)
    assert_params_equal(fsdp_out, expected)
    # Each FSDP rank holds its share of the parameters and optimizer state; DDP all of it.
    fsdp_mem, ddp_mem = fsdp.memory, ddp.memory
    assert {m["strategy"] for m in fsdp_mem.values()} == {"fsdp"}
    total = sum(p.numel() * p.element_size() for p in make_model().parameters())
    assert all(m["params_bytes"] == total for m in ddp_mem.values()), ddp_mem
    assert sum(m["params_bytes"] for m in fsdp_mem.values()) == total, fsdp_mem
    assert all(m["params_bytes"] < total and m["optimizer_bytes"] < total
               for m in fsdp_mem.values()), fsdp_mem
    # FSDP's collectives show as communication time.
    assert (fsdp.metrics["comm_s"] > 0).all()

    # The checkpoint directory is a plain DCP checkpoint: torch's own tools read it.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step_dir = fsdp.checkpoints[0]["url"]
    assert fsdp.checkpoints[0]["step"] == STEPS
    dcp_to_torch_save(step_dir, tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=False)
    for name, value in expected.items():
        torch.testing.assert_close(converted["model"][name], value, rtol=0, atol=1e-6)
    assert set(converted["optimizer"]["state"]) == set(expected)  # keyed by parameter name
    model = make_model()
    state = {"model": model.state_dict()}
    with pytest.warns(UserWarning):  # DCP: "torch.distributed is ... uninitialized"
        dcp.load(state, checkpoint_id=step_dir)
    model.load_state_dict(state["model"])
    for name, value in expected.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-6)
    ckpt = nbtrain.load_checkpoint(fsdp)
    assert ckpt.metadata["format"] == 2
    for name, value in expected.items():
        torch.testing.assert_close(ckpt.state["model"][name], value, rtol=0, atol=1e-6)


def test_kill_a_rank_of_an_fsdp_job_and_it_recovers_exactly(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    out = _out(tmp_path, "out")
    job = _run(free_cluster, out, world_size=2, checkpoint=4, max_restarts=2,
               faults=[Fault("kill", rank=1, step=10)],
               config={"strategy": "fsdp", "step_sleep": 0.01})
    assert job.restarts == 1 and job.faults[0]["what"] == "worker died", job.faults
    recovery = [e for e in job.events if e["kind"] == "recovery"]
    # Step 4's checkpoint is committed before step 9 can run: the committer's save at step 8
    # first waits for it, and step 9's collectives wait for the committer. Step 8's may or
    # may not have committed when rank 1 dies at step 10 (its writer runs at nice 10).
    assert recovery and recovery[0]["resumed_step"] in (4, 8), recovery
    assert_params_equal(out, single_process_params(STEPS))


def test_an_elastic_fsdp_job_reshards_when_it_resizes(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    out = _out(tmp_path, "out")
    # 80 steps: the resize lands well before the end even on a busy machine (with 24 it
    # once finished at two ranks, its resize not yet carried out).
    job = free_cluster.submit(parallel_train, world_size=2, min_size=1, steps=80,
                              checkpoint=None, name="elastic-fsdp",
                              config={"strategy": "fsdp", "out_dir": str(out),
                                      "step_sleep": 0.05})
    wait_for(lambda: job.step >= 5, 180, "training at 2 ranks")
    job.resize(1)
    job.wait_for_size(1, timeout=180)
    assert job.wait(300) is JobState.SUCCEEDED, job.error
    assert [e["world_size"] for e in job.events if e["kind"] == "data"] == [2, 1]
    assert_params_equal(out, single_process_params(80), ranks=(0,))


def test_bf16_mixed_trains_and_checkpoints(free_cluster: nbtrain.Cluster) -> None:
    config = {"strategy": "fsdp", "precision": "bf16-mixed", "dtype": "float32", "lr": 0.02}
    job = _run(free_cluster, None, world_size=2, steps=40, checkpoint=20, config=config)
    losses = _rank_losses(job)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    assert {m["precision"] for m in job.memory.values()} == {"bf16-mixed"}
    # The parameters and optimizer state stay float32; the checkpoint restores.
    ckpt = nbtrain.load_checkpoint(job)
    assert {v.dtype for v in ckpt.state["model"].values()} == {torch.float32}
    resumed = _run(free_cluster, None, world_size=2, steps=45, config=config,
                   resume=job.checkpoints[0]["url"], name="bf16-resumed")
    assert resumed.metrics["step"].min() == 41


class _DdpKeys(torch.nn.Module):
    """What DDP's state dict looks like (``module.`` before each name), without a process
    group: how format 1 stored a DDP job's model."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def test_a_format_1_checkpoint_restores_into_ddp_and_fsdp_says_what_to_do(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    from nbtrain.runtime.async_ckpt import AsyncCheckpointer
    from nbtrain.runtime.storage import CheckpointStore

    # Format 1, as nbtrain wrote it before sharded checkpoints: a full copy per rank.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(torch.ones(4, 8, dtype=torch.float64)).sum().backward()
    opt.step()
    url = str(tmp_path / "old")
    store = CheckpointStore(url, keep=2)
    writers = [AsyncCheckpointer(store, rank=r, world_size=2, attempt="g0") for r in (0, 1)]
    for w in writers:
        w.save(6, {"model": _DdpKeys(model), "optimizer": opt}, {"step": 6})
    for w in writers:
        w.close(60)
    assert store.read_manifest(6).version == 1
    out = _out(tmp_path, "ddp")
    ddp = _run(free_cluster, out, world_size=2, steps=6, resume=url, checkpoint=None)
    assert ddp.metrics.empty  # restored at step 6 of 6: nothing left to train
    assert_params_equal(out, model.state_dict())
    fsdp = free_cluster.submit(parallel_train, world_size=2, steps=8, resume=url,
                               max_restarts=0, config={"strategy": "fsdp"})
    assert fsdp.wait(300) is JobState.FAILED
    assert "checkpoint format 1" in fsdp.error and "strategy='ddp'" in fsdp.error, fsdp.error


@pytest.mark.slow
def test_compile_runs_under_ddp_and_fsdp(free_cluster: nbtrain.Cluster,
                                         tmp_path: Path) -> None:
    expected = single_process_params(6)
    for strategy in ("ddp", "fsdp"):
        out = _out(tmp_path, strategy)
        job = _run(free_cluster, out, world_size=2, steps=6, checkpoint=None,
                   config={"strategy": strategy, "compile": True})
        assert job.result()["compiled_graphs"] > 0  # dynamo did capture graphs
        # Inductor may fuse float64 ops differently from eager: close, not bit-equal.
        for rank in (0, 1):
            got = torch.load(out / f"rank{rank}.pt")
            for name, value in expected.items():
                torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6)


# -- four slots on two hosts of one NVLink pair each -----------------------------------------
@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[nbtrain.Cluster]:
    """A standalone cluster of 4 workers declared as 2 hosts x 2 GPUs joined by NVLink."""
    tmp = tmp_path_factory.mktemp("pairs")
    with standalone_cluster(0, logs=tmp / "logs") as sc:
        for host in ("a", "b"):
            sc.add_workers(2, env={"NBTRAIN_WORKER_HOST": f"node-{host}",
                                   "NBTRAIN_WORKER_NVLINK": f"nvl-{host}"}, name=host)
        with nbtrain.connect(sc.address, settings=Settings.load(
                token_file=str(tmp / "tokens.json"))) as c:
            wait_for(lambda: len(c.free_slots) == 4, 180, "four slots")
            yield c


def _where(out: Path, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.slow
def test_tp_groups_land_in_nvlink_pairs_and_train_like_ddp(
        pairs: nbtrain.Cluster, tmp_path: Path) -> None:
    expected = single_process_params(STEPS)
    tp_out, ddp_out = _out(tmp_path, "tp"), _out(tmp_path, "ddp")
    tp = _run(pairs, tp_out, world_size=4, mesh={"dp": 2, "tp": 2}, checkpoint=None,
              config={"strategy": "tp+fsdp", "tp_plan": TP_PLAN})
    ddp = _run(pairs, ddp_out, world_size=2, checkpoint=None)
    mesh = tp.result()["mesh"]
    assert mesh["dims"] == {"dp": 2, "tp": 2}
    assert (mesh["tp_groups_in_nvlink"], mesh["tp_groups"]) == (2, 2), tp.result()["describe"]
    # Each rank's DeviceMesh groups it with the ranks placed in its NVLink pair: the workers
    # they really run in carry one NVLink label per TP group, and it is the planned one.
    where = _where(tp_out, 4)
    assert all(w["nbtrain"].startswith(str(Path(nbtrain.__file__).parent)) for w in where)
    for w in where:
        assert {where[r]["worker_nvlink"] for r in w["tp_group"]} == {w["worker_nvlink"]}
        assert mesh["ranks"][w["rank"]]["nvlink"] == w["worker_nvlink"]
    assert sorted(tuple(w["tp_group"]) for w in where) == [(0, 1), (0, 1), (2, 3), (2, 3)]
    # DP rank 0 (ranks 0 and 1) trains on the batches DDP's rank 0 gets: the same losses.
    torch.testing.assert_close(_rank_losses(tp, 0), _rank_losses(ddp, 0), rtol=0, atol=1e-9)
    torch.testing.assert_close(_rank_losses(tp, 1), _rank_losses(ddp, 0), rtol=0, atol=1e-9)
    assert_params_equal(tp_out, expected, ranks=(0, 1, 2, 3))
    # Per-rank state: TP splits the layers, FSDP shards each TP rank's part over dp. The
    # rowwise layer's bias is replicated across the TP group (each TP rank adds it after the
    # reduction), so it is held once per TP rank.
    assert {m["strategy"] for m in tp.memory.values()} == {"tp+fsdp"}
    total = sum(p.numel() * p.element_size() for p in make_model().parameters())
    bias = make_model()[2].bias
    replicated = bias.numel() * bias.element_size()
    assert sum(m["params_bytes"] for m in tp.memory.values()) == total + replicated, tp.memory
    assert all(m["params_bytes"] < total / 2 for m in tp.memory.values()), tp.memory


@pytest.mark.slow
def test_sharded_checkpoints_resume_at_other_world_sizes_and_mesh_shapes(
        pairs: nbtrain.Cluster, tmp_path: Path) -> None:
    # FSDP at 2 ranks, resumed by FSDP at 4; TP + FSDP at 2 x 2, resumed by FSDP at 2.
    first = _run(pairs, None, world_size=2, steps=8, checkpoint=None,
                 config={"strategy": "fsdp"}, name="fsdp-2")
    out4 = _out(tmp_path, "fsdp4")
    _run(pairs, out4, world_size=4, steps=STEPS, resume=first.checkpoints[0]["url"],
         config={"strategy": "fsdp"}, name="fsdp-4")
    assert_params_equal(out4, single_process_params(STEPS), ranks=(0, 1, 2, 3))
    tp = _run(pairs, None, world_size=4, steps=8, mesh={"tp": 2}, checkpoint=None,
              config={"strategy": "tp+fsdp", "tp_plan": TP_PLAN}, name="tp-2x2")
    out2 = _out(tmp_path, "fsdp2")
    _run(pairs, out2, world_size=2, steps=STEPS, resume=tp.checkpoints[0]["url"],
         config={"strategy": "fsdp"}, name="fsdp-from-tp")
    assert_params_equal(out2, single_process_params(STEPS))
