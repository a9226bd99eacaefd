"""The gradient norms behind the noise scale, measured in one process: the DDP all-reduce
hook on a real gloo group of one rank (its reduced gradient is its own, weighted by the
rank's share), and :class:`NoiseProbe` turning the norms of steps with known sizes into the
estimate it sends, with one read of the device per ``every`` steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.distributed as dist

from nbtrain.core.gradnoise import NoiseScale
from nbtrain.runtime.events import EventEmitter
from nbtrain.runtime.noiseprobe import NoiseProbe
from nbtrain.runtime.timing import PhaseTimer


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_hook_measures_the_local_gradient_before_and_the_reduced_after(
        one_rank: None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-4)  # many buckets
    timer = PhaseTimer()
    timer.attach_ddp(ddp)
    timer.grad_norms = True
    timer.grad_weight = 0.25  # this rank's share: the reduced gradient is a quarter of its own
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    for _ in range(2):  # the second step's norms alone: take_grad_norms clears them
        ddp.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        norms = timer.take_grad_norms()
    assert norms is not None and norms.dtype == torch.float64
    reduced = float(sum(p.grad.double().square().sum() for p in model.parameters()))
    local, got_reduced = norms.tolist()
    assert got_reduced == pytest.approx(reduced, rel=1e-6)
    assert local == pytest.approx(16.0 * reduced, rel=1e-6)
    assert timer.take_grad_norms() is None  # nothing measured since


class _Sent:
    """Where the probe's events go (a rank's emitter sends them to the scheduler)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit_aside(self, kind: str, **info: Any) -> None:
        self.events.append({"kind": kind, **info})


def test_the_probe_sends_the_estimate_of_steps_with_real_sizes_every_twenty() -> None:
    timer, sent = PhaseTimer(), _Sent()
    probe = NoiseProbe(timer, cast(EventEmitter, sent), every=20)
    assert timer.grad_norms
    rng = np.random.default_rng(3)
    g = rng.normal(size=30)
    expected = NoiseScale()
    for step in range(1, 46):
        mine, batch = (5, 8) if step % 2 else (3, 8)  # an uneven split, rank 0's share moves
        samples = g + rng.normal(0.0, 2.0, size=(batch, g.size))
        local, whole = samples[:mine].mean(axis=0), samples.mean(axis=0)
        timer._local_sq, timer._global_sq = (  # float64, as the hook measures them
            [torch.tensor(float(local @ local), dtype=torch.float64)],
            [torch.tensor(float(whole @ whole), dtype=torch.float64)])
        timer.batch_sizes = (mine, batch)
        expected.observe(float(local @ local), float(whole @ whole), mine, batch)
        probe.after_step(step)
        if step == 19:
            assert sent.events == []  # nothing read or sent before the twentieth step
    assert [e["step"] for e in sent.events] == [20, 40]
    assert sent.events[-1]["observed"] == 40
    last = sent.events[-1]["noise_scale"]
    assert last is not None and last > 0
    probe._send(45)  # the five kept steps, as the next send would read them
    assert sent.events[-1]["noise_scale"] == pytest.approx(expected.value, rel=1e-9)


def test_the_probe_stops_measuring_for_a_loader_that_is_not_nbtrains() -> None:
    timer, sent = PhaseTimer(), _Sent()
    probe = NoiseProbe(timer, cast(EventEmitter, sent))
    timer._local_sq, timer._global_sq = [torch.tensor(1.0)], [torch.tensor(0.5)]
    probe.after_step(1)  # no batch sizes: the user's own loader
    assert not timer.grad_norms and sent.events == []
