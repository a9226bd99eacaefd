"""What happened in a simulated run, and the metrics computed from it.

Utilization counts only slot-time of complete gangs (a rank waiting for its peers does no
work), so a scheduler that hands out slots rank by rank cannot look busy while deadlocked.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from nbtrain.core.placement import MESH_DIM_NAMES, CommCost, Layout, comm_cost, place_indices
from nbtrain.core.slotstate import SlotState
from nbtrain.core.topology import LEVELS, Topology
from nbtrain.sim.trace import TraceJob

__all__ = ["EXPOSED", "Ledger", "SimResult"]

EXPOSED: dict[str, float] = {"tp": 0.3, "cp": 0.2, "pp": 0.1, "dp": 0.05}
"""Share of an ideal step spent waiting on each dim's communication (see ``Ledger``)."""

IntArray = npt.NDArray[np.int64]


@dataclass
class SimResult:
    """Metrics of one policy on one trace (``metrics``), plus what the plots need."""

    policy: str
    metrics: dict[str, float]
    decision_ms: npt.NDArray[np.float64]
    schedule_hash: str
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    """(time, slots in running gangs, slots held by incomplete gangs, jobs waiting)"""
    jobs: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per job: submit, start (first), finish, wait, jct, size."""
    final_owners: list[str | None] = field(default_factory=list)
    work: dict[str, int] = field(default_factory=dict)
    """The gang scheduler's work counters at the end (``nbtrain.core.jobbook.Work``)."""
    decision_work: npt.NDArray[np.int64] = field(
        default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Work units (``Work.total``) of each decision, in order: the cost of a decision counted
    exactly, to compare early and late decisions of a replay on any machine (gang only)."""


@dataclass
class _Segment:
    job_id: str
    size: int
    t0: float
    cost: CommCost
    slowdown: float


class Ledger:
    """Accumulates segments of gang running time, job milestones and decision timings.

    Placement changes speed. For each mesh dim whose slowest link (``CommCost.dim_time``) is
    ``x`` times slower than in the job's best placement on an empty cluster, a step takes
    ``exposed[dim] * (x - 1)`` longer, where ``exposed[dim]`` is the share of an ideal step spent
    waiting on that dim's communication: high for TP (on the critical path of every layer),
    low for DP (overlapped with the backward pass). With the defaults, TP over 400 Gb/s instead
    of NVLink makes a step 3.4x longer, in the 2x-5x range reported for such placements.
    ``goodput`` counts work at ideal speed; ``util`` counts busy slots.
    """

    def __init__(
        self,
        topology: Topology,
        trace: Mapping[str, TraceJob],
        team_weights: Mapping[str, float],
        window_end: float,
        window_start: float = 0.0,
        exposed: Mapping[str, float] | None = None,
    ) -> None:
        self.topo = topology
        self.trace = trace
        self.weights = dict(team_weights)
        self.window_start = min(window_start, window_end)
        self.window_end = window_end
        ex = dict(EXPOSED if exposed is None else exposed)
        self.exposed = np.asarray([ex.get(d, 0.0) for d in MESH_DIM_NAMES])
        self._ideal: dict[tuple[int, Layout], npt.NDArray[np.float64]] = {}
        self.useful_window = 0.0
        self.free = np.ones(topology.n_slots, dtype=bool)
        self.open: dict[str, _Segment] = {}
        self.busy = 0  # slots in running gangs
        self.waiting = 0
        self.slot_s_window = 0.0
        self.slot_s_total = 0.0
        self.team_slot_s: dict[str, float] = {}
        self.traffic = np.zeros(len(LEVELS))
        self.tp_groups = 0
        self.tp_in_nvlink = 0
        self.starts: dict[str, float] = {}
        self.slowdowns: list[float] = []
        self.finishes: dict[str, float] = {}
        self.rejected: set[str] = set()
        self.preemptions = 0
        self.resizes = 0
        self.decision_s: list[float] = []
        self.decision_work: list[int] = []
        self.timeline: list[tuple[float, int, int, int]] = []
        self._hash = hashlib.sha256()
        self._frag_acc = 0.0
        self._frag_t = 0.0
        self._last_t = 0.0
        self._last_frag = 0.0
        nvl = topology.bounds["nvlink"]
        self._nvl_starts = nvl[:-1]
        self._nvl_sizes = np.diff(nvl)

    # -------------------------------------------------------------- recording
    def log(self, t: float, *parts: object) -> None:
        """Feed one decision into the schedule hash (same seed -> same hash)."""
        self._hash.update(repr((round(t, 6), *parts)).encode())

    def hold(self, idx: IntArray) -> None:
        self.free[idx] = False

    def unhold(self, idx: IntArray) -> None:
        self.free[idx] = True

    def slowdown(self, cost: CommCost, size: int, layout: Layout) -> float:
        """How much slower than on its best placement a job runs with this ``cost``."""
        got = np.asarray(cost.dim_time)
        if not (self.exposed > 0).any() or not got.any():
            return 1.0
        key = (size, layout)
        ideal = self._ideal.get(key)
        if ideal is None:
            best = place_indices(SlotState(self.topo), size, layout)
            ideal = got if best is None else np.asarray(
                comm_cost(self.topo, best, layout).dim_time)
            self._ideal[key] = ideal
        ratio = np.divide(got, ideal, out=np.ones_like(got), where=ideal > 0)
        return float(1.0 + (self.exposed * np.maximum(0.0, ratio - 1.0)).sum())

    def seg_open(self, t: float, job_id: str, idx: IntArray, layout: Layout) -> float:
        """A gang starts running on ``idx``; returns its slowdown factor."""
        cost = comm_cost(self.topo, idx, layout)
        slow = self.slowdown(cost, int(idx.shape[0]), layout)
        self.open[job_id] = _Segment(job_id, int(idx.shape[0]), t, cost, slow)
        self.slowdowns.append(slow)
        self.busy += int(idx.shape[0])
        self.tp_groups += cost.tp_groups
        self.tp_in_nvlink += cost.tp_in_nvlink
        self.starts.setdefault(job_id, t)
        return slow

    def seg_close(self, t: float, job_id: str) -> None:
        seg = self.open.pop(job_id)
        self.busy -= seg.size
        dur = max(0.0, t - seg.t0)
        self.slot_s_total += seg.size * dur
        lo, hi = self.window_start, self.window_end
        inside = max(0.0, min(t, hi) - max(seg.t0, lo))
        self.slot_s_window += seg.size * inside
        self.useful_window += seg.size * inside / seg.slowdown
        team = self.trace[job_id].team
        self.team_slot_s[team] = self.team_slot_s.get(team, 0.0) + seg.size * inside
        self.traffic += np.asarray(seg.cost.traffic) * dur

    def sample(self, t: float, held_partial: int = 0) -> None:
        """Call after each event's decisions: timeline point and fragmentation integral."""
        if t > self._last_t:
            lo = max(self._last_t, self.window_start)
            hi = min(t, self.window_end)
            if hi > lo:
                self._frag_acc += self._last_frag * (hi - lo)
                self._frag_t += hi - lo
            self._last_t = t
        free_per = np.add.reduceat(self.free.astype(np.int64), self._nvl_starts)
        total = int(free_per.sum())
        whole = int(free_per[free_per == self._nvl_sizes].sum())
        self._last_frag = 0.0 if total == 0 else 1.0 - whole / total
        self.timeline.append((t, self.busy, held_partial, self.waiting))

    def close_all(self, t: float) -> None:
        for job_id in list(self.open):
            self.seg_close(t, job_id)

    # -------------------------------------------------------------- results
    def result(self, policy: str, deadlocks: int, stuck: int, wall_s: float) -> SimResult:
        cap = self.topo.n_slots
        jobs: dict[str, dict[str, float]] = {}
        waits, jcts, large_waits = [], [], []
        large = max(2, cap // 16)
        for job_id, tj in self.trace.items():
            rec = {"submit": tj.submit_s, "size": float(tj.size)}
            if job_id in self.starts:
                rec["start"] = self.starts[job_id]
                rec["wait"] = self.starts[job_id] - tj.submit_s
                waits.append(rec["wait"])
                if tj.size >= large:
                    large_waits.append(rec["wait"])
            if job_id in self.finishes:
                rec["finish"] = self.finishes[job_id]
                rec["jct"] = self.finishes[job_id] - tj.submit_s
                jcts.append(rec["jct"])
            jobs[job_id] = rec
        shares = {t: self.team_slot_s.get(t, 0.0) for t in self.weights}
        x = np.asarray([shares[t] / self.weights[t] for t in self.weights], dtype=float)
        jain = float(x.sum() ** 2 / (len(x) * (x**2).sum())) if (x > 0).any() else 1.0
        total_share = sum(shares.values()) or 1.0
        dec = np.asarray(self.decision_s, dtype=float) * 1e3
        span = self.window_end - self.window_start
        metrics: dict[str, float] = {
            "util": self.slot_s_window / (cap * span) if span > 0 else 0.0,
            "goodput": self.useful_window / (cap * span) if span > 0 else 0.0,
            "slowdown_mean": float(np.mean(self.slowdowns)) if self.slowdowns else 1.0,
            "jct_mean_h": _mean(jcts) / 3600,
            "jct_p95_h": _pct(jcts, 95) / 3600,
            "wait_mean_h": _mean(waits) / 3600,
            "wait_p95_h": _pct(waits, 95) / 3600,
            "large_wait_mean_h": _mean(large_waits) / 3600,
            "jain": jain,
            "preemptions": float(self.preemptions),
            "resizes": float(self.resizes),
            "uplink_per_slot_h": float(self.traffic[LEVELS.index("pod") :].sum())
            / max(self.slot_s_total / 3600, 1e-9),
            "tp_in_nvlink": self.tp_in_nvlink / self.tp_groups if self.tp_groups else 1.0,
            "fragmentation": self._frag_acc / self._frag_t if self._frag_t > 0 else 0.0,
            "deadlocks": float(deadlocks),
            "unfinished": float(stuck),
            "rejected": float(len(self.rejected)),
            "finished": float(len(self.finishes)),
            "decision_p50_ms": float(np.percentile(dec, 50)) if dec.size else 0.0,
            "decision_p99_ms": float(np.percentile(dec, 99)) if dec.size else 0.0,
            "wall_s": wall_s,
        }
        for team in self.weights:
            metrics[f"share_{team}"] = shares[team] / total_share
        return SimResult(
            policy=policy,
            metrics=metrics,
            decision_ms=dec,
            schedule_hash=self._hash.hexdigest(),
            timeline=self.timeline,
            jobs=jobs,
            decision_work=np.asarray(self.decision_work, dtype=np.int64),
        )


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else math.nan


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan
