"""The shadow-time search reads job ends lazily and still finds what a one-by-one replay finds."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from nbtrain.core.reservation import releases_needed
from nbtrain.core.slotstate import FREE, SlotState
from nbtrain.core.topology import Topology


def _replay(state: SlotState, tp: int, units: int, releases: list[np.ndarray]) -> int | None:
    """Reference: free the jobs one at a time and recount whole TP groups per NVLink domain."""
    trial = state.copy()
    nvl = trial.topo.tree[trial.topo.nvl_pos]
    for m in range(len(releases) + 1):
        if m:
            trial.release(releases[m - 1])
        if int((trial.free_count[nvl] // tp).sum()) >= units:
            return m
    return None


@pytest.mark.parametrize("seed", range(40))
def test_lazy_search_matches_a_one_by_one_replay(seed: int) -> None:
    rng = np.random.default_rng(seed)
    topo = [Topology.declare(16, 8, hosts_per_leaf=4),
            Topology.declare(16, 4, hosts_per_leaf=8, nvlink_hosts=4),
            Topology.declare(8, 8, nvlink_gpus=2)][seed % 3]
    owner = np.full(topo.n_slots, FREE, dtype=np.int64)
    jobs = rng.integers(0, 60, size=topo.n_slots)  # job numbers; some slots stay free
    busy = rng.random(topo.n_slots) < 0.85
    owner[busy] = jobs[busy]
    state = SlotState(topo, owner)
    gone = rng.random(topo.n_slots) < 0.05  # workers lost: their slots never come back free
    state.set_offline(np.flatnonzero(gone).astype(np.int64))
    order = rng.permutation(np.unique(owner[owner >= 0]))
    releases = [np.flatnonzero(owner == j).astype(np.int64) for j in order]
    read = 0

    def lazily() -> Iterator[np.ndarray]:
        nonlocal read
        for r in releases:
            read += 1
            yield r

    tp = int(rng.choice([1, 2, 4, 8]))
    tp = min(tp, topo.max_nvlink)
    units = int(rng.integers(1, topo.n_slots // tp + 2))
    want = _replay(state, tp, units, releases)
    assert releases_needed(state, tp, units, lazily()) == want
    if want is not None:  # it stops reading within the chunk that holds the answer
        assert read < max(2 * want, 8) + 8
