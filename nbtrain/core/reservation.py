"""Shadow time of the blocked head job: after which running jobs end will it fit? (pure)

EASY backfill needs, at every decision, the earliest point at which the head of the queue can
start if running jobs end at their estimates. Replaying job ends one by one and recounting is
quadratic at thousands of running jobs; here the whole replay is one sort over the held slots:
for each released slot, the number of whole TP groups its NVLink domain gains is 0 or 1, and a
cumulative sum over the job order finds the first job after which the head fits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from nbtrain.core.slotstate import SlotState

__all__ = ["releases_needed"]

IntArray = npt.NDArray[np.int64]


def releases_needed(
    state: SlotState, tp: int, units: int, releases: Sequence[IntArray]
) -> int | None:
    """Smallest ``m`` such that freeing ``releases[:m]`` (slot index arrays, in end order)
    gives ``units`` whole TP groups of ``tp`` slots; ``None`` if even all of them do not.

    Slots whose worker is gone are not counted: they will not come back as free.
    """
    topo = state.topo
    nvl = topo.tree[topo.nvl_pos]
    free = state.free_count[nvl]
    cap0 = int((free // tp).sum())
    if cap0 >= units:
        return 0
    if not releases:
        return None
    sizes = np.fromiter((r.shape[0] for r in releases), dtype=np.int64, count=len(releases))
    slots = np.concatenate(list(releases)) if sizes.sum() else np.zeros(0, dtype=np.int64)
    job = np.repeat(np.arange(len(releases), dtype=np.int64), sizes)
    keep = ~state.gone[slots]
    slots, job = slots[keep], job[keep]
    dom = topo.dom[nvl][slots]
    order = np.lexsort((job, dom))  # by domain, then by end order
    d_sorted = dom[order]
    first = np.searchsorted(d_sorted, d_sorted, side="left")
    rank = np.arange(d_sorted.shape[0], dtype=np.int64) - first + 1
    new = free[d_sorted] + rank
    gain = new // tp - (new - 1) // tp
    per_job = np.bincount(job[order], weights=gain, minlength=len(releases))
    cum = cap0 + np.cumsum(per_job)
    hit = np.flatnonzero(cum >= units)
    return int(hit[0]) + 1 if hit.shape[0] else None
