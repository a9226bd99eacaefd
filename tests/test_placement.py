"""Placement: the engine's API, hard NVLink rule, best fit, locality, and the naive baselines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbtrain.core.placement import (
    MESH_DIM_NAMES,
    Layout,
    check_feasible,
    comm_cost,
    place,
    place_indices,
)
from nbtrain.core.slotstate import FREE, SlotState
from nbtrain.core.topology import Topology


def _state(topo: Topology, free: np.ndarray) -> SlotState:
    return SlotState(topo, np.where(free, FREE, 0).astype(np.int64))


def test_engine_api_from_brief() -> None:
    topo = Topology.from_hosts({"10.0.0.1": ["slotA", "slotB"], "10.0.0.2": ["slotC"]})
    p = place(topo, free_slots={"slotA", "slotC"}, world_size=2, layout=Layout(tp=1, pp=1))
    assert p is not None
    assert sorted(p.slots) == ["slotA", "slotC"]
    assert p.mesh_shape == (2, 1, 1, 1) and p.mesh_dim_names == MESH_DIM_NAMES
    # A gang is all or nothing: three ranks on two free slots do not fit.
    assert place(topo, free_slots={"slotA", "slotC"}, world_size=3) is None
    # tp=2 needs both ranks in one NVLink domain (one host here): A and C are on two hosts.
    assert place(topo, free_slots={"slotA", "slotC"}, world_size=2, layout=Layout(tp=2)) is None
    assert place(topo, free_slots=None, world_size=2, layout=Layout(tp=2)).slots == (
        "slotA", "slotB")


def test_layout_errors_name_the_fix() -> None:
    topo = Topology.declare(2, 8)
    with pytest.raises(ValueError, match="not a multiple of tp\\*cp\\*pp=8"):
        place(topo, None, 12, Layout(tp=8))
    # too big for this cluster: no placement now (workers may join); check_feasible says why
    assert place(topo, None, 16, Layout(tp=16)) is None
    assert place(topo, None, 32, Layout(tp=8)) is None
    with pytest.raises(ValueError, match="lower tp to at most 8"):
        check_feasible(topo, 16, Layout(tp=16))
    with pytest.raises(ValueError, match="exceeds what this cluster can ever hold"):
        check_feasible(topo, 32, Layout(tp=8))
    with pytest.raises(ValueError, match=r"Layout\.dp=3"):
        place(topo, None, 16, Layout(tp=8, dp=3))


def test_best_fit_keeps_whole_hosts_whole() -> None:
    topo = Topology.declare(4, 8)
    free = np.ones(32, dtype=bool)
    free[8:12] = False  # host 1 has 4 free; hosts 0, 2, 3 are whole
    idx = place_indices(_state(topo, free), 4, Layout())
    assert idx is not None and set(idx.tolist()) == {12, 13, 14, 15}


def test_smallest_enclosing_domain_is_preferred() -> None:
    topo = Topology.declare(8, 8, hosts_per_leaf=4)
    free = np.zeros(64, dtype=bool)
    free[0:4] = True  # 4 free on host 0 (leaf 0)
    free[8:12] = True  # 4 free on host 1 (leaf 0)
    free[32:48] = True  # hosts 4 and 5 whole (leaf 1)
    free[56:64] = True  # host 7 whole (leaf 1)
    idx = place_indices(_state(topo, free), 8, Layout(tp=8))
    assert idx is not None and set(topo.dom["host"][idx].tolist()) in ({4}, {5}, {7})
    # 16 ranks with tp=4: leaf 0 holds two TP groups only, leaf 1 holds all four.
    idx = place_indices(_state(topo, free), 16, Layout(tp=4))
    assert idx is not None and set(topo.dom["leaf"][idx].tolist()) == {1}


def test_pipeline_replicas_stay_under_one_leaf_when_they_can() -> None:
    topo = Topology.declare(12, 8, hosts_per_leaf=4)
    free = np.ones(96, dtype=bool)
    free[0:8] = False  # leaf 0: 3 free hosts
    free[32:40] = False  # leaf 1: 3 free hosts; leaf 2: 4 free hosts
    layout = Layout(tp=8, pp=2)  # a replica (2 pipeline stages) is 2 hosts
    idx = place_indices(_state(topo, free), 64, layout)  # 4 replicas on 8 of the 10 hosts
    assert idx is not None
    leaves = topo.dom["leaf"][idx].reshape(4, 16)  # one row per DP replica
    # Filling leaves 3 + 3 + 2 hosts would split a replica over two leaves; 2 + 2 + 4 does not.
    assert (leaves == leaves[:, :1]).all(), leaves
    assert sorted(np.bincount(leaves[:, 0], minlength=3).tolist()) == [1, 1, 2]


def test_rank_order_matches_device_mesh() -> None:
    topo = Topology.declare(8, 8, hosts_per_leaf=4)
    p = place(topo, None, 32, Layout(tp=4, pp=2))
    assert p is not None and p.mesh_shape == (4, 2, 1, 4)
    nvl = topo.dom["nvlink"][np.asarray(p.indices)].reshape(p.mesh_shape)
    # the last mesh dim is TP: every TP group is one NVLink domain
    assert (nvl == nvl[..., :1]).all()


def test_topology_beats_first_fit_on_a_fragmented_cluster() -> None:
    topo = Topology.declare(16, 8, hosts_per_leaf=4, leaves_per_pod=2)
    rng = np.random.default_rng(3)
    free = np.ones(128, dtype=bool)
    free[rng.choice(64, size=40, replace=False)] = False  # leaves 0-1 fragmented
    state = _state(topo, free)
    layout = Layout(tp=8)
    ours = place_indices(state, 32, layout)
    naive = place_indices(state, 32, layout, policy="first_fit")
    assert ours is not None and naive is not None
    c_ours = comm_cost(topo, ours, layout)
    c_naive = comm_cost(topo, naive, layout)
    assert c_ours.tp_in_nvlink == c_ours.tp_groups == 4
    assert c_naive.tp_in_nvlink < 4
    assert c_ours.time < c_naive.time
    assert c_ours.uplink <= c_naive.uplink
    p = place(topo, [topo.slot_ids[i] for i in np.flatnonzero(free)], 32, layout, compare=True)
    assert p is not None and p.cost == c_ours and p.first_fit_cost == c_naive


def test_multi_host_nvlink_domain_holds_wide_tp() -> None:
    topo = Topology.declare(36, 4, nvlink_hosts=18, hosts_per_leaf=18)
    p = place(topo, None, 32, Layout(tp=16))
    assert p is not None
    nvl = topo.dom["nvlink"][np.asarray(p.indices)].reshape(2, 16)
    assert (nvl == nvl[:, :1]).all()
    # a small job stays on one host (tray) inside the rack
    p = place(topo, None, 4, Layout())
    assert p is not None and len(set(topo.dom["host"][np.asarray(p.indices)].tolist())) == 1


def test_random_policy_is_seeded() -> None:
    topo = Topology.declare(4, 8)
    a = place(topo, None, 6, policy="random", seed=5)
    b = place(topo, None, 6, policy="random", seed=5)
    assert a is not None and b is not None and a.slots == b.slots


_TOPOS = [
    Topology.declare(8, 8, hosts_per_leaf=2, leaves_per_pod=2),
    Topology.declare(6, 4, nvlink_gpus=2, hosts_per_leaf=3),
    Topology.declare(8, 4, nvlink_hosts=4, hosts_per_leaf=4),
    Topology.from_hosts({f"h{i}": [f"h{i}/{j}" for j in range(1 + i % 3)] for i in range(7)}),
]


@settings(max_examples=150, deadline=None)
@given(
    which=st.integers(0, len(_TOPOS) - 1),
    seed=st.integers(0, 2**32 - 1),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2]),
    dp=st.integers(1, 4),
    density=st.floats(0.0, 1.0),
)
def test_placement_is_valid_and_complete(
    which: int, seed: int, tp: int, pp: int, dp: int, density: float
) -> None:
    """Any free pattern: a placement uses distinct free slots with every TP group in one
    NVLink domain, and it exists whenever enough whole TP groups are free."""
    topo = _TOPOS[which]
    if tp > topo.max_nvlink:
        return
    rng = np.random.default_rng(seed)
    free = rng.uniform(size=topo.n_slots) < density
    state = _state(topo, free)
    layout = Layout(tp=tp, pp=pp)
    size = tp * pp * dp
    idx = place_indices(state, size, layout)
    nvl = topo.dom["nvlink"]
    groups = int((np.bincount(nvl[free], minlength=topo.n_domains["nvlink"]) // tp).sum())
    if groups * tp < size:
        assert idx is None
        return
    assert idx is not None, "a fitting gang was refused"
    assert idx.shape == (size,) and len(set(idx.tolist())) == size
    assert free[idx].all()
    g = nvl[idx].reshape(-1, tp)
    assert (g == g[:, :1]).all()
