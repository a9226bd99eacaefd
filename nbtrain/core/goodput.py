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
ledger keeps per-step times for the former and for the last ``RECENT_STEPS`` of the latter
(older committed steps computed again count at the mean committed step time).

**A controller restart** (``carry``/``continued``): the journal holds the ledger's totals as
of its last journal write (plain numbers, bounded), and the restarted controller's ledger
continues them. The time from that write to the restart counts as recovery for a job that was
training (what it trained then was never committed as far as the journal knows), and in its
own phase otherwise; the steps after the newest commit are lost, as in any restart.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


class _Steps:
    """Seconds per step of a set of steps, bounded: the newest ``RECENT_STEPS`` one by one,
    older ones folded into one run (count, seconds, first and last step) that splits as if
    its steps were spread evenly over its span."""

    def __init__(self, each: Mapping[int, float] | None = None, n: int = 0, s: float = 0.0,
                 first: int = 0, last: int = 0) -> None:
        self.each: OrderedDict[int, float] = OrderedDict(each or {})
        self.n, self.s, self.first, self.last = n, s, first, last

    def add(self, step: int, seconds: float) -> None:
        self.each[step] = seconds
        while len(self.each) > RECENT_STEPS:
            old, t = self.each.popitem(last=False)
            self.first = min(self.first, old) if self.n else old
            self.last = max(self.last, old) if self.n else old
            self.n += 1
            self.s += t

    def count(self) -> int:
        return self.n + len(self.each)

    def seconds(self) -> float:
        return self.s + sum(self.each.values())

    def run(self) -> tuple[int, float, int, int]:
        """All of it as one run: (count, seconds, first step, last step); zeros if empty."""
        if not self.count():
            return (0, 0.0, 0, 0)
        first = self.first if self.n else min(self.each)
        return (self.count(), self.seconds(), first,
                max(self.last if self.n else 0, max(self.each, default=0)))

    @classmethod
    def of_runs(cls, *runs: Sequence[float] | None) -> _Steps:
        """One run holding the steps of ``runs`` (``run()``'s tuples; empty ones skipped)."""
        held = [r for r in runs if r and r[0] > 0]
        if not held:
            return cls()
        return cls(n=sum(int(r[0]) for r in held), s=sum(float(r[1]) for r in held),
                   first=min(int(r[2]) for r in held), last=max(int(r[3]) for r in held))

    def split(self, at: int) -> tuple[_Steps, _Steps]:
        """(the steps up to ``at``, the steps after it)."""
        upto = _Steps({k: v for k, v in self.each.items() if k <= at})
        after = _Steps({k: v for k, v in self.each.items() if k > at})
        if self.n:
            if at >= self.last:
                k = self.n
            elif at < self.first:
                k = 0
            else:
                k = round(self.n * (at - self.first + 1) / (self.last - self.first + 1))
            mean = self.s / self.n
            if k:
                upto.n, upto.s, upto.first, upto.last = k, k * mean, self.first, min(at, self.last)
            if self.n - k:
                after.n, after.s = self.n - k, self.s - k * mean
                after.first, after.last = max(at + 1, self.first), self.last
        return upto, after


