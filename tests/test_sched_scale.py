"""The scheduler at day 30 costs what it cost at day 1: decision work follows the live state
(queued and running jobs, free slots), never the history of finished jobs.

Counted in work units (``Scheduler.work``), not wall-clock time: the figures are exact and the
same on every machine. Times are in ``benchmarks/scheduler.py``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from nbtrain.core.placement import Layout
from nbtrain.core.sched_types import (
    Event,
    Finished,
    JobRequest,
    PreemptJob,
    Released,
    ResizeJob,
    SchedulerConfig,
    StartJob,
    Submit,
)
from nbtrain.core.scheduler import Scheduler
from nbtrain.core.topology import Topology


class _ScanCounter(dict):  # type: ignore[type-arg]
    """A dict that counts the entries any walk over it visits (lookups are free)."""

    visited = 0

    def _walk(self, it: Iterator[Any]) -> Iterator[Any]:
        for x in it:
            _ScanCounter.visited += 1
            yield x

    def __iter__(self) -> Iterator[Any]:
        return self._walk(super().__iter__())

    def values(self) -> Any:
        return self._walk(iter(super().values()))

    def items(self) -> Any:
        return self._walk(iter(super().items()))

    def keys(self) -> Any:
        return self._walk(iter(super().keys()))


def _closed_loop(n_events: int, seed: int = 0) -> tuple[Scheduler, list[int], int]:
    """Keep the queue at a steady length on a small busy cluster: every job that starts for
    the first time is replaced by a new submission. Returns the scheduler, the work units of
    each event and the entries any walk over the book of all jobs visited while events were
    handled."""
    rng = np.random.default_rng(seed)
    topo = Topology.declare(8, 8, hosts_per_leaf=4)
    s = Scheduler(topo, SchedulerConfig(team_weights={"a": 1.0, "b": 2.0, "c": 1.0},
                                        max_wait_s=4 * 3600.0))
    s._jobs = _ScanCounter()  # every job ever submitted lives here
    s._by_num = _ScanCounter()
    pending: list[tuple[float, int, str, str, int]] = []  # (t, seq, kind, job, generation)
    duration: dict[str, float] = {}
    gen: dict[str, int] = {}
    started: set[str] = set()
    seq = 0
    n_jobs = 0

    def submit(t: float) -> Event:
        nonlocal n_jobs
        tp = int(rng.choice([1, 1, 2, 4, 8]))
        size = tp * int(2 ** rng.integers(0, 4 if tp < 8 else 2))
        elastic = size > tp and rng.random() < 0.2
        job_id = f"j{n_jobs}"
        n_jobs += 1
        duration[job_id] = float(rng.lognormal(np.log(1800.0), 1.0))
        return Submit(t, JobRequest(
            job_id=job_id, size=size, layout=Layout(tp=tp), min_size=tp if elastic else None,
            priority=int(rng.choice([0, 0, 0, 1, 2])), team=str(rng.choice(["a", "b", "c"])),
            est_duration_s=duration[job_id] * float(rng.uniform(1.0, 2.0)),
            checkpoint_every_s=900.0,
        ))

    work: list[int] = []
    queue = [submit(0.0) for _ in range(40)]  # the steady queue length
    t = 0.0
    walked = 0
    while len(work) < n_events:
        ev = queue.pop(0) if queue else None
        if ev is None:
            t, _, kind, job_id, g = heapq.heappop(pending)
            if g != gen[job_id]:
                continue  # made stale by a preemption or resize
            ev = Finished(t, job_id) if kind == "finish" else Released(t, job_id)
        before = s.work.total()
        _ScanCounter.visited = 0
        out = s.handle(ev)
        walked += _ScanCounter.visited
        work.append(s.work.total() - before)
        for d in out:
            if isinstance(d, StartJob | ResizeJob):
                gen[d.job_id] = gen.get(d.job_id, 0) + 1
                seq += 1
                heapq.heappush(pending, (t + duration[d.job_id], seq, "finish", d.job_id,
                                         gen[d.job_id]))
                if isinstance(d, StartJob) and d.job_id not in started:
                    started.add(d.job_id)
                    queue.append(submit(t))
            elif isinstance(d, PreemptJob):
                gen[d.job_id] = gen.get(d.job_id, 0) + 1
                seq += 1
                heapq.heappush(pending, (t + 30.0, seq, "release", d.job_id, gen[d.job_id]))
    return s, work, walked


@pytest.fixture(scope="module")
def long_run() -> tuple[Scheduler, list[int], int]:
    return _closed_loop(15_000)


def test_decision_work_of_the_last_1000_events_is_that_of_the_first(
    long_run: tuple[Scheduler, list[int], int],
) -> None:
    s, work, _ = long_run
    first, last = sum(work[:1000]), sum(work[-1000:])
    done = len(s.job_ids("done"))
    assert done > 5000, f"only {done} jobs finished: the run is too short to have a history"
    assert last <= 1.5 * first, (
        f"the last 1,000 decisions cost {last:,} work units, the first 1,000 {first:,}: "
        f"decision cost grows with the {done:,} finished jobs"
    )
    # The run is steady (a full cluster and a queue of 40 from the start), so the two ends
    # cost about the same both ways: this also catches a counter that stopped counting.
    assert first <= 1.5 * last


def test_no_decision_walks_the_book_of_all_jobs(
    long_run: tuple[Scheduler, list[int], int],
) -> None:
    _, _, walked = long_run
    assert walked == 0, f"decisions walked {walked:,} entries of the book of all jobs"


def test_live_indices_hold_only_live_jobs(long_run: tuple[Scheduler, list[int], int]) -> None:
    s, _, _ = long_run
    s.check_invariants()  # the indices agree with the jobs' states
    running = len(s.job_ids("running")) + len(s.job_ids("stopping"))
    assert running <= s.topo.n_slots
    assert len(s.queued()) <= 60
