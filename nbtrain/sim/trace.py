"""Job traces for the simulator: a seeded generator and a CSV loader/writer.

The generator follows what published cluster traces (Philly, Helios, Alibaba PAI) show: most
jobs are small and short, a few are very large and long (heavy tails in both size and
duration), and large jobs use tensor parallelism inside a node. ``load`` sets the arrival rate
so that the offered work is that fraction of the cluster's capacity.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from nbtrain.core.placement import Layout
from nbtrain.core.sched_types import JobRequest

__all__ = ["TEAMS", "TraceJob", "generate", "load_csv", "save_csv"]

TEAMS: dict[str, float] = {"vision": 1.0, "speech": 1.0, "nlp": 2.0, "llm": 4.0}
"""Default teams and fair-share weights of generated traces."""


@dataclass(frozen=True, kw_only=True)
class TraceJob:
    """One job of a trace. ``duration_s`` is the runtime at ``size`` ranks with no preemption;
    elastic jobs (``min_size``) run ``duration_s * size / ranks`` at another size.
    ``est_duration_s`` is what the user told the scheduler (a limit, usually too long).

    ``serial``, ``sync`` and ``sync_per_rank`` (all set or all ``None``) give the job a
    speedup curve (``nbtrain.sim.speedups``): then an elastic job runs at ``ranks`` with the
    speed ``step_s`` says, not in proportion to its ranks. ``max_size`` is how far a
    goodput-sized job may grow (default ``size``)."""

    job_id: str
    submit_s: float
    size: int
    duration_s: float
    priority: int = 0
    team: str = "default"
    tp: int = 1
    pp: int = 1
    min_size: int | None = None
    est_duration_s: float | None = None
    checkpoint_every_s: float | None = 1800.0
    max_size: int | None = None
    serial: float | None = None
    sync: float | None = None
    sync_per_rank: float | None = None

    def __post_init__(self) -> None:
        curve = (self.serial, self.sync, self.sync_per_rank)
        if any(v is None for v in curve) and any(v is not None for v in curve):
            raise ValueError(f"job {self.job_id!r}: serial, sync and sync_per_rank are set "
                             "together or not at all")
        if self.serial is not None and not 0.0 <= self.serial < 1.0:
            raise ValueError(f"job {self.job_id!r}: serial={self.serial!r} must be in [0, 1)")
        if any(v is not None and v < 0 for v in curve[1:]):
            raise ValueError(f"job {self.job_id!r}: sync and sync_per_rank must be >= 0")

    @property
    def has_curve(self) -> bool:
        return self.serial is not None

    def step_s(self, ranks: int) -> float:
        """Seconds per step at ``ranks`` (one per step on a single replica); without a
        curve, perfect scaling."""
        compute, comm = self.phases_s(ranks)
        return (self.serial or 0.0) + compute + comm

    def phases_s(self, ranks: int) -> tuple[float, float]:
        """``step_s(ranks)``'s compute (the part that shrinks with more replicas) and
        communication (the gradient all-reduce, from the second replica on) seconds."""
        k = max(1, ranks // (self.tp * self.pp))
        if self.serial is None or self.sync is None or self.sync_per_rank is None:
            return 1.0 / k, 0.0
        sync = self.sync + self.sync_per_rank * (k - 1) if k > 1 else 0.0
        return (1.0 - self.serial) / k, sync

    def request(self, sizing: str = "fixed") -> JobRequest:
        """The scheduler's request; ``sizing="goodput"`` opts an elastic job in (others
        stay fixed)."""
        goodput = sizing == "goodput" and self.min_size is not None and (
            self.min_size < self.size or (self.max_size or self.size) > self.size)
        return JobRequest(
            job_id=self.job_id,
            size=self.size,
            layout=Layout(tp=self.tp, pp=self.pp),
            min_size=self.min_size,
            priority=self.priority,
            team=self.team,
            est_duration_s=self.est_duration_s,
            checkpoint_every_s=self.checkpoint_every_s,
            sizing="goodput" if goodput else "fixed",
            max_size=self.max_size if goodput else None,
        )


def generate(
    n_jobs: int,
    capacity: int,
    *,
    load: float = 0.9,
    seed: int = 0,
    max_size: int = 1024,
    gpus_per_host: int = 8,
    teams: dict[str, float] | None = None,
    priorities: Sequence[tuple[int, float]] = ((0, 0.8), (1, 0.15), (2, 0.05)),
    size_alpha: float = 0.75,
    median_duration_s: float = 1800.0,
    duration_sigma: float = 1.2,
    elastic_fraction: float = 0.15,
    sweep_mean: float = 1.0,
) -> list[TraceJob]:
    """``n_jobs`` jobs whose offered work is ``load`` x ``capacity`` over the arrival window.

    Sizes are powers of two from 1 to ``min(max_size, capacity)`` with probability falling as
    ``2**(-size_alpha * k)``; durations are log-normal (median ``median_duration_s``, clipped to
    [60 s, 3 days]); teams are drawn in proportion to their weights; jobs of a whole host or
    more use ``tp = gpus_per_host``, and jobs of 8 hosts or more use ``pp = 2`` or ``4``.
    ``sweep_mean > 1`` submits jobs in sweeps (a hyperparameter search, a batch of ablations):
    groups of geometric size with that mean, arriving at one instant from one team with one
    size, layout and priority; bursts like these are what make queues form at a load below 1.
    """
    if n_jobs < 1 or capacity < 1 or not load > 0:
        raise ValueError(
            f"generate needs n_jobs >= 1, capacity >= 1 and load > 0; got n_jobs={n_jobs}, "
            f"capacity={capacity}, load={load}"
        )
    teams = dict(TEAMS if teams is None else teams)
    rng = np.random.default_rng(seed)
    top = int(math.log2(max(1, min(max_size, capacity))))
    ks = np.arange(top + 1)
    p = 2.0 ** (-size_alpha * ks)
    sizes = 2 ** rng.choice(ks, size=n_jobs, p=p / p.sum())
    durations = np.clip(
        rng.lognormal(math.log(median_duration_s), duration_sigma, size=n_jobs), 60.0, 3 * 86400.0
    )
    names = list(teams)
    w = np.asarray([teams[t] for t in names], dtype=float)
    team_pick = rng.choice(len(names), size=n_jobs, p=w / w.sum())
    prio_vals = np.asarray([pv for pv, _ in priorities])
    prio_p = np.asarray([pp for _, pp in priorities], dtype=float)
    prio = rng.choice(prio_vals, size=n_jobs, p=prio_p / prio_p.sum())
    over = rng.uniform(1.0, 2.0, size=n_jobs)
    pp_pick = rng.choice([1, 2, 4], size=n_jobs)
    # Sweeps: job i belongs to sweep group[i]; a sweep shares arrival, team, size, priority.
    if sweep_mean > 1.0:
        lengths = rng.geometric(1.0 / sweep_mean, size=n_jobs)
        group = np.repeat(np.arange(n_jobs), lengths)[:n_jobs]
        lead = np.searchsorted(group, group)  # index of each sweep's first job
        sizes, team_pick, prio, pp_pick = sizes[lead], team_pick[lead], prio[lead], pp_pick[lead]
    else:
        group = np.arange(n_jobs)
    work = float((sizes * durations).sum())
    window = work / (load * capacity)
    n_groups = int(group[-1]) + 1
    gaps = rng.exponential(window / n_groups, size=n_groups)
    submit = (np.cumsum(gaps) - gaps[0])[group]
    elastic = rng.uniform(size=n_jobs) < elastic_fraction
    out: list[TraceJob] = []
    width = len(str(n_jobs - 1))
    for i in range(n_jobs):
        size = int(sizes[i])
        tp = gpus_per_host if size >= gpus_per_host else 1
        pp = int(pp_pick[i]) if size >= 8 * gpus_per_host else 1
        replica = tp * pp
        min_size = None
        if elastic[i] and size >= 2 * replica:
            min_size = max(replica, size // 2 // replica * replica)
        out.append(
            TraceJob(
                job_id=f"j{i:0{width}d}",
                submit_s=round(float(submit[i]), 3),
                size=size,
                duration_s=round(float(durations[i]), 3),
                priority=int(prio[i]),
                team=names[int(team_pick[i])],
                tp=tp,
                pp=pp,
                min_size=min_size,
                est_duration_s=round(float(durations[i] * over[i]), 3),
            )
        )
    return out


_COLUMNS = [f.name for f in fields(TraceJob)]
_REQUIRED = ("job_id", "submit_s", "size", "duration_s")


def save_csv(jobs: Iterable[TraceJob], path: str | Path) -> None:
    """Write a trace; empty cells stand for ``None``."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=_COLUMNS)
        writer.writeheader()
        for job in jobs:
            row = {k: ("" if v is None else v) for k, v in asdict(job).items()}
            writer.writerow(row)