class GoodputLedger:
    """Accumulates phase durations and step outcomes of one job (bounded memory whatever
    its length: see ``_Steps``)."""

    def __init__(self, now: float) -> None:
        self._start = now
        self._phase = "queued"
        self._since = now
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._checkpoint_s = 0.0
        self._lost_s = 0.0
        self._lost_steps = 0
        self._uncommitted = _Steps()  # the steps after the last commit
        self._committed_step = 0
        self._rolled_back = _Steps()  # the last rollback's steps, until a resume
        # Committed steps, the newest RECENT_STEPS, oldest first.
        self._recent: OrderedDict[int, float] = OrderedDict()
        # All committed steps (also those no longer kept): their count and seconds.
        self._committed_n = 0
        self._committed_s = 0.0

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
            self._uncommitted.add(step, seconds)

    def checkpoint_blocked(self, seconds: float) -> None:
        self._checkpoint_s += max(0.0, seconds)

    def committed(self, step: int) -> None:
        """A checkpoint of ``step`` committed: steps up to it can no longer be lost."""
        if step > self._committed_step:
            self._committed_step = step
            self._keep_committed(step)

    def _keep_committed(self, step: int) -> None:
        """Steps up to ``step`` are committed: keep their times (bounded) among the recent."""
        newly, self._uncommitted = self._uncommitted.split(step)
        self._commit_steps(newly)

    def _commit_steps(self, newly: _Steps) -> None:
        # Committed in step order (a fall-back drops the newer ones first), so the oldest
        # steps come first and leave first.
        self._recent.update(sorted(newly.each.items()))
        self._committed_n += newly.count()
        self._committed_s += newly.seconds()
        while len(self._recent) > RECENT_STEPS:
            self._recent.popitem(last=False)

    def rollback(self, to_step: int) -> int:
        """A restart resumes after ``to_step``: later steps were lost. Returns how many."""
        self._uncommitted, lost = self._uncommitted.split(to_step)
        self._lost_s += lost.seconds()
        self._lost_steps += lost.count()
        self._rolled_back = lost
        return lost.count()

    def resumed_at(self, step: int) -> int:
        """The ranks restored ``step`` and train on from it; returns how many steps the
        restart lost in all (the last rollback's, corrected).

        Newer than the last rollback's step (a checkpoint committed that the controller had
        not heard of when it rolled back): the steps up to it were not lost after all and
        are no longer counted. Older than the newest commit (the ranks fell back past an
        unreadable checkpoint): the committed steps after it are computed again, so they
        are lost too."""
        regained, still = self._rolled_back.split(step)
        self._lost_s -= regained.seconds()
        self._lost_steps -= regained.count()
        lost = still.count()
        self._rolled_back = _Steps()
        if step > self._committed_step:
            self._committed_step = step
            self._commit_steps(regained)  # committed after all
            self._keep_committed(step)
        elif step < self._committed_step:
            again = 0
            while self._recent and next(reversed(self._recent)) > step:
                _, seconds = self._recent.popitem()  # the newest: computed again
                self._lost_s += seconds
                again += 1
            # The others (older than the steps kept, or folded): at the mean committed time.
            rest = max(0, self._committed_step - step - again)
            self._lost_s += rest * self._mean_committed_s()
            self._lost_steps += again + rest
            lost += again + rest
            self._committed_step = step
        return lost

    def _mean_committed_s(self) -> float:
        return self._committed_s / self._committed_n if self._committed_n else 0.0

    def carry(self, now: float) -> dict[str, Any]:
        """What a restarted controller needs to continue this ledger (``continued``): plain
        numbers, a few dozen bytes whatever the job's length."""
        return {"phase": self._phase, "elapsed_s": max(0.0, now - self._start),
                "totals": self._totals_at(now), "checkpoint_s": self._checkpoint_s,
                "lost_s": self._lost_s, "lost_steps": self._lost_steps,
                "committed_step": self._committed_step,
                "committed_n": self._committed_n, "committed_s": self._committed_s,
                # the steps after the newest commit, and a rollback whose resume has not
                # come yet (counted lost already): runs, (count, seconds, first, last)
                "at_risk": self._uncommitted.run(), "rolled_back": self._rolled_back.run()}

    @staticmethod
    def at_risk_steps(carried: Mapping[str, Any]) -> int:
        """How many steps after the newest commit ``carried`` (``carry``'s) had."""
        return int((carried.get("at_risk") or (0,))[0])

    @classmethod
    def continued(cls, carried: Mapping[str, Any], now: float, down_s: float
                  ) -> GoodputLedger:
        """The ledger an earlier controller ``carry``-ed, continued at ``now`` after
        ``down_s`` seconds between that carry and this restart (see the module's text). The
        restart rolls back to the newest commit: the steps at risk are lost (a restore of a
        newer step gives those up to it back, at their mean time)."""
        ledger = cls(now)
        down_s = max(0.0, down_s)
        ledger._start = now - float(carried.get("elapsed_s", 0.0)) - down_s
        totals = carried.get("totals") or {}
        for phase in PHASES:
            ledger._totals[phase] = float(totals.get(phase, 0.0))
        phase = str(carried.get("phase", "queued"))
        ledger._totals["recovery" if phase == "training" else
                       phase if phase in PHASES else "queued"] += down_s
        ledger._checkpoint_s = float(carried.get("checkpoint_s", 0.0))
        ledger._lost_s = float(carried.get("lost_s", 0.0))
        ledger._lost_steps = int(carried.get("lost_steps", 0))
        ledger._committed_step = int(carried.get("committed_step", 0))
        ledger._committed_n = int(carried.get("committed_n", 0))
        ledger._committed_s = float(carried.get("committed_s", 0.0))
        # The restart loses the steps at risk; the rollback a restore will correct holds
        # them and a pending rollback's steps (lost already), as one run.
        at_risk = _Steps.of_runs(carried.get("at_risk"))
        ledger._lost_s += at_risk.s
        ledger._lost_steps += at_risk.n
        ledger._rolled_back = _Steps.of_runs(carried.get("rolled_back"), carried.get("at_risk"))
        return ledger

    def _totals_at(self, now: float) -> dict[str, float]:
        """Seconds per phase up to ``now`` (the current phase's so far included)."""
        totals = dict(self._totals)
        totals[self._phase] += max(0.0, now - self._since)
        return totals

    def snapshot(self, now: float) -> Goodput:
        totals = self._totals_at(now)
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
