"""Baseline: greedy per-rank scheduling with no gang admission (what a plain pod scheduler does).

Every rank of every waiting job is placed on its own as soon as any slot is free; pending
ranks of waiting jobs take turns (the retry order of unschedulable pods), and a job runs only
once all its ranks are placed. Nothing stops two jobs from each holding part of the cluster and
waiting for the rest: a deadlock. The simulator counts each one and, after
``deadlock_timeout_s`` (an operator noticing), frees the partial holdings and lets the oldest
job gather its slots first, so the run can go on and the cost of the deadlock shows up in
utilization and waiting time.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nbtrain.core.placement import Layout
from nbtrain.core.topology import Topology
from nbtrain.sim.ledger import Ledger, SimResult
from nbtrain.sim.progress import JobEnd, Meter, Progress
from nbtrain.sim.trace import TEAMS, TraceJob

__all__ = ["simulate_greedy"]


@dataclass
class _Wait:
    job: TraceJob
    held: list[int] = field(default_factory=list)


def simulate_greedy(
    topology: Topology,
    trace: Sequence[TraceJob],
    *,
    team_weights: Mapping[str, float] | None = None,
    deadlock_timeout_s: float = 1800.0,
    horizon_s: float | None = None,
    window_end: float | None = None,
    warmup: float = 0.2,
    exposed: Mapping[str, float] | None = None,
    progress: Callable[[Progress], None] | None = None,
    progress_every_s: float = 5.0,
    on_job_end: Callable[[JobEnd], None] | None = None,
) -> SimResult:
    """Replay ``trace`` with per-rank greedy allocation; elastic jobs run at full size.
    Measurement windows, ``progress`` and ``on_job_end`` as in ``simulate_gang`` (here one
    event is one allocation round)."""
    jobs = {j.job_id: j for j in trace}
    weights = dict(team_weights or {t: TEAMS.get(t, 1.0) for t in sorted({j.team for j in trace})})
    last_arrival = max((j.submit_s for j in trace), default=0.0)
    end = window_end if window_end is not None else (horizon_s or last_arrival or 1.0)
    led = Ledger(topology, jobs, weights, end, window_start=warmup * end, exposed=exposed)
    free: list[int] = list(range(topology.n_slots))  # a heap: lowest index first
    waiting: dict[str, _Wait] = {}
    running: dict[str, np.ndarray] = {}
    heap: list[tuple[float, int, int, str, str]] = []
    for seq, j in enumerate(trace):
        heap.append((j.submit_s, 1, seq, "arrive", j.job_id))
    heapq.heapify(heap)
    seq = len(heap)
    deadlocks = 0
    resolving = False
    meter = Meter("greedy", len(trace), progress, progress_every_s)

    def ended(job_id: str, finish: float | None) -> None:
        if on_job_end is not None:
            tj = jobs[job_id]
            on_job_end(JobEnd(
                policy="greedy", job_id=job_id, team=tj.team, priority=tj.priority,
                size=tj.size, submit=tj.submit_s, start=led.starts.get(job_id), finish=finish,
                rejected=finish is None,
            ))

    wall0 = time.perf_counter()
    t = 0.0
    while heap:
        t = heap[0][0]
        if horizon_s is not None and t > horizon_s:
            t = horizon_s
            break
        t0 = time.perf_counter()
        # Everything that happens at one instant lands before the next allocation round, as
        # the pods of jobs submitted together all wait in the scheduler's queue at once.
        while heap and heap[0][0] == t:
            _, _, _, kind, job_id = heapq.heappop(heap)
            if kind == "arrive":
                if jobs[job_id].size > topology.n_slots:
                    led.rejected.add(job_id)
                    ended(job_id, None)
                else:
                    waiting[job_id] = _Wait(jobs[job_id])
                    led.waiting += 1
            elif kind == "finish":
                idx = running.pop(job_id)
                led.seg_close(t, job_id)
                led.unhold(idx)
                led.finishes[job_id] = t
                ended(job_id, t)
                for i in idx.tolist():
                    heapq.heappush(free, i)
            elif kind == "resolve":
                resolving = False
                for w in waiting.values():
                    led.unhold(np.asarray(w.held, dtype=np.int64))
                    for i in w.held:
                        heapq.heappush(free, i)
                    w.held.clear()
                _fifo_fill(waiting, free, led)
        _round_robin(waiting, free, led)
        for jid in [k for k, w in waiting.items() if len(w.held) == w.job.size]:
            w = waiting.pop(jid)
            idx = np.asarray(w.held, dtype=np.int64)
            running[jid] = idx
            led.waiting -= 1
            led.log(t, "start", jid, tuple(w.held))
            slow = led.seg_open(t, jid, idx, Layout(tp=w.job.tp, pp=w.job.pp))
            seq += 1
            heapq.heappush(heap, (t + w.job.duration_s * slow, 0, seq, "finish", jid))
        led.decision_s.append(time.perf_counter() - t0)
        partial = sum(len(w.held) for w in waiting.values())
        if not free and not running and partial and not resolving:
            deadlocks += 1
            resolving = True
            led.log(t, "deadlock", partial)
            seq += 1
            heapq.heappush(heap, (t + deadlock_timeout_s, 0, seq, "resolve", ""))
        led.sample(t, held_partial=partial)
        meter.step(t, len(led.finishes) + len(led.rejected), led.waiting, len(running))
    meter.done(t, len(led.finishes) + len(led.rejected), led.waiting, len(running))
    led.close_all(t)
    unfinished = sum(1 for k in jobs if k not in led.finishes and k not in led.rejected)
    return led.result("greedy", deadlocks=deadlocks, stuck=unfinished,
                      wall_s=time.perf_counter() - wall0)


def _round_robin(waiting: dict[str, _Wait], free: list[int], led: Ledger) -> None:
    """Pending ranks take turns: each waiting job gets one slot per round, oldest first."""
    while free:
        needy = [w for w in waiting.values() if len(w.held) < w.job.size]
        if not needy:
            return
        for w in needy:
            if not free:
                return
            i = heapq.heappop(free)
            w.held.append(i)
            led.hold(np.asarray([i], dtype=np.int64))


def _fifo_fill(waiting: dict[str, _Wait], free: list[int], led: Ledger) -> None:
    """Deadlock recovery: the oldest jobs gather their whole gangs first."""
    for w in waiting.values():
        need = w.job.size - len(w.held)
        if need > len(free):
            return
        for _ in range(need):
            i = heapq.heappop(free)
            w.held.append(i)
            led.hold(np.asarray([i], dtype=np.int64))
