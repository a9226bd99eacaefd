"""Discrete-event replay of a trace through the core gang scheduler.

The simulator plays the engine's part: it turns trace arrivals and job ends into scheduler
events, carries out the decisions (start, preempt, resize) on simulated time, and feeds back
``Finished`` and ``Released``. It is deterministic: one trace and one config give one schedule
(``SimResult.schedule_hash``).

Work model: a job needs ``size * duration_s`` slot-seconds of work and progresses at its
allocated size (or, for a job with a speedup curve, ``TraceJob.step_s``, at the speed the
curve gives that size), slowed by a poor placement (``Ledger.slowdown``: TP over the network makes a
step longer). A preempted job checkpoints within ``checkpoint_write_s`` (kept if that is
within the grace period, otherwise the ranks are killed at the grace period and the job falls
back to its last periodic checkpoint); each restart costs ``restart_s`` before progress resumes.

Under ``policy="goodput"`` (nbtrain's policy with the trace's elastic jobs goodput-sized) the
simulator also plays the ranks' part of measuring: ``measure_after_s`` after each start or
resize of such a job, and every ``measure_every_s`` after that, it sends ``StepTimes`` with
the curve's step time at the job's size and its compute and communication parts (as the
ranks' step rows split them), with ``measure_noise`` relative jitter, and the steps it has
left (as a live job's ``steps`` and step rows tell the controller).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import numpy.typing as npt

from nbtrain.core.placement import Layout
from nbtrain.core.sched_types import (
    Event,
    Finished,
    PreemptJob,
    RejectJob,
    Released,
    ResizeJob,
    SchedulerConfig,
    StartJob,
    StepTimes,
    Submit,
)
from nbtrain.core.scheduler import Scheduler
from nbtrain.core.topology import Topology
from nbtrain.sim.ledger import Ledger, SimResult
from nbtrain.sim.progress import JobEnd, Meter, Progress
from nbtrain.sim.trace import TEAMS, TraceJob

__all__ = ["GANG_POLICIES", "SIZING_POLICIES", "simulate_gang"]

IntArray = npt.NDArray[np.int64]

GANG_POLICIES: dict[str, SchedulerConfig] = {
    "nbtrain": SchedulerConfig(),
    "fifo": SchedulerConfig(order="fifo", backfill=False, preemption=False, fair_share=False,
                            elastic_grow=False),
    "first_fit": SchedulerConfig(placement="first_fit"),
    "random": SchedulerConfig(placement="random"),
}
"""Policies that drive ``nbtrain.core.Scheduler``: nbtrain's own, FIFO gang without backfill,
and nbtrain's queueing with naive placement (first fit, random)."""

SIZING_POLICIES: dict[str, str] = {"goodput": "nbtrain"}
"""Policies that run a ``GANG_POLICIES`` config with the trace's elastic jobs goodput-sized
(``JobRequest.sizing="goodput"``)."""


@dataclass
class _Run:
    job: TraceJob
    layout: Layout
    remaining: float  # slot-seconds of work left (at ideal speed)
    gen: int = 0
    slowdown: float = 1.0
    idx: IntArray | None = None
    seg_start: float = 0.0
    overhead: float = 0.0
    restarts: int = 0
    done: bool = False

    def rate(self, n: int) -> float:
        """Work (slot-seconds at the requested size) done per second on ``n`` ranks."""
        j = self.job
        if not j.has_curve:
            return n
        return j.size * j.step_s(j.size) / j.step_s(n)


