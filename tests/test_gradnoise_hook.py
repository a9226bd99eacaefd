"""The gradient norms the DDP all-reduce hook measures for the noise scale: real gloo process
groups on CPU (spawned processes), float64, an uneven batch split weighted by each rank's
share. Each rank's local squared norm is that of the gradient of its own part of the batch,
and the reduced one that of the whole batch's mean loss, as one process computes them."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nbtrain.runtime.timing import PhaseTimer

SPLIT = (5, 3)  # an uneven global batch of 8 over two ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 1)).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(sum(SPLIT), 6, dtype=torch.float64), torch.randn(
        sum(SPLIT), 1, dtype=torch.float64)


def _sq_norm(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return float(sum(p.grad.double().square().sum() for p in model.parameters()))


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1e-4)
        timer = PhaseTimer()
        timer.attach_ddp(ddp)
        timer.grad_norms = True
        x, y = _batch()
        lo = 0 if rank == 0 else SPLIT[0]
        mine = slice(lo, lo + SPLIT[rank])
        timer.grad_weight = SPLIT[rank] / sum(SPLIT)
        for _ in range(2):  # the second step's norms alone: take_grad_norms clears them
            ddp.zero_grad()
            torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
            norms = timer.take_grad_norms()
        torch.save({"norms": norms, "again": timer.take_grad_norms()},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_hook_measures_the_local_and_the_reduced_gradient_norms(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    model = _model()
    x, y = _batch()
    whole = _sq_norm(model, x, y)
    parts = [_sq_norm(model, x[:SPLIT[0]], y[:SPLIT[0]]), _sq_norm(model, x[SPLIT[0]:],
                                                                    y[SPLIT[0]:])]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        local, reduced = got["norms"]
        assert abs(local - parts[rank]) <= 1e-9 * parts[rank], (rank, local, parts)
        assert abs(reduced - whole) <= 1e-9 * whole, (rank, reduced, whole)
        assert got["again"] is None  # nothing measured since
    assert parts[0] != parts[1] != whole  # the three norms this test tells apart
