"""Goodput accounting: how much of a job's wall time was productive training (pure).

The engine tells the ledger what phase the job is in and what happened, with times it reads
from its own clock; the ledger never reads a clock. Phases:

- ``queued``: waiting for a gang of slots (also after preemption);
- ``startup``: the first generation's ranks starting (rendezvous, imports, ``setup``);
- ``recovery``: from a fault's detection to the next generation's first step;
- ``training``: steps running.

Training time is split further: checkpoint blocking (the loop's snapshot copies), lost work
(steps computed and then rolled back by a restart from an older checkpoint) and the rest,
which is productive. Steps after the newest committed checkpoint are lost by a restart; the
steps before it only when the ranks restore an older one (the newest unreadable), so the
ledger keeps per-step times for the former and for the last ``RECENT_STEPS`` of the latter.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PHASES = ("queued", "startup", "recovery", "training", "ended")
#: Committed steps whose times the ledger keeps, for a restore that falls back past them.
RECENT_STEPS = 4096


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    queued_s: float
    startup_s: float
    checkpoint_s: float
    recovery_s: float
    lost_s: float
    lost_steps: int

    @property
    def fraction(self) -> float:
        """Productive share of wall time (0 when no time has passed)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "wall_s": self.wall_s, "productive_s": self.productive_s,
            "queued_s": self.queued_s, "startup_s": self.startup_s,
            "checkpoint_s": self.checkpoint_s, "recovery_s": self.recovery_s,
            "lost_s": self.lost_s, "lost_steps": float(self.lost_steps),
            "fraction": self.fraction,
        }


class GoodputLedger:
    """Accumulates phase durations and step outcomes of one job."""

    def __init__(self, now: float) -> None:
        self._start = now
        self._phase = "queued"
        self._since = now
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._checkpoint_s = 0.0
        self._lost_s = 0.0
        self._lost_steps = 0
        self._uncommitted: dict[int, float] = {}  # step -> seconds, after the last commit
        self._committed_step = 0
        self._rolled_back: dict[int, float] = {}  # the last rollback's steps, until a resume
        # Committed steps, the newest RECENT_STEPS, oldest first.
        self._recent: OrderedDict[int, float] = OrderedDict()

    @property
    def phase(self) -> str:
        return self._phase

    def in_phase_s(self, now: float) -> float:
        """Seconds since the job entered its current phase (a queued job: this wait)."""
        return max(0.0, now - self._since)

    def enter(self, phase: str, now: float) -> None:
        """The job moved to ``phase`` at ``now``."""
        if phase not in PHASES:
            raise ValueError(f"unknown goodput phase {phase!r}; one of {', '.join(PHASES)}")
        self._totals[self._phase] += max(0.0, now - self._since)
        self._phase = phase
        self._since = now

    def step(self, step: int, seconds: float) -> None:
        """Rank 0 finished ``step`` taking ``seconds``."""
        if step > self._committed_step:
            self._uncommitted[step] = seconds

    def checkpoint_blocked(self, seconds: float) -> None:
        self._checkpoint_s += max(0.0, seconds)

    def committed(self, step: int) -> None:
        """A checkpoint of ``step`` committed: steps up to it can no longer be lost."""
        if step > self._committed_step:
            self._committed_step = step
            self._keep_committed(step)

    def _keep_committed(self, step: int) -> None:
        """Steps up to ``step`` are committed: keep their times (bounded) among the recent."""
        # Committed in step order (a fall-back drops the newer ones first), so the oldest
        # steps come first and leave first.
        self._recent.update(sorted((s, t) for s, t in self._uncommitted.items() if s <= step))
        self._uncommitted = {s: t for s, t in self._uncommitted.items() if s > step}
        while len(self._recent) > RECENT_STEPS:
            self._recent.popitem(last=False)

    def rollback(self, to_step: int) -> int:
        """A restart resumes after ``to_step``: later steps were lost. Returns how many."""
        lost = {s: t for s, t in self._uncommitted.items() if s > to_step}
        self._lost_s += sum(lost.values())
        self._lost_steps += len(lost)
        self._uncommitted = {s: t for s, t in self._uncommitted.items() if s <= to_step}
        self._rolled_back = lost
        return len(lost)

    def resumed_at(self, step: int) -> int:
        """The ranks restored ``step`` and train on from it; returns how many steps the
        restart lost in all (the last rollback's, corrected).

        Newer than the last rollback's step (a checkpoint committed that the controller had
        not heard of when it rolled back): the steps up to it were not lost after all and
        are no longer counted. Older than the newest commit (the ranks fell back past an
        unreadable checkpoint): the committed steps after it are computed again, so they
        are lost too."""
        regained = {s: t for s, t in self._rolled_back.items() if s <= step}
        self._lost_s -= sum(regained.values())
        self._lost_steps -= len(regained)
        lost = len(self._rolled_back) - len(regained)
        self._rolled_back = {}
        if step > self._committed_step:
            self._committed_step = step
            self._keep_committed(step)
        elif step < self._committed_step:
            while self._recent and next(reversed(self._recent)) > step:
                _, seconds = self._recent.popitem()  # the newest: computed again
                self._lost_s += seconds
                self._lost_steps += 1
                lost += 1
            self._committed_step = step
        return lost

    def snapshot(self, now: float) -> Goodput:
        totals = dict(self._totals)
        totals[self._phase] += max(0.0, now - self._since)
        training = totals["training"]
        productive = max(0.0, training - self._checkpoint_s - self._lost_s)
        return Goodput(
            wall_s=max(0.0, now - self._start) - totals["ended"],
            productive_s=productive,
            queued_s=totals["queued"],
            startup_s=totals["startup"],
            checkpoint_s=min(self._checkpoint_s, training),
            recovery_s=totals["recovery"],
            lost_s=min(self._lost_s, training),
            lost_steps=self._lost_steps,
        )