def simulate_gang(
    topology: Topology,
    trace: Sequence[TraceJob],
    policy: str | SchedulerConfig = "nbtrain",
    *,
    team_weights: Mapping[str, float] | None = None,
    seed: int = 0,
    checkpoint_write_s: float = 30.0,
    restart_s: float = 60.0,
    horizon_s: float | None = None,
    window_end: float | None = None,
    warmup: float = 0.2,
    exposed: Mapping[str, float] | None = None,
    progress: Callable[[Progress], None] | None = None,
    progress_every_s: float = 5.0,
    on_job_end: Callable[[JobEnd], None] | None = None,
    measure_after_s: float = 120.0,
    measure_every_s: float = 1800.0,
    measure_noise: float = 0.05,
    sizing: str | None = None,
) -> SimResult:
    """Replay ``trace`` on ``topology`` under a gang policy (a name in ``GANG_POLICIES`` or a
    ``SchedulerConfig``). ``horizon_s`` stops the clock early. Utilization and fair share are
    measured from ``warmup * window_end`` to ``window_end`` (default: the last arrival), the
    stretch where the offered load holds; JCT and waits cover every job.

    ``progress`` is called at most every ``progress_every_s`` wall seconds, ``on_job_end`` as
    each job finishes or is rejected (see ``nbtrain.sim.progress``). ``sizing="goodput"``
    goodput-sizes the elastic jobs under any config (default: only for the goodput
    policy)."""
    chosen = sizing
    sizing = "fixed"
    if isinstance(policy, str):
        if policy in SIZING_POLICIES:
            sizing = "goodput"
            name, cfg = policy, GANG_POLICIES[SIZING_POLICIES[policy]]
        elif policy not in GANG_POLICIES:
            raise ValueError(f"unknown gang policy {policy!r}; choose from "
                             f"{[*GANG_POLICIES, *SIZING_POLICIES]}")
        else:
            name, cfg = policy, GANG_POLICIES[policy]
    else:
        name, cfg = "custom", policy
    sizing = chosen or sizing
    weights = dict(team_weights if team_weights is not None else _weights(trace))
    cfg = replace(cfg, team_weights=weights, seed=seed)
    sched = Scheduler(topology, cfg)
    jobs = {j.job_id: j for j in trace}
    if len(jobs) != len(trace):
        raise ValueError("trace job ids must be unique")
    last_arrival = max((j.submit_s for j in trace), default=0.0)
    end = window_end if window_end is not None else (horizon_s or last_arrival or 1.0)
    led = Ledger(topology, jobs, weights, end, window_start=warmup * end, exposed=exposed)
    runs = {j.job_id: _Run(j, Layout(tp=j.tp, pp=j.pp), j.size * j.duration_s) for j in trace}
    reqs = {j.job_id: j.request(sizing) for j in trace}
    measured = {k for k, r in reqs.items() if r.goodput_sized}
    noise = np.random.default_rng([seed, 2029])
    heap: list[tuple[float, int, int, str, str, int]] = []
    seq = 0
    for j in trace:
        heap.append((j.submit_s, 1, seq, "arrive", j.job_id, 0))
        seq += 1
    heapq.heapify(heap)
    grace = cfg.preempt_grace_s
    meter = Meter(name, len(trace), progress, progress_every_s)

    def ended(job_id: str, finish: float | None) -> None:
        if on_job_end is not None:
            tj = jobs[job_id]
            on_job_end(JobEnd(
                policy=name, job_id=job_id, team=tj.team, priority=tj.priority, size=tj.size,
                submit=tj.submit_s, start=led.starts.get(job_id), finish=finish,
                rejected=finish is None,
            ))

    wall0 = time.perf_counter()
    t = 0.0
    while heap:
        t, _, _, kind, job_id, gen = heapq.heappop(heap)
        if horizon_s is not None and t > horizon_s:
            t = horizon_s
            break
        run = runs[job_id]
        event: Event
        if kind == "arrive":
            event = Submit(t, reqs[job_id])
            led.waiting += 1
        elif gen != run.gen:
            continue  # a finish made stale by a preemption or resize
        elif kind == "measure":
            if run.idx is None:
                continue  # it finished in this generation
            n = int(run.idx.shape[0])
            scale = run.slowdown * float(noise.lognormal(0.0, measure_noise))
            compute, comm = run.job.phases_s(n)
            event = StepTimes(t, job_id, n, run.job.step_s(n) * scale, steps=100.0,
                              compute_s=compute * scale, comm_s=comm * scale,
                              steps_left=_steps_left(run, t))
            seq += 1
            heapq.heappush(heap, (t + measure_every_s, 1, seq, "measure", job_id, gen))
        elif kind == "finish":
            assert run.idx is not None
            led.seg_close(t, job_id)
            led.unhold(run.idx)
            led.finishes[job_id] = t
            run.done = True
            run.idx = None
            ended(job_id, t)
            event = Finished(t, job_id)
        else:  # release after a preemption
            assert run.idx is not None
            led.unhold(run.idx)
            run.idx = None
            led.waiting += 1
            event = Released(t, job_id)
        work0 = sched.work.total()
        t0 = time.perf_counter()
        decisions = sched.handle(event)
        led.decision_s.append(time.perf_counter() - t0)
        led.decision_work.append(sched.work.total() - work0)
        for d in decisions:
            run = runs[d.job_id]
            if isinstance(d, StartJob):
                idx = np.asarray(d.placement.indices, dtype=np.int64)
                led.log(t, "start", d.job_id, d.placement.indices)
                led.waiting -= 1
                run.gen += 1
                run.overhead = restart_s if run.restarts else 0.0
                run.idx, run.seg_start = idx, t
                led.hold(idx)
                run.slowdown = led.seg_open(t, d.job_id, idx, run.layout)
                seq += 1
                heapq.heappush(heap, (_finish_at(run, t), 0, seq, "finish", d.job_id, run.gen))
                if d.job_id in measured:
                    seq += 1
                    heapq.heappush(heap, (t + run.overhead + measure_after_s, 1, seq,
                                          "measure", d.job_id, run.gen))
            elif isinstance(d, PreemptJob):
                led.log(t, "preempt", d.job_id)
                led.preemptions += 1
                run.gen += 1
                run.restarts += 1
                delay = _progress(run, t, d.grace_s, checkpoint_write_s)
                led.seg_close(t, d.job_id)
                seq += 1
                heapq.heappush(heap, (t + delay, 0, seq, "release", d.job_id, run.gen))
            elif isinstance(d, ResizeJob):
                idx = np.asarray(d.placement.indices, dtype=np.int64)
                led.log(t, "resize", d.job_id, d.placement.indices)
                led.resizes += 1
                assert run.idx is not None
                _progress(run, t, grace, checkpoint_write_s)
                led.seg_close(t, d.job_id)
                led.unhold(run.idx)
                run.gen += 1
                run.restarts += 1
                run.overhead = restart_s
                run.idx, run.seg_start = idx, t
                led.hold(idx)
                run.slowdown = led.seg_open(t, d.job_id, idx, run.layout)
                seq += 1
                heapq.heappush(heap, (_finish_at(run, t), 0, seq, "finish", d.job_id, run.gen))
                if d.job_id in measured:
                    seq += 1
                    heapq.heappush(heap, (t + run.overhead + measure_after_s, 1, seq,
                                          "measure", d.job_id, run.gen))
            elif isinstance(d, RejectJob):
                led.log(t, "reject", d.job_id)
                led.rejected.add(d.job_id)
                led.waiting -= 1
                ended(d.job_id, None)
        led.sample(t)
        meter.step(t, len(led.finishes) + len(led.rejected), led.waiting, len(led.open))
    meter.done(t, len(led.finishes) + len(led.rejected), led.waiting, len(led.open))
    led.close_all(t)
    wall = time.perf_counter() - wall0
    unfinished = sum(1 for r in runs.values() if not r.done and r.job.job_id not in led.rejected)
    # With no horizon the heap ran dry: a job still waiting then can never run (a deadlock).
    deadlocks = 0 if horizon_s is not None else unfinished
    res = led.result(name, deadlocks=deadlocks, stuck=unfinished, wall_s=wall)
    res.final_owners = sched.owners()
    res.work = asdict(sched.work)
    try:
        sched.check_invariants()
    except AssertionError as err:  # pragma: no cover - a scheduler bug, surfaced loudly
        raise RuntimeError(f"scheduler invariant broken after the run: {err}") from err
    return res


