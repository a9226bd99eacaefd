"""Step time of a data-parallel job as a function of its size, fitted from measured steps (pure).

The form is Pollux's throughput model (Qiao et al., OSDI'21, section 3.2) with its overlap
exponent fixed at 1::

    step_s(n) = a + b * m(n) + [n > 1] * (c + d * (n - 1))

``n`` ranks, ``m(n)`` the per-rank batch: ``global_batch / n`` with nbtrain's loader, which
keeps the global batch fixed, or a fixed ``per_rank_batch`` for a job whose global batch
grows with its size. ``a``: per-step time that does not shrink with more ranks
(optimizer step, input pipeline on the critical path); ``b``: compute time per sample; ``c``:
the gradient all-reduce once there are peers (a ring's bandwidth term is nearly constant in
``n``); ``d``: what each further rank adds (latency hops, stragglers). Throughput is
``n * m(n) / step_s(n)`` samples per second.

Why this form: compute falls as the local batch shrinks, communication appears at the second
rank and grows slowly with more, and a serial part bounds the speedup (Amdahl). Pollux also
fits an exponent ``g`` (``step = (compute**g + sync**g)**(1/g)``) for the overlap of backward
and all-reduce; with the three or four sizes a job runs at, ``g`` cannot be told apart from
the split between ``a`` and ``c``, so it is fixed at 1 (no overlap), which errs on the side
of predicting too little speedup, never too much.

Fitting: least squares on the *relative* error of the mean step time at each size measured,
weighted by how many steps each mean holds, with every coefficient kept >= 0 (exact: each
subset of coefficients is solved and the best non-negative one kept; there are at most 15).
A fit never has more free coefficients than distinct sizes measured, so two sizes give a
two-coefficient curve rather than an arbitrary one. A fit must predict a step of more than
no time at one rank (``a + b * m(1)`` above a millionth of the fastest mean): communication
terms alone (measured at 2 and 4 ranks with the step time growing, ``d * (n - 1)`` fits
exactly) would predict infinite speed there. Data only such a curve explains get the best
physical fit instead, whose large residual leaves the curve untrusted (``confidence``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["SizeStats", "StepTimeCurve", "fit_split", "fit_step_time", "split_curve"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class StepTimeCurve:
    """``step_s(n) = a + b*m(n) + [n>1]*(c + d*(n-1))``; ``m(n)`` is ``per_rank_batch`` when
    set, else ``global_batch / n``."""

    a: float
    b: float
    c: float
    d: float
    global_batch: float = 1.0
    per_rank_batch: float | None = None

    def batch(self, n: int) -> float:
        """Global batch at ``n`` ranks."""
        return self.global_batch if self.per_rank_batch is None else self.per_rank_batch * n

    def step_s(self, n: int) -> float:
        """Predicted seconds per step at ``n`` ranks (``n >= 1``)."""
        if n < 1:
            raise ValueError(f"step_s needs n >= 1 ranks, got {n}")
        sync = self.c + self.d * (n - 1) if n > 1 else 0.0
        return self.a + self.b * self.batch(n) / n + sync

    def throughput(self, n: int) -> float:
        """Samples per second at ``n`` ranks."""
        return self.batch(n) / self.step_s(n)


@dataclass
class SizeStats:
    """Running mean and variance (Welford) of the step time measured at one size."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, step_s: float, steps: float = 1.0) -> None:
        """Add a mean step time measured over ``steps`` steps."""
        if not (step_s > 0 and math.isfinite(step_s)) or not steps > 0:
            raise ValueError(f"a step time must be a positive number of seconds over a "
                             f"positive number of steps, got {step_s!r} over {steps!r}")
        total = self.count + steps
        delta = step_s - self.mean
        self.mean += delta * steps / total
        self.m2 += delta * (step_s - self.mean) * steps
        self.count = total

    @property
    def rel_se(self) -> float:
        """Standard error of the mean relative to it (0 with a single measurement)."""
        if self.count <= 1 or self.mean <= 0:
            return 0.0
        var = self.m2 / (self.count - 1)
        return math.sqrt(max(var, 0.0) / self.count) / self.mean


def _columns(sizes: FloatArray, global_batch: float, per_rank: float | None) -> FloatArray:
    ones = np.ones_like(sizes)
    multi = (sizes > 1).astype(np.float64)
    local = global_batch / sizes if per_rank is None else per_rank * ones
    return np.stack([ones, local, multi, multi * (sizes - 1)], axis=1)


def fit_step_time(stats: Iterable[tuple[int, SizeStats]], *, global_batch: float = 1.0,
                  per_rank_batch: float | None = None) -> tuple[StepTimeCurve, float] | None:
    """Fit the curve to ``(size, stats)`` pairs; returns (curve, rms relative residual) or
    ``None`` with no measurement. Sizes with no steps are ignored."""
    rows = [(n, s) for n, s in stats if s.count > 0]
    if not rows:
        return None
    sizes = np.asarray([float(n) for n, _ in rows])
    t = np.asarray([s.mean for _, s in rows])
    w = np.sqrt(np.asarray([s.count for _, s in rows])) / t  # relative error, by samples
    x = _columns(sizes, global_batch, per_rank_batch) * w[:, None]
    y = t * w
    k = min(len(rows), 4)
    # What each coefficient adds at one rank, and the least step time a fit must predict
    # there (a rounding error's worth above 0 is no step time at all).
    at_one = _columns(np.ones(1), global_batch, per_rank_batch)[0]
    floor = 1e-6 * float(t.min())
    best: tuple[float, int, FloatArray] | None = None
    for n_cols in range(1, k + 1):
        for cols in itertools.combinations(range(4), n_cols):
            sub = x[:, cols]
            if np.linalg.matrix_rank(sub) < n_cols:
                continue  # collinear on these sizes (e.g. a and c when every n > 1)
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if (coef < 0).any() or float(at_one[list(cols)] @ coef) <= floor:
                continue
            resid = float(((sub @ coef - y) ** 2).sum())
            # fewer coefficients win ties (within rounding): never fit more than needed
            key = (round(resid, 12), n_cols)
            if best is None or key < (round(best[0], 12), best[1]):
                full = np.zeros(4)
                full[list(cols)] = coef
                best = (resid, n_cols, full)
    if best is None:  # pragma: no cover - the single column 'b' always fits positive data
        return None
    a, b, c, d = (float(v) for v in best[2])
    curve = StepTimeCurve(a, b, c, d, global_batch, per_rank_batch)
    counts = np.asarray([s.count for _, s in rows])
    pred = np.asarray([curve.step_s(int(n)) for n, _ in rows])
    rms = math.sqrt(float((counts * ((pred - t) / t) ** 2).sum() / counts.sum()))
    return curve, rms


