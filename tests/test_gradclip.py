"""``grad_clip`` under FSDP2 and TP + FSDP: real gloo process groups on CPU (spawned
processes), float64, compared with a single process's ``torch.nn.utils.clip_grad_norm_`` on
the same model and batch. Under ``tp+fsdp`` with a TP plan that covers only some layers the
gradients live on two meshes, where torch's own function refuses to stack the norms."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nbtrain.runtime.gradclip import clip_grad_norm

LIMIT = 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 1)).double()


def _batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 8, dtype=torch.float64)


def _reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = _model()
    model(_batch()).pow(2).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), LIMIT)
    return float(norm), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank(rank: int, world: int, mode: str, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model()
        if mode == "fsdp":
            fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
        else:  # layers 0 and 2 on the (dp, tp) mesh, layer 4 on dp alone
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(),
                                                   "2": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp"])
        model(_batch()).pow(2).sum().backward()
        params = list(model.parameters())
        meshes = {p.grad.device_mesh.ndim for p in params if isinstance(p.grad, DTensor)}
        norm = clip_grad_norm(params, LIMIT)
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                 for n, p in model.named_parameters()}
        torch.save({"norm": float(norm), "grads": grads, "meshes": sorted(meshes)},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("mode", "world", "meshes"), [("fsdp", 2, [1]), ("tp+fsdp", 4, [1, 2])])
def test_clipping_uses_the_global_norm_across_shards(tmp_path: Path, mode: str, world: int,
                                                     meshes: list[int]) -> None:
    mp.spawn(_rank, args=(world, mode, _free_port(), str(tmp_path)), nprocs=world, join=True)
    norm, grads = _reference()
    assert norm > LIMIT * 5  # the batch's gradients are clipped hard
    for rank in range(world):
        got: dict[str, Any] = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["meshes"] == meshes  # the sharding this test means to cover
        assert abs(got["norm"] - norm) <= 1e-12 * norm
        for name, want in grads.items():
            torch.testing.assert_close(got["grads"][name], want, rtol=0, atol=1e-12)


def test_plain_tensors_clip_like_torch() -> None:
    model = _model()
    model(_batch()).pow(2).sum().backward()
    norm = clip_grad_norm(model.parameters(), LIMIT)
    want_norm, want = _reference()
    assert float(norm) == pytest.approx(want_norm, rel=1e-14)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=0, atol=1e-15)
    # Under the limit nothing moves; no gradients at all is a zero norm.
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    clip_grad_norm(model.parameters(), 1e9)
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())
    assert float(clip_grad_norm([torch.zeros(2, requires_grad=True)], 1.0)) == 0.0
