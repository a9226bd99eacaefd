"""Victim choice for preemption: free a domain the preemptor can use, losing the least work.

The failure this avoids: a scheduler preempts the cheapest jobs wherever they run, frees
scattered slots, and the preemptor (say 8 ranks with tp=8) still cannot start because no
single NVLink domain became free. Here victims are chosen per domain: in each candidate domain,
at every level that could hold the job once its lower-priority jobs are gone, take the victims
with the least lost work per usable slot until whole TP groups fit, drop any victim that turns
out unnecessary, and keep the domain (at any level; the finer on ties) whose victims lose the
least work in total. The scheduler
then checks with the real placement that the preemptor fits before it preempts anyone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from nbtrain.core.placement import Layout
from nbtrain.core.slotstate import FREE, SlotState

__all__ = ["VictimPlan", "choose_victims"]

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class VictimPlan:
    """Owners (job numbers) to preempt, their total lost work, and the domain they free."""

    victims: tuple[int, ...]
    lost: float
    level: str
    domain: int


def choose_victims(
    state: SlotState,
    size: int,
    layout: Layout,
    cost: Mapping[int, float],
    *,
    max_domains: int = 64,
) -> VictimPlan | None:
    """Cheapest set of candidate owners whose release lets ``size`` ranks fit in one domain.

    ``state``: slots free now or about to be (jobs already stopping counted as free).
    ``cost``: lost work if preempted, for each owner that may be preempted.
    Considers at most ``max_domains`` domains (those needing the fewest victims first), which
    bounds the time of a decision at 8,192 slots.
    """
    if not cost:
        return None
    topo = state.topo
    tp = layout.tp
    k = size // tp
    owner = state.owner
    cand = np.fromiter(cost.keys(), dtype=np.int64)
    cand_mask = np.isin(owner, cand)
    reclaim = (owner == FREE) | cand_mask
    p = topo.nvl_pos
    tree = topo.tree
    # Every level is searched and the cheapest plan wins (finer levels on ties): stopping at
    # the finest level with any plan preempted four jobs on one host where two plus the free
    # slots of the neighbour host sufficed.
    best: VictimPlan | None = None
    best_key: tuple[float, int, int, int] | None = None
    for i, name in enumerate(tree):
        if best is not None and len(best.victims) <= 1:
            break  # a coarser domain cannot do with fewer victims; keep the finer one
        unit = tree[min(i, p)] if i >= p else name
        counts = np.bincount(topo.dom[unit][reclaim], minlength=topo.n_domains_of(unit))
        base = counts // tp
        if i >= p:
            cs = np.concatenate(([0], np.cumsum(base)))
            nb = topo.nvl_bounds[name]
            cap = cs[nb[1:]] - cs[nb[:-1]]
        else:
            cap = base
        ok = np.flatnonzero(cap >= k)
        if ok.shape[0] == 0:
            continue
        # Fewest slots to reclaim first: domains that already have the most free slots.
        free_now = state.free_count[name][ok]
        ok = ok[np.argsort(-free_now, kind="stable")][:max_domains]
        for d in ok.tolist():
            plan = _plan_domain(state, name, unit, int(d), k, tp, cand_mask, cost)
            if plan is None:
                continue
            key = (plan.lost, len(plan.victims), i, d)
            if best_key is None or key < best_key:
                best, best_key = plan, key
    return best


def _plan_domain(
    state: SlotState,
    level: str,
    unit: str,
    d: int,
    k: int,
    tp: int,
    cand_mask: npt.NDArray[np.bool_],
    cost: Mapping[int, float],
) -> VictimPlan | None:
    topo = state.topo
    b = topo.bounds[level]
    a, z = int(b[d]), int(b[d + 1])
    unit_dom = topo.dom[unit]
    u0 = int(unit_dom[a])
    counts = state.free_count[unit][u0 : int(unit_dom[z - 1]) + 1].copy()
    owners = state.owner[a:z]
    local = owners[cand_mask[a:z]]
    if local.shape[0] == 0:
        return None
    victims, n_local = np.unique(local, return_counts=True)
    units_of: dict[int, IntArray] = {}
    for v in victims.tolist():
        slots = a + np.flatnonzero(owners == v)
        units_of[v] = unit_dom[slots] - u0
    order = sorted(
        victims.tolist(),
        key=lambda v: (cost[v] / max(1, int(n_local[np.searchsorted(victims, v)])), v),
    )
    chosen: list[int] = []
    for v in order:
        if int((counts // tp).sum()) >= k:
            break
        np.add.at(counts, units_of[v], 1)
        chosen.append(v)
    if int((counts // tp).sum()) < k:
        return None
    # Drop victims the domain turned out not to need (the most expensive first).
    for v in sorted(chosen, key=lambda v: (-cost[v], v)):
        np.add.at(counts, units_of[v], -1)
        if int((counts // tp).sum()) >= k:
            chosen.remove(v)
        else:
            np.add.at(counts, units_of[v], 1)
    return VictimPlan(
        victims=tuple(sorted(chosen)),
        lost=float(sum(cost[v] for v in chosen)),
        level=level,
        domain=d,
    )
