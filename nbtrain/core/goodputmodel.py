"""One job's goodput at each size it could run at, and how far to trust it (pure).

``goodput(n) = throughput(n) * efficiency(batch(n))``: samples per second at ``n`` ranks
(``nbtrain.core.speedup``, fitted from the job's own step times at the sizes it ran at) times
the progress each sample makes (``nbtrain.core.gradnoise``; 1 without a noise scale, and the
same at every size when the global batch is fixed). The scheduler compares sizes of one job
through ``speedup(n) = goodput(n) / goodput(ref_size)``, ``ref_size`` being the size its user
asked for, so jobs of any speed weigh alike.

Exploration: a job starts at the size it asked for, with no curve. Its first step times come
with how each step splits (``compute_s``, ``comm_s``: the ranks' step rows time each phase),
and that split at one size is the first curve (``nbtrain.core.speedup.split_curve``: compute
shrinks with the per-rank batch, the all-reduce stays). Measured at one size without a split,
the model assumes perfect scaling from the sizes it knows (every rank adds what the measured
ones do). Either way the curve is valued up to ``explore_factor`` (2) times the largest size
measured, and no gain beyond (Pollux caps exploration the same way). Each new size the
scheduler moves the job to (a shrink for a waiting job, growth into idle slots) refits the
curve: term by term from the phases when every size measured has its split
(``nbtrain.core.speedup.fit_split``, as Pollux fits compute and synchronisation apart: two
sizes then fix all four terms), else on the step times alone.

Confidence, in [0, 1], is a heuristic product of three factors: *support*,
``1 - 1/k`` for ``k`` distinct sizes measured (0 with one, or 1/2 with its phase split: a
single step time fixes no shape, its split a likely one);
*coverage*, 1 inside the measured range and halving per doubling outside it; *quality*,
``exp(-(rms residual + mean relative standard error) / noise_tolerance)``, so a curve that
fits badly, or rests on noisy means, counts for less.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from nbtrain.core.gradnoise import efficiency
from nbtrain.core.speedup import (
    SizeStats,
    StepTimeCurve,
    fit_split,
    fit_step_time,
    split_curve,
)

__all__ = ["GoodputModel", "GoodputSettings"]


@dataclass(frozen=True, kw_only=True)
class GoodputSettings:
    """explore_factor: how far past the largest size measured a job may be valued (and so
        grown) before it is measured there; 2 doubles at most per step of exploration.
    noise_tolerance: relative error (fit residual plus the standard error of the means) at
        which confidence falls by a factor e; about twice the step-time jitter that is
        normal for the job (0.1 for a step time that varies by ~5%).
    """

    explore_factor: float = 2.0
    noise_tolerance: float = 0.1

    def __post_init__(self) -> None:
        problems = []
        if not self.explore_factor >= 1.0:
            problems.append(f"explore_factor must be >= 1 (1: no exploration), got "
                            f"{self.explore_factor!r}")
        if not self.noise_tolerance > 0:
            problems.append(f"noise_tolerance must be > 0, got {self.noise_tolerance!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class GoodputModel:
    """Measured step times of one job by size, its fitted curve, its goodput by size."""

    ref_size: int
    global_batch: float = 1.0
    per_rank_batch: float | None = None
    settings: GoodputSettings = field(default_factory=GoodputSettings)
    noise_scale: float | None = None
    _stats: dict[int, SizeStats] = field(default_factory=dict)
    #: per size: (steps, their summed compute seconds, their summed all-reduce seconds)
    _split: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    _fit: tuple[StepTimeCurve, float] | None = None
    _stale: bool = False

    def __post_init__(self) -> None:
        if self.ref_size < 1:
            raise ValueError(f"ref_size must be >= 1, got {self.ref_size!r}")

    # ------------------------------------------------------------------ input
    def observe(self, size: int, step_s: float, steps: float = 1.0, *,
                compute_s: float | None = None, comm_s: float | None = None) -> None:
        """A mean step time measured at ``size`` ranks over ``steps`` steps, and optionally
        the mean compute and all-reduce seconds of those steps (a split without compute time,
        untimed, or with a part that is not a finite number >= 0 is ignored; the step time
        still counts)."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size!r}")
        self._stats.setdefault(size, SizeStats()).add(step_s, steps)
        if (compute_s is not None and comm_s is not None and compute_s > 0 and comm_s >= 0
                and math.isfinite(compute_s + comm_s)):
            n, comp, comm = self._split.get(size, (0.0, 0.0, 0.0))
            self._split[size] = (n + steps, comp + compute_s * steps, comm + comm_s * steps)
        self._stale = True

    @property
    def sizes(self) -> tuple[int, ...]:
        """Sizes measured, ascending."""
        return tuple(sorted(self._stats))

    def curve(self) -> StepTimeCurve | None:
        """The fitted curve, once two sizes are measured or one with its phase split (else
        ``None``)."""
        if len(self._stats) < 2 and not self._one_split():
            return None
        if self._stale or self._fit is None:
            self._fit = self._refit()
            self._stale = False
        return None if self._fit is None else self._fit[0]

    def _one_split(self) -> bool:
        return len(self._stats) == 1 and next(iter(self._stats)) in self._split

    def _refit(self) -> tuple[StepTimeCurve, float] | None:
        if self._one_split():
            (size, stats), = self._stats.items()
            steps, comp, comm = self._split[size]
            return split_curve(size, stats.mean, comp / steps, comm / steps,
                               global_batch=self.global_batch,
                               per_rank_batch=self.per_rank_batch), 0.0
        if all(n in self._split for n in self._stats):
            return fit_split(((n, s.count, s.mean, self._split[n][1] / self._split[n][0],
                               self._split[n][2] / self._split[n][0])
                              for n, s in self._stats.items()),
                             global_batch=self.global_batch,
                             per_rank_batch=self.per_rank_batch)
        return fit_step_time(self._stats.items(), global_batch=self.global_batch,
                             per_rank_batch=self.per_rank_batch)

    # ------------------------------------------------------------------ output
    def _batch(self, n: int) -> float:
        return self.global_batch if self.per_rank_batch is None else self.per_rank_batch * n

    def explore_limit(self) -> int | None:
        """Largest size valued without a measurement near it (``None``: nothing measured)."""
        if not self._stats:
            return None
        return max(1, int(max(self._stats) * self.settings.explore_factor))

    def throughput(self, n: int) -> float:
        """Samples per second predicted at ``n`` ranks (relative units before any
        measurement: ``n``)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        limit = self.explore_limit()
        if limit is not None:
            n = min(n, limit)  # no gain is assumed past what exploration may reach
        curve = self.curve()
        if curve is not None:
            return curve.throughput(n)
        if not self._stats:
            return float(n)
        # Perfect scaling from the nearest size measured.
        near = min(self._stats, key=lambda s: (abs(math.log(n / s)), s))
        return self._batch(near) / self._stats[near].mean * n / near

    def goodput(self, n: int) -> float:
        """Useful samples per second at ``n`` ranks: throughput times efficiency."""
        return self.throughput(n) * efficiency(self._batch(n), self._batch(self.ref_size),
                                               self.noise_scale)

    def speedup(self, n: int) -> float:
        """``goodput(n) / goodput(ref_size)``."""
        return self.goodput(n) / self.goodput(self.ref_size)

    def confidence(self, n: int) -> float:
        """How far to trust ``goodput(n)``, in [0, 1] (see the module docstring)."""
        k = len(self._stats)
        if self.curve() is None or self._fit is None:
            return 0.0
        support = 1.0 - 1.0 / max(k, 2)  # one size with its split counts as two
        lo, hi = min(self._stats), max(self._stats)
        edge = lo if n < lo else hi if n > hi else n
        coverage = math.pow(0.5, abs(math.log2(n / edge)))
        se = sum(s.rel_se for s in self._stats.values()) / k
        quality = math.exp(-(self._fit[1] + se) / self.settings.noise_tolerance)
        return support * coverage * quality

    def points(self, sizes: Iterable[int]) -> tuple[dict[str, float], ...]:
        """The curve as views draw it: per size, ``size``, ``speedup``, ``confidence`` and,
        where the job ran at that size, ``step_s`` (its mean measured step time) and
        ``steps`` (how many steps the mean covers)."""
        out = []
        for n in sizes:
            point = {"size": float(n), "speedup": self.speedup(n),
                     "confidence": self.confidence(n)}
            stats = self._stats.get(n)
            if stats is not None:
                point.update(step_s=stats.mean, steps=stats.count)
            out.append(point)
        return tuple(out)

    def points_between(self, lo: int, hi: int, replica: int = 1
                       ) -> tuple[dict[str, float], ...]:
        """``points`` at every multiple of ``replica`` in ``[lo, hi]``."""
        first = max(replica, -(-lo // replica) * replica)
        return self.points(range(first, hi + 1, replica))
