"""What a long replay tells while it runs: progress snapshots and one record per job that ended.

A replay of 100,000 jobs takes minutes; ``simulate_gang`` and ``simulate_greedy`` call a
``progress`` callback with a ``Progress`` at most every ``every_s`` wall seconds (never for a
replay shorter than that) and an ``on_job_end`` callback with a ``JobEnd`` as each job
finishes or is rejected, so results can be streamed (``nbtrain simulate --stream``) before
the replay is over. Neither changes the replay: they only read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

__all__ = ["JobEnd", "Meter", "Progress"]


@dataclass(frozen=True)
class Progress:
    """A replay in progress. ``events_per_s`` is scheduler events (each one decision pass)
    handled per wall second since the previous report."""

    policy: str
    jobs_done: int  # finished or rejected
    jobs_total: int
    sim_s: float  # simulated time reached
    events: int
    wall_s: float
    events_per_s: float
    waiting: int  # jobs submitted and not running
    running: int  # jobs running as a whole gang

    def line(self) -> str:
        """One line for a terminal, e.g. ``nbtrain: 41,200/100,000 jobs, 211.4 sim h, ...``."""
        return (
            f"{self.policy}: {self.jobs_done:,}/{self.jobs_total:,} jobs, "
            f"{self.sim_s / 3600:,.1f} sim h, {self.events:,} decisions "
            f"({self.events_per_s:,.0f}/s), {self.waiting:,} waiting, {self.running:,} running, "
            f"{self.wall_s:,.0f} s"
        )


@dataclass(frozen=True)
class JobEnd:
    """One job that finished (``finish`` set) or was rejected (``rejected``)."""

    policy: str
    job_id: str
    team: str
    priority: int
    size: int
    submit: float
    start: float | None
    finish: float | None
    rejected: bool = False

    def as_dict(self) -> dict[str, object]:
        """JSON-ready, with ``wait`` and ``jct`` (seconds) when known."""
        out = asdict(self)
        if self.start is not None:
            out["wait"] = self.start - self.submit
        if self.finish is not None:
            out["jct"] = self.finish - self.submit
        return out


class Meter:
    """Counts events of one replay and reports a ``Progress`` at most every ``every_s`` s."""

    def __init__(
        self,
        policy: str,
        jobs_total: int,
        report: Callable[[Progress], None] | None,
        every_s: float,
    ) -> None:
        self.policy = policy
        self.jobs_total = jobs_total
        self.report = report
        self.every_s = every_s
        self.events = 0
        self._t0 = time.perf_counter()
        self._last_t = self._t0
        self._last_events = 0
        self._reported = False

    def step(self, sim_s: float, jobs_done: int, waiting: int, running: int) -> None:
        """After each event; reports when ``every_s`` has passed since the last report."""
        self.events += 1
        if self.report is None:
            return
        now = time.perf_counter()
        if now - self._last_t >= self.every_s:
            self._emit(now, sim_s, jobs_done, waiting, running)

    def done(self, sim_s: float, jobs_done: int, waiting: int, running: int) -> None:
        """At the end: a last report, if the replay was long enough to have had any."""
        if self.report is not None and self._reported:
            self._emit(time.perf_counter(), sim_s, jobs_done, waiting, running)

    def _emit(self, now: float, sim_s: float, jobs_done: int, waiting: int, running: int) -> None:
        assert self.report is not None
        rate = (self.events - self._last_events) / max(now - self._last_t, 1e-9)
        self._last_t, self._last_events = now, self.events
        self._reported = True
        self.report(Progress(
            policy=self.policy, jobs_done=jobs_done, jobs_total=self.jobs_total, sim_s=sim_s,
            events=self.events, wall_s=now - self._t0, events_per_s=rate, waiting=waiting,
            running=running,
        ))