def _finish_at(run: _Run, t: float) -> float:
    assert run.idx is not None
    return float(t + run.overhead + run.remaining * run.slowdown / run.rate(run.idx.shape[0]))


def _steps_left(run: _Run, t: float) -> float:
    """The steps a running job has left at ``t``, as its step rows and ``steps`` would say:
    the time to its finish at its size and placement over the time a step takes there."""
    assert run.idx is not None
    left_s = max(0.0, _finish_at(run, run.seg_start) - max(t, run.seg_start + run.overhead))
    return left_s / (run.job.step_s(int(run.idx.shape[0])) * run.slowdown)


def _progress(run: _Run, t: float, grace: float, write_s: float) -> float:
    """Bank the work done since the segment started; return when the slots are released."""
    assert run.idx is not None
    ran = max(0.0, t - run.seg_start - run.overhead)
    if write_s <= grace:
        kept, delay = ran, write_s
    else:
        every = run.job.checkpoint_every_s
        kept = math.floor(ran / every) * every if every else 0.0
        delay = grace
    run.remaining = max(0.0, run.remaining - kept * run.rate(run.idx.shape[0]) / run.slowdown)
    return delay


def _weights(trace: Sequence[TraceJob]) -> dict[str, float]:
    teams = sorted({j.team for j in trace})
    return {t: TEAMS.get(t, 1.0) for t in teams}
