"""Speedup curves for trace jobs: how fast each job runs at each size (for goodput sizing).

Each job gets a step-time curve of the form the scheduler fits (``nbtrain.core.speedup``),
normalised to one second per step on one data-parallel replica::

    step(k) = serial + (1 - serial) / k + [k > 1] * (sync + per_rank * (k - 1))

with ``k`` the job's data-parallel degree (ranks / (tp*pp)). The parameters are drawn per job
from one of four workload classes, named after the kinds of model Pollux evaluates (Qiao et
al., OSDI'21, Table 1: ResNet-50 on ImageNet, BERT fine-tuning, YOLOv3 and DeepSpeech2,
ResNet-18 on CIFAR-10 and NeuMF on MovieLens), which that paper and Sia (Jayaram Subramanya et
al., SOSP'23) report to range from near-linear scaling to saturating within a node. The
ranges below are ours, chosen to give those shapes (speedups at 8 and 64 replicas of about
7 and 30, 6 and 12, 6 and 15, 4 and 4); they are not figures read from the papers' tables.

``with_speedups`` attaches curves to a trace (and, optionally, makes a share of its jobs
goodput-sizable) from its own seeded stream, so the trace's other columns are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from nbtrain.sim.trace import TraceJob

__all__ = ["WORKLOADS", "with_speedups"]

# class: (share of jobs, serial range, sync range, per-rank range)
WORKLOADS: dict[str, tuple[float, tuple[float, float], tuple[float, float],
                           tuple[float, float]]] = {
    "cnn-imagenet": (0.3, (0.002, 0.005), (0.005, 0.015), (1e-5, 5e-5)),
    "transformer-finetune": (0.3, (0.005, 0.01), (0.03, 0.06), (1e-4, 3e-4)),
    "detection-speech": (0.2, (0.01, 0.02), (0.02, 0.04), (5e-5, 1.5e-4)),
    "small-model": (0.2, (0.03, 0.06), (0.05, 0.15), (5e-4, 2e-3)),
}


def with_speedups(trace: Sequence[TraceJob], *, seed: int = 0,
                  elastic_fraction: float | None = None,
                  max_size: int | None = None) -> list[TraceJob]:
    """``trace`` with a speedup curve on every job. With ``elastic_fraction``, that share of
    the jobs of at least two replicas becomes elastic from one replica up to twice its size
    (at most ``max_size``), the others fixed; without it, the trace's elastic jobs keep
    their ``min_size`` and may grow to twice their size."""
    rng = np.random.default_rng([seed, 29])  # a stream of its own: other columns unchanged
    names = list(WORKLOADS)
    share = np.asarray([WORKLOADS[n][0] for n in names])
    pick = rng.choice(len(names), size=len(trace), p=share / share.sum())
    u = rng.uniform(size=(len(trace), 3))
    flip = rng.uniform(size=len(trace))
    out = []
    for i, job in enumerate(trace):
        _, serial, sync, per_rank = WORKLOADS[names[int(pick[i])]]
        a, c, d = (lo + (hi - lo) * float(x)
                   for (lo, hi), x in zip((serial, sync, per_rank), u[i], strict=True))
        replica = job.tp * job.pp
        min_size = job.min_size
        if elastic_fraction is not None:
            min_size = replica if (flip[i] < elastic_fraction and job.size >= 2 * replica) \
                else None
        top = 2 * job.size if max_size is None else min(2 * job.size, max(job.size, max_size))
        top = top // replica * replica
        out.append(dataclasses.replace(
            job, min_size=min_size, max_size=top if min_size is not None else None,
            serial=round(a, 6), sync=round(c, 6), sync_per_rank=round(d, 8)))
    return out
