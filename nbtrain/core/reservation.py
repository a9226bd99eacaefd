"""Shadow time of the blocked head job: after which running jobs end will it fit? (pure)

EASY backfill needs, at every decision, the earliest point at which the head of the queue can
start if running jobs end at their estimates. Replaying job ends one by one and recounting is
quadratic at thousands of running jobs; here the replay is a few array passes over the held
slots: for each released slot, the number of whole TP groups its NVLink domain gains is 0 or 1,
and a cumulative sum over the job order finds the first job after which the head fits.

The releases are read lazily, in chunks that double in size, because the head usually fits
after the first few ends: the work then follows the jobs the head waits for, not every job
running on the cluster.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import numpy as np
import numpy.typing as npt

from nbtrain.core.slotstate import SlotState

__all__ = ["releases_needed"]

IntArray = npt.NDArray[np.int64]

FIRST_CHUNK = 8
"""Releases read in the first pass; each later pass reads twice as many."""


def releases_needed(
    state: SlotState, tp: int, units: int, releases: Iterable[IntArray]
) -> int | None:
    """Smallest ``m`` such that freeing the first ``m`` of ``releases`` (slot index arrays, in
    end order) gives ``units`` whole TP groups of ``tp`` slots; ``None`` if even all of them
    do not. Reads no further into ``releases`` than the chunk holding the answer.

    Slots whose worker is gone are not counted: they will not come back as free.
    """
    topo = state.topo
    nvl = topo.tree[topo.nvl_pos]
    dom_of = topo.dom[nvl]
    free = state.free_count[nvl]
    cap = int((free // tp).sum())
    if cap >= units:
        return 0
    it = iter(releases)
    count = free.copy()  # free slots per NVLink domain once the releases so far are done
    done = 0
    chunk = FIRST_CHUNK
    while True:
        part = list(islice(it, chunk))
        if not part:
            return None
        sizes = np.fromiter((r.shape[0] for r in part), dtype=np.int64, count=len(part))
        slots = np.concatenate(part) if sizes.sum() else np.zeros(0, dtype=np.int64)
        job = np.repeat(np.arange(len(part), dtype=np.int64), sizes)
        keep = ~state.gone[slots]
        slots, job = slots[keep], job[keep]
        dom = dom_of[slots]
        order = np.lexsort((job, dom))  # by domain, then by end order
        d_sorted = dom[order]
        first = np.searchsorted(d_sorted, d_sorted, side="left")
        rank = np.arange(d_sorted.shape[0], dtype=np.int64) - first + 1
        new = count[d_sorted] + rank
        gain = new // tp - (new - 1) // tp
        per_job = np.bincount(job[order], weights=gain, minlength=len(part))
        cum = cap + np.cumsum(per_job)
        hit = np.flatnonzero(cum >= units)
        if hit.shape[0]:
            return done + int(hit[0]) + 1
        cap = int(cum[-1])
        count += np.bincount(dom, minlength=count.shape[0])
        done += len(part)
        chunk *= 2