def split_curve(size: int, step_s: float, compute_s: float, comm_s: float, *,
                global_batch: float = 1.0,
                per_rank_batch: float | None = None) -> StepTimeCurve:
    """The curve one size's phase split gives (Pollux profiles a job the same way before it
    has run at a second size): compute is ``b * m(size)``, the all-reduce ``c`` (``d`` = 0:
    one size cannot tell a constant from a growing all-reduce), the rest of the step ``a``.
    At one rank there is no all-reduce, so ``c`` is 0 and the curve scales but for ``a``."""
    if not (step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"step_s must be a positive number of seconds, got {step_s!r}")
    if not (compute_s >= 0 and comm_s >= 0 and math.isfinite(compute_s + comm_s)):
        raise ValueError(f"compute_s and comm_s must be seconds >= 0, got {compute_s!r} and "
                         f"{comm_s!r}")
    part = min(compute_s + comm_s, step_s)  # phases measured apart may overrun the step
    compute = compute_s * part / (compute_s + comm_s) if part > 0 else 0.0
    comm = part - compute if size > 1 else 0.0
    probe = StepTimeCurve(0.0, 1.0, 0.0, 0.0, global_batch, per_rank_batch)
    local = probe.batch(size) / size
    return StepTimeCurve(step_s - part, compute / local, comm, 0.0, global_batch,
                         per_rank_batch)


def fit_split(rows: Iterable[tuple[int, float, float, float, float]], *,
              global_batch: float = 1.0,
              per_rank_batch: float | None = None) -> tuple[StepTimeCurve, float] | None:
    """Fit the curve term by term from ``(size, steps, step_s, compute_s, comm_s)`` means:
    ``b`` from the compute, ``c`` and ``d`` from the all-reduce at the sizes above one rank
    (``d`` only once two such sizes are known), ``a`` from what is left of the step plus any
    compute that does not shrink with the per-rank batch (a line through the compute at two
    sizes or more). Each phase pins its own terms, so two sizes give all four. Returns
    (curve, rms relative residual of the step times) like ``fit_step_time``, or ``None``
    with no rows."""
    data = [r for r in rows if r[1] > 0]
    if not data:
        return None
    probe = StepTimeCurve(0.0, 1.0, 0.0, 0.0, global_batch, per_rank_batch)
    n = np.asarray([float(r[0]) for r in data])
    w = np.asarray([r[1] for r in data])
    step, compute, comm = (np.asarray([r[k] for r in data]) for k in (2, 3, 4))
    local = np.asarray([probe.batch(int(k)) / k for k in n])
    # Compute that divides with the per-rank batch (b), and any that does not (it joins a:
    # a small batch that leaves a device underused, a fixed cost inside the compute phase).
    fixed, b = _nonneg_line(local, compute, w)
    multi = n > 1
    c = d = 0.0
    if multi.any():  # the all-reduce: a constant, growing with each further rank if it does
        c, d = _nonneg_line(n[multi] - 1, comm[multi], w[multi], through_origin=False)
    rest = step - compute - np.where(multi, comm, 0.0)
    a = max(0.0, float((w * rest).sum() / w.sum())) + fixed
    curve = StepTimeCurve(a, b, c, d, global_batch, per_rank_batch)
    pred = np.asarray([curve.step_s(int(k)) for k in n])
    rms = math.sqrt(float((w * ((pred - step) / step) ** 2).sum() / w.sum()))
    return curve, rms


def _nonneg_line(x: FloatArray, y: FloatArray, w: FloatArray, *,
                 through_origin: bool = True) -> tuple[float, float]:
    """Weighted least squares ``y ~ p + q*x`` with ``p, q >= 0``: the best of the full line
    and the one-term lines (``p`` alone, and ``q`` alone when ``through_origin``; the first
    of these wins a tie). With one distinct ``x`` only a one-term line: ``q`` alone when
    ``through_origin``, else ``p``."""
    options = [(0.0, max(float((w * x * y).sum() / (w * x * x).sum()), 0.0))] \
        if through_origin else []
    options.append((float((w * y).sum() / w.sum()), 0.0))
    if len(set(x.tolist())) < 2:
        return options[0]
    sw = np.sqrt(w)
    cols = np.stack([np.ones_like(x), x], axis=1)
    (p, q), *_ = np.linalg.lstsq(cols * sw[:, None], y * sw, rcond=None)
    if p >= 0 and q >= 0:
        options.append((float(p), float(q)))

    def err(pq: tuple[float, float]) -> float:
        return float((w * (pq[0] + pq[1] * x - y) ** 2).sum())

    return min(options, key=err)
