"""End to end on GPUs: one worker per GPU, a 2-rank NCCL job, recovery by aborting NCCL peers,
and the CUDA checkpoint path. Marked ``gpu``; skipped without CUDA (2 GPUs for the cluster
tests). Run them with ``pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import nbtrain
from nbtrain import Fault, JobState
from tests.recipes import (
    GpuRegression,
    assert_params_equal,
    single_process_params,
    what_the_worker_sees,
)

STEPS = 30

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_cluster() -> Any:
    """An embedded cluster with one worker per GPU, on the first two GPUs."""
    with nbtrain.connect(n_workers=2, gpus=True) as c:
        yield c


def _uuid(text: str) -> str:
    return text.removeprefix("GPU-").lower()


@two_gpus
def test_one_gpu_per_worker(gpu_cluster: nbtrain.Cluster) -> None:
    seen = gpu_cluster.client.run(what_the_worker_sees)
    assert [count for count, _ in seen.values()] == [1, 1]
    uuids = {_uuid(u) for _, u in seen.values()}
    assert len(uuids) == 2  # no two ranks share a GPU
    topo = gpu_cluster.topology
    assert [s["device"] for s in topo.slots] == ["gpu", "gpu"]
    assert {_uuid(s["gpu"]) for s in topo.slots} == uuids  # discovery names the same GPUs
    assert all(s["nvlink_source"] for s in topo.slots), topo.describe()


@two_gpus
def test_two_rank_nccl_job_trains_exactly(gpu_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    job = gpu_cluster.submit(GpuRegression(out_dir=str(tmp_path)), world_size=2, steps=STEPS,
                             checkpoint=5, device="gpu")
    assert job.wait(300) is JobState.SUCCEEDED, job.error
    started = [e for e in job.events if e["kind"] == "rank_started"]
    assert {e["device"] for e in started} == {"cuda:0"} and len(started) == 2
    assert_params_equal(tmp_path, single_process_params(STEPS))


@two_gpus
@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_a_failed_rank_is_recovered_by_aborting_its_nccl_peers(
        gpu_cluster: nbtrain.Cluster, tmp_path: Path, kind: str) -> None:
    job = gpu_cluster.submit(
        GpuRegression(out_dir=str(tmp_path), step_sleep=0.01), world_size=2, steps=STEPS,
        checkpoint=4, faults=[Fault(kind, rank=1, step=9)], max_restarts=2, device="gpu")
    assert job.wait(300) is JobState.SUCCEEDED, job.error
    assert job.restarts == 1
    log = gpu_cluster.snapshot()["log"]
    aborts = [e for e in log if e.get("kind") == "abort" and e.get("job") == job.id]
    assert aborts, log
    assert "aborting" in set(aborts[0]["results"].values())  # rank 0's group was aborted
    restarts = [e for e in log if e.get("kind") == "restart" and job.name in e["reason"]]
    assert restarts == []  # no worker restarted to free a peer
    pids = {(e["generation"], e["rank"]): e["pid"] for e in job.events
            if e["kind"] == "rank_started"}
    survivors = {pids[(0, r)] for r in (0, 1)} & {pids[(1, r)] for r in (0, 1)}
    assert len(survivors) == (2 if kind == "raise" else 1)  # warm processes kept
    assert_params_equal(tmp_path, single_process_params(STEPS))


@one_gpu
def test_cuda_checkpoint_round_trip(tmp_path: Path) -> None:
    from nbtrain.runtime.async_ckpt import AsyncCheckpointer
    from nbtrain.runtime.rng import capture_rng_state, restore_rng_state
    from nbtrain.runtime.snapshot import load_state
    from nbtrain.runtime.storage import CheckpointStore

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()
    opt.step()
    torch.cuda.manual_seed_all(123)
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    rng = capture_rng_state()
    draw = torch.rand(4, device="cuda").cpu()
    store = CheckpointStore(str(tmp_path / "c"))
    ck = AsyncCheckpointer(store, rank=0, world_size=1)
    ck.save(1, {"model": model, "optimizer": opt}, meta={"rng": rng})
    with torch.no_grad():  # the loop goes on at once; its updates wait for the copies
        for p in model.parameters():
            p.add_(1.0)
    result = ck.close(120)
    assert result is not None and result.error is None and result.committed
    shard = store.load_shard(1, 0)
    for name, value in expected.items():
        assert torch.equal(shard["state"]["model"][name], value), name
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8)).cuda()
    load_state({"model": fresh}, {"model": shard["state"]["model"]})
    assert all(torch.equal(fresh.state_dict()[k].cpu(), v) for k, v in expected.items())
    assert restore_rng_state(shard["meta"]["rng"]) == []
    assert torch.equal(torch.rand(4, device="cuda").cpu(), draw)  # CUDA RNG restored