def load_csv(path: str | Path) -> list[TraceJob]:
    """Read a trace CSV. Required columns: job_id, submit_s, size, duration_s; optional:
    priority, team, tp, pp, min_size, est_duration_s, checkpoint_every_s, max_size, serial,
    sync, sync_per_rank. Sorted by submit_s."""
    out: list[TraceJob] = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in _REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"trace {str(path)!r} lacks columns {missing}; it needs at least "
                f"{list(_REQUIRED)} (optional: {[c for c in _COLUMNS if c not in _REQUIRED]})"
            )
        for n, row in enumerate(reader, start=2):
            try:
                out.append(_row(row))
            except (TypeError, ValueError) as err:
                raise ValueError(f"trace {str(path)!r} line {n}: {err}") from None
    out.sort(key=lambda j: (j.submit_s, j.job_id))
    return out


def _row(row: dict[str, str]) -> TraceJob:
    def opt(name: str, cast: type) -> object:
        value = (row.get(name) or "").strip()
        return None if value == "" else cast(value)

    kwargs: dict[str, object] = {
        "job_id": row["job_id"],
        "submit_s": float(row["submit_s"]),
        "size": int(row["size"]),
        "duration_s": float(row["duration_s"]),
    }
    for name, cast in (("priority", int), ("team", str), ("tp", int), ("pp", int)):
        value = opt(name, cast)
        if value is not None:
            kwargs[name] = value
    kwargs["min_size"] = opt("min_size", int)
    kwargs["est_duration_s"] = opt("est_duration_s", float)
    kwargs["max_size"] = opt("max_size", int)
    for name in ("serial", "sync", "sync_per_rank"):
        kwargs[name] = opt(name, float)
    if "checkpoint_every_s" in row:
        kwargs["checkpoint_every_s"] = opt("checkpoint_every_s", float)
    job = TraceJob(**kwargs)  # type: ignore[arg-type]
    job.request()  # validates size against the layout, naming the job
    return job
