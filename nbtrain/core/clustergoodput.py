"""The cluster's goodput over time: a bounded series sampled from the jobs' statuses (pure).

**Definition.** Each sample covers the period since the one before it and says what share of
the cluster's online slot-time went to productive training::

    share = sum over jobs of  size * d(productive_s)  /  (online slots * period)

``productive_s`` is the job's goodput ledger's productive time (training minus checkpoint
blocking and lost work: ``status["goodput"]["productive_s"]``, :mod:`nbtrain.core.goodput`),
its increase over the period clamped to ``[0, period]``; ``size`` the ranks the job holds at
the sample; ``online`` the slots with a worker (free or held) at the sample. Each sample
also has ``held``, the share of the online slots some job held at the sample (the gap
between ``held`` and ``share`` is slot-time held while starting, recovering, blocked on a
checkpoint or computing steps later lost), and ``speedup``, the sum over goodput-sized jobs
holding slots of their speedup at their current size (``status["speedup"]``; 0 when none).

Approximations, stated: sizes and online slots are read at the sample, not integrated over
the period (a resize or a worker joining mid-period counts from the sample on); work lost to
a restart is charged to the period of the rollback, where it lowers the share, not to the
periods that computed it.

**Bounded.** One sample per ``period_s`` at most, the newest ``max_points`` kept (the
defaults: every 30 s for 12 h); one number per job in the newest statuses (the baseline of
its ledger). The series does not read a clock: the caller passes its monotonic and wall time.

**What a restart keeps.** The points are plain dicts (:meth:`ClusterGoodputSeries.points`);
give them back to a new series (``ClusterGoodputSeries(points=...)``) and it continues after
them. The ledgers' baselines are not kept (the jobs' ledgers go on from the journal, but the
series does not know where they were at its last sample), so the first sample of a new
series only sets them: the line breaks where no sample came for more than two periods.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["ONLINE", "ClusterGoodputSeries", "GoodputSample", "GoodputSeriesSettings",
           "speedup_now"]

#: Slot states that count as the cluster's capacity (``SlotView["state"]``).
ONLINE = frozenset({"free", "held"})


@dataclass(frozen=True, kw_only=True)
class GoodputSeriesSettings:
    """``period_s``: seconds between samples (longer: coarser, cheaper; each sample reads
    every job's status once). ``max_points``: samples kept (``period_s * max_points`` is the
    span shown: 30 s * 1440 = 12 h)."""

    period_s: float = 30.0
    max_points: int = 1440

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            problems.append(f"period_s={self.period_s!r} must be a positive number of "
                            "seconds (30 is coarse enough for a class, 5 for a demo)")
        if self.max_points < 2:
            problems.append(f"max_points={self.max_points!r} must be at least 2 (a line "
                            "needs two points; 1440 keeps 12 h at 30 s)")
        if problems:
            raise ValueError("GoodputSeriesSettings: " + "; ".join(problems))


@dataclass(frozen=True)
class GoodputSample:
    """One point of the series: at wall time ``time``, over the period before it."""

    time: float
    share: float
    held: float
    online: int
    speedup: float

    def as_dict(self) -> dict[str, float]:
        return {"time": self.time, "share": self.share, "held": self.held,
                "online": float(self.online), "speedup": self.speedup}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> GoodputSample:
        def num(key: str) -> float:
            value = data.get(key, 0.0)
            return float(value) if isinstance(value, int | float) else 0.0

        return cls(time=num("time"), share=num("share"), held=num("held"),
                   online=int(num("online")), speedup=num("speedup"))


def speedup_now(status: Mapping[str, object]) -> float:
    """A goodput-sized job's speedup at the size it holds (0: another job, or no slots)."""
    size = status.get("size")
    points = status.get("speedup")
    if not isinstance(size, int | float) or size <= 0 or not isinstance(points, list | tuple):
        return 0.0
    for point in points:
        if isinstance(point, Mapping) and point.get("size") == size:
            value = point.get("speedup")
            return float(value) if isinstance(value, int | float) else 0.0
    return 0.0


def _productive_s(status: Mapping[str, object]) -> float:
    goodput = status.get("goodput")
    value = goodput.get("productive_s") if isinstance(goodput, Mapping) else None
    return float(value) if isinstance(value, int | float) else 0.0


class ClusterGoodputSeries:
    """Samples of the cluster's goodput (see the module docstring); ``points`` continues a
    series an earlier one returned."""

    def __init__(self, settings: GoodputSeriesSettings | None = None,
                 points: Iterable[Mapping[str, object]] = ()) -> None:
        self.settings = settings or GoodputSeriesSettings()
        self._samples: deque[GoodputSample] = deque(
            (GoodputSample.from_dict(p) for p in points), maxlen=self.settings.max_points)
        self._last_now: float | None = None
        self._baseline: dict[str, float] = {}
        #: Samples this series has taken (not those it continued): a view redraws when it
        #: changed.
        self.taken = 0

    def due(self, now: float) -> bool:
        """Whether a sample at ``now`` (monotonic seconds) is a period after the last."""
        return self._last_now is None or now - self._last_now >= self.settings.period_s

    def sample(self, now: float, wall: float, slots: Iterable[Mapping[str, object]],
               jobs: Iterable[Mapping[str, object]]) -> GoodputSample | None:
        """Take a sample from the slots (``SlotView``s) and the jobs' full statuses at
        ``now`` (monotonic) and ``wall`` (the time shown). The first sample of a series only
        sets the ledgers' baselines and returns None."""
        statuses = {str(j.get("job_id")): j for j in jobs}
        online = held = 0
        for slot in slots:
            if slot.get("state") in ONLINE:
                online += 1
                held += 1 if slot.get("job") else 0
        last, self._last_now = self._last_now, now
        baseline, self._baseline = self._baseline, {
            job_id: _productive_s(status) for job_id, status in statuses.items()}
        if last is None or now <= last:
            return None
        period = now - last
        productive_slot_s = 0.0
        for job_id, status in statuses.items():
            size = status.get("size")
            if not isinstance(size, int | float) or size <= 0:
                continue
            # a job not seen before was submitted in this period: its ledger started at 0
            gained = self._baseline[job_id] - baseline.get(job_id, 0.0)
            productive_slot_s += float(size) * min(period, max(0.0, gained))
        point = GoodputSample(
            time=wall,
            share=min(1.0, productive_slot_s / (online * period)) if online else 0.0,
            held=held / online if online else 0.0, online=online,
            speedup=sum(speedup_now(s) for s in statuses.values()))
        self._samples.append(point)
        self.taken += 1
        return point

    def points(self) -> list[dict[str, float]]:
        """The samples kept, oldest first, as plain dicts (what a restart gives back)."""
        return [s.as_dict() for s in self._samples]

    def columns(self) -> dict[str, list[float]]:
        """The samples as plot columns, with a NaN row wherever more than two periods passed
        between two samples (a controller that was down): the line breaks there."""
        cols: dict[str, list[float]] = {k: [] for k in ("time", "share", "held", "online",
                                                        "speedup")}
        previous: float | None = None
        for s in self._samples:
            if previous is not None and s.time - previous > 2 * self.settings.period_s:
                gap = {"time": (previous + s.time) / 2}
                for key, values in cols.items():
                    values.append(gap.get(key, math.nan))
            previous = s.time
            for key, value in s.as_dict().items():
                cols[key].append(value)
        return cols
