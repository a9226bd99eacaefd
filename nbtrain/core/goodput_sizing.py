"""Sizes for goodput-sized jobs from their goodput models (pure; no clock, no I/O).

The scheduler (``nbtrain.core.scheduler``) calls these with its own books and carries the
answers out as ``ResizeJob`` decisions; they decide sizes, never placements. Speedups are
each job's goodput relative to the size it asked for (``GoodputModel.speedup``). Pollux
maximises their sum; growth here follows what a slot saves of a job's run instead (below),
which on ``benchmarks/goodput.py``'s full trace gave a mean JCT 6% lower (2026-12-05). Fair
share orders the queue, as for every other job.

Three rules, each with its reason in words:

- ``rebalance`` (nobody waits): the slots that are free, plus those goodput jobs could give
  back, go one replica at a time to the job whose run each added rank-second shortens most
  (``time_return``; higher priority first), weighed by the time each job has left
  (``growth_key``), each job between its floor and its ceiling, and only while that return
  is at least ``1 / value_ranks`` (a job is not grown far past its efficient size because
  slots happen to be idle: arriving jobs would take them back, at a restart each). Mean JCT,
  not summed speedup, is what this ranks by: on a full cluster a slot-second spent where it
  saves the most time of some job's run is what finishes jobs sooner, and a job that scales
  well spends few extra slot-seconds to finish sooner. Of two jobs that gain alike, the one
  with less time left goes first: with speedups below linear, mean JCT is lowest when the
  jobs nearest their end hold the most ranks (heSRPT, Berg et al. 2020), and slots taken
  from a job far from its end come back to it when the others finish.
  A job's floor is the smallest size down to its minimum where its curve is trusted
  (``min_confidence``; its current size when it is not trusted there), its ceiling
  ``min(max_size, explore_limit)``. Growth that adds less than ``min_gain`` to a job's
  speedup is dropped, and so are shrinks no growth needs; the whole plan must gain at least
  ``min_gain`` (of one job's speedup) over what it loses, or nothing moves.
- ``for_queue`` (jobs wait): a job gives back the ranks past its knee, the largest size whose
  last replica still adds ``knee`` of an average rank's speedup, when its curve is trusted
  there. A job measured at one size only is probed at half of it (not below its minimum), so
  its first curve is filled in while the slots help a waiting job. ``queue_order`` ranks
  these changes (probes first, then the cheapest per slot for the time left, as
  ``shrink_key``), and the scheduler takes them only until the waiting jobs' minimum sizes
  fit in the free slots: every give-back is a restart, and a job is queued for a moment at
  nearly every arrival, before the pass starts it on free slots. Taking every give-back then
  gave a mean JCT of 0.7043 of nbtrain's policy on ``benchmarks/goodput.py``'s full trace,
  against 0.6988 (lower on each of trace seeds 1-5, a quarter fewer resizes; 2026-12-06).
- ``shrink_cost``: what a shrink costs a job, for choosing whom to shrink for a blocked head
  (``shrink_key``: the smallest loss per slot goes first, weighed by the time left the other
  way round: a job far from its end loses least by waiting) and for the reason shown.

Time left (``Candidate.left_s``) comes from the job's ``steps`` and its step rows. Jobs whose
time left is not known (without ``steps``, or not measured yet) are grown after and shrunk
after the others, and among themselves ordered as if all had the same time left.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from nbtrain.core.goodputmodel import GoodputModel

__all__ = ["Candidate", "SizeChange", "for_queue", "growth_key", "knee", "loss_per_slot",
           "queue_order", "rebalance", "shrink_cost", "shrink_key", "time_return"]

#: Time left below this counts as this much when jobs are weighed by it (seconds): a job
#: about to end is not worth any number of restarts of the others.
MIN_LEFT_S = 60.0


@dataclass(frozen=True)
class Candidate:
    """One running goodput-sized job, as the rules see it."""

    job_id: str
    model: GoodputModel
    size: int
    min_size: int
    max_size: int
    replica: int
    priority: int = 0
    #: Seconds of its run left at ``size`` (``None``: not known).
    left_s: float | None = None


@dataclass(frozen=True)
class SizeChange:
    """Resize ``job_id`` from ``old`` to ``new`` ranks, because ``reason``."""

    job_id: str
    old: int
    new: int
    reason: str
    #: A probe: the job was measured at one size only (``for_queue``).
    probe: bool = False


def shrink_cost(model: GoodputModel, old: int, new: int) -> float:
    """Share of its speedup a job loses going from ``old`` to ``new`` ranks (< 0: a gain)."""
    return 1.0 - model.speedup(new) / model.speedup(old)


def loss_per_slot(model: GoodputModel, old: int, new: int) -> float:
    """``shrink_cost`` per slot given up, going from ``old`` to ``new < old`` ranks."""
    return shrink_cost(model, old, new) / (old - new)


def time_return(model: GoodputModel, n: int, r: int) -> float:
    """Seconds of a job's run saved per rank-second added, growing it from ``n`` to ``n + r``
    ranks (both per unit of its work, so the figure does not depend on how long it runs):
    ``inf`` when the growth adds no rank-seconds (perfect scaling), <= 0 when it saves
    nothing."""
    s0, s1 = model.speedup(n), model.speedup(n + r)
    saved = 1.0 / s0 - 1.0 / s1
    added = (n + r) / s1 - n / s0
    if saved <= 0:
        return 0.0
    return math.inf if added <= 0 else saved / added


def _left_sq(left_s: float) -> float:
    return max(left_s, MIN_LEFT_S) ** 2


def growth_key(gain: float, left_s: float | None) -> tuple[int, float]:
    """Order of growth in ``rebalance`` (larger first): a rank's ``time_return`` over the
    square of the job's time left, so the jobs nearest their end grow first unless another
    gains far more; jobs whose time left is not known come after, by ``time_return``."""
    return (0, gain) if left_s is None else (1, gain / _left_sq(left_s))


def shrink_key(loss_per_slot: float, left_s: float | None) -> tuple[int, float]:
    """Order of shrinking for a blocked head (smaller first): the share of its speedup a job
    loses per slot given up, over the square of its time left (a job far from its end loses
    least by giving slots up now: they come back to it when nearer jobs end); jobs whose
    time left is not known (not measured yet, or without ``steps``) come after, by that
    loss alone (shrinking them first was worse on ``benchmarks/goodput.py``'s trace)."""
    return (2, loss_per_slot) if left_s is None else (1, loss_per_slot / _left_sq(left_s))


def _marginal(model: GoodputModel, n: int, r: int) -> float:
    """Speedup the last replica at ``n`` ranks adds per rank, over the average rank's."""
    s = model.speedup(n)
    if n <= r or s <= 0:
        return 1.0
    return (s - model.speedup(n - r)) / r / (s / n)


def knee(model: GoodputModel, size: int, min_size: int, replica: int,
         threshold: float) -> int:
    """Largest size in ``[min_size, size]`` whose last replica adds at least ``threshold`` of
    an average rank's speedup (``min_size`` when none does)."""
    n = size
    while n - replica >= min_size and _marginal(model, n, replica) < threshold:
        n -= replica
    return n


def _ceiling(c: Candidate) -> int:
    limit = c.model.explore_limit()
    top = c.max_size if limit is None else min(c.max_size, max(limit, c.size))
    return max(c.size, top // c.replica * c.replica)


def _floor(c: Candidate, min_confidence: float) -> int:
    """The smallest size in ``[min_size, size]`` (in replicas) down to which the job's curve
    is trusted; its size when it is not trusted there."""
    m, n = c.model, c.size
    if m.confidence(n) < min_confidence:
        return n
    while n - c.replica >= c.min_size and m.confidence(n - c.replica) >= min_confidence:
        n -= c.replica
    return n


def _waterfill(cands: Sequence[Candidate], free: int, min_confidence: float,
               value_ranks: float) -> dict[str, int]:
    """Sizes one replica at a time, the best time return first (see ``rebalance``)."""
    alloc = {c.job_id: _floor(c, min_confidence) for c in cands}
    pool = free + sum(c.size - alloc[c.job_id] for c in cands)
    heap: list[tuple[int, int, float, str]] = []
    by_id = {c.job_id: c for c in cands}
    ceiling = {c.job_id: _ceiling(c) for c in cands}

    def push(c: Candidate) -> None:
        n = alloc[c.job_id]
        if n + c.replica > ceiling[c.job_id]:
            return
        gain = time_return(c.model, n, c.replica)
        if gain > 0 and gain * value_ranks >= 1.0:
            known, key = growth_key(gain, c.left_s)
            heapq.heappush(heap, (-c.priority, -known, -key, c.job_id))

    for c in cands:
        push(c)
    while heap and pool > 0:
        *_, jid = heapq.heappop(heap)
        c = by_id[jid]
        if c.replica > pool:
            continue
        alloc[jid] += c.replica
        pool -= c.replica
        push(c)
    return alloc


def rebalance(cands: Sequence[Candidate], free: int, *, min_gain: float,
              min_confidence: float, value_ranks: float = math.inf) -> list[SizeChange]:
    """Sizes for ``cands`` on their slots plus ``free`` (see the module docstring); shrinks
    come first in the list, so growth can use their slots."""
    alloc = _waterfill(cands, free, min_confidence, value_ranks)
    by_id = {c.job_id: c for c in cands}
    grows = {c.job_id: alloc[c.job_id] for c in cands if alloc[c.job_id] > c.size
             and c.model.speedup(alloc[c.job_id]) / c.model.speedup(c.size) - 1 >= min_gain}
    need = sum(n - by_id[j].size for j, n in grows.items()) - free
    shrinks: list[tuple[float, str]] = sorted(
        (loss_per_slot(c.model, c.size, alloc[c.job_id]), c.job_id)
        for c in cands if alloc[c.job_id] < c.size)
    kept: dict[str, int] = {}
    for _, jid in shrinks:  # the cheapest per slot first, only as many as growth needs
        if need <= 0:
            break
        kept[jid] = alloc[jid]
        need -= by_id[jid].size - alloc[jid]
    if need > 0:  # cannot happen (growth was paid for by these shrinks); never overcommit
        return []
    gained = sum(by_id[j].model.speedup(n) - by_id[j].model.speedup(by_id[j].size)
                 for j, n in grows.items())
    lost = sum(by_id[j].model.speedup(by_id[j].size) - by_id[j].model.speedup(n)
               for j, n in kept.items())
    if not grows or gained - lost < min_gain:
        return []
    return _changes(by_id, kept, grows, gained - lost, min_confidence)


def _changes(by_id: dict[str, Candidate], kept: dict[str, int], grows: dict[str, int],
             net: float, min_confidence: float) -> list[SizeChange]:
    growers = ", ".join(sorted(grows))
    verb = "grows" if len(grows) == 1 else "grow"
    out = [SizeChange(j, by_id[j].size, n,
                      f"goodput: {by_id[j].size}->{n} ranks "
                      f"{_costs(shrink_cost(by_id[j].model, by_id[j].size, n))}; "
                      f"{growers} {verb} (+{net:.2f} job-speedups in all)")
           for j, n in sorted(kept.items())]
    for j, n in sorted(grows.items()):
        c = by_id[j]
        gain = c.model.speedup(n) / c.model.speedup(c.size) - 1
        how = "exploring: " if c.model.confidence(n) < min_confidence else ""
        out.append(SizeChange(j, c.size, n, f"goodput: {how}{c.size}->{n} ranks adds "
                                            f"{gain:.0%} to its speedup"))
    return out


def for_queue(c: Candidate, *, threshold: float, min_confidence: float) -> SizeChange | None:
    """While jobs wait: give back the ranks past the knee, or probe a job known at one size
    only at half of it (see the module docstring); ``None`` when it keeps its size."""
    m = c.model
    if c.size <= c.min_size:
        return None
    if len(m.sizes) < 2:
        if not m.sizes:
            return None
        half = max(c.min_size, c.size // 2 // c.replica * c.replica)
        if half >= c.size:
            return None
        return SizeChange(c.job_id, c.size, half,
                          f"goodput: exploring: measured at {m.sizes[0]} ranks only; tries "
                          f"{half} while jobs wait, its {c.size - half} ranks go to them",
                          probe=True)
    new = knee(m, c.size, c.min_size, c.replica, threshold)
    if new >= c.size or min(m.confidence(c.size), m.confidence(new)) < min_confidence:
        return None
    lost = shrink_cost(m, c.size, new)
    return SizeChange(c.job_id, c.size, new,
                      f"goodput: {c.size}->{new} ranks {_costs(lost)}; its {c.size - new} "
                      "ranks go to waiting jobs")


def queue_order(changes: Sequence[tuple[Candidate, SizeChange]]
                ) -> list[tuple[Candidate, SizeChange]]:
    """The order in which ``for_queue``'s give-backs are taken while jobs wait: probes first
    (they fill in a curve), then by ``shrink_key`` (the least speedup lost per slot, for the
    time the job has left)."""
    def key(pair: tuple[Candidate, SizeChange]) -> tuple[bool, tuple[int, float]]:
        c, change = pair
        return (not change.probe,
                shrink_key(loss_per_slot(c.model, change.old, change.new), c.left_s))

    return sorted(changes, key=key)


def _costs(lost: float) -> str:
    return (f"costs {lost:.0%} of its speedup" if lost >= 0
            else f"raises its speedup by {-lost:.0%}")
