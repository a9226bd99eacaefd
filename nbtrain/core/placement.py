"""Topology-aware gang placement: which slot runs which rank (pure).

The one placement logic of nbtrain: the live engine, the scheduler and the simulator all call it.

Rules, in order of strength:

1. All or nothing: a job gets ``world_size`` slots or ``None``.
2. Tensor-parallel groups sit inside one NVLink domain (hard: TP over the network is 2x-5x
   slower, so such a placement is refused rather than made).
3. The job goes to the smallest domain (NVLink domain, host, leaf, pod, cluster) that can hold
   it, and among those the one with the fewest free slots (best fit), which keeps big domains
   whole for big jobs.
4. A job that must span several domains takes the largest free pieces first and fits the
   remainder tightly; each DP replica (``tp * cp * pp`` ranks) stays inside one child domain
   when the free space allows (soft), so pipeline stages share a leaf switch.

Ranks are numbered with DP outermost and TP innermost, the order of
``torch.distributed.device_mesh.init_device_mesh(device, placement.mesh_shape,
mesh_dim_names=placement.mesh_dim_names)`` with ``mesh_dim_names == ("dp", "pp", "cp", "tp")``:
consecutive ranks form a TP group. Launch rank ``r`` on ``placement.slots[r]``.

Engine use::

    topo = Topology.from_hosts({"10.0.0.1": ["tcp://10.0.0.1:1", "tcp://10.0.0.1:2"], ...})
    p = place(topo, free_slots={...}, world_size=2, layout=Layout(tp=1))
    if p is None: ...          # does not fit now: the whole gang waits
    p.slots                    # slot id per rank

``check_feasible(topo, world_size, layout)`` raises (naming the fix) when a job could never fit
this topology. ``policy="first_fit"`` (first free slots in index order, ignoring NVLink) and
``"random"`` are the naive baselines the simulator and benchmark compare against.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from nbtrain.core.slotstate import FREE, SlotState
from nbtrain.core.topology import LEVELS, Topology

__all__ = [
    "MESH_DIM_NAMES",
    "POLICIES",
    "CommCost",
    "CommModel",
    "Layout",
    "Placement",
    "check_feasible",
    "comm_cost",
    "place",
    "place_indices",
]

MESH_DIM_NAMES: tuple[str, str, str, str] = ("dp", "pp", "cp", "tp")
POLICIES: tuple[str, ...] = ("topology", "first_fit", "random")

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Layout:
    """Parallel layout of a job: tensor, pipeline and context parallel degrees.

    The data-parallel degree follows from the world size: ``dp = world_size // (tp * cp * pp)``
    (give ``dp`` to have it checked). A world size must be a multiple of ``replica``.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ValueError(f"Layout.dp must be a positive integer or None, got {self.dp!r}")

    @property
    def replica(self) -> int:
        """Ranks in one data-parallel replica: ``tp * cp * pp``."""
        return self.tp * self.cp * self.pp

    def mesh_shape(self, world_size: int) -> tuple[int, int, int, int]:
        """``(dp, pp, cp, tp)`` for ``world_size``; raises naming the fix if it does not divide."""
        if world_size < 1 or world_size % self.replica:
            raise ValueError(
                f"world_size={world_size} is not a multiple of tp*cp*pp={self.replica} "
                f"(tp={self.tp}, cp={self.cp}, pp={self.pp}): use a world size of "
                f"k*{self.replica} or change the layout"
            )
        dp = world_size // self.replica
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"Layout.dp={self.dp} but world_size={world_size} gives dp={dp} with "
                f"tp*cp*pp={self.replica}: drop dp or make world_size={self.dp * self.replica}"
            )
        return (dp, self.pp, self.cp, self.tp)


@dataclass(frozen=True)
class CommModel:
    """Relative bytes per step that one adjacent pair of ranks exchanges, per parallel dim.

    TP all-reduces activations every layer (heaviest), CP exchanges KV blocks, DP all-reduces
    gradients once per step, PP sends activations between neighbouring stages (lightest).
    Only the ratios matter: costs are compared between placements of the same job.
    """

    tp: float = 8.0
    cp: float = 4.0
    dp: float = 2.0
    pp: float = 1.0


@dataclass(frozen=True)
class CommCost:
    """Estimated traffic of one placement, per level in ``LEVELS`` (relative units per step).

    ``time`` is traffic divided by bandwidth summed over levels (relative link-seconds);
    ``uplink`` is the traffic that leaves a leaf switch (levels ``pod`` and ``cluster``).
    ``dim_time`` is, per mesh dim in ``MESH_DIM_NAMES`` order, the dim's weight over the
    bandwidth of its slowest link: a ring collective runs at the pace of that link, so this is
    what a poor placement adds to a step. ``tp_groups`` and ``tp_in_nvlink`` count the TP
    groups (tp > 1) and those inside one NVLink domain.
    """

    traffic: tuple[float, ...]
    time: float
    tp_groups: int
    tp_in_nvlink: int
    dim_time: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    @property
    def uplink(self) -> float:
        return float(sum(self.traffic[LEVELS.index("pod") :]))

    def by_level(self) -> dict[str, float]:
        return dict(zip(LEVELS, self.traffic, strict=True))


@dataclass(frozen=True)
class Placement:
    """Where each rank runs. ``slots[r]`` is the slot id of rank ``r``; ``indices`` the same
    as topology slot numbers. ``cost`` (and ``first_fit_cost`` when asked for) estimate the
    communication of this placement and of naive first fit for the same job."""

    slots: tuple[Hashable, ...]
    indices: tuple[int, ...]
    layout: Layout
    mesh_shape: tuple[int, int, int, int]
    mesh_dim_names: tuple[str, str, str, str] = MESH_DIM_NAMES
    cost: CommCost | None = None
    first_fit_cost: CommCost | None = None

    @property
    def world_size(self) -> int:
        return len(self.slots)


def place(
    topology: Topology,
    free_slots: Iterable[Hashable] | None,
    world_size: int,
    layout: Layout | None = None,
    *,
    policy: str = "topology",
    seed: int = 0,
    compare: bool = False,
    model: CommModel | None = None,
) -> Placement | None:
    """Place a gang of ``world_size`` ranks on ``free_slots`` (all slots when ``None``).

    Returns ``None`` when the gang does not fit now (never a partial placement), including
    when it is larger than the whole cluster or its TP degree exceeds every NVLink domain:
    workers may still join. ``check_feasible`` says whether it could ever fit this topology.
    ``compare=True`` also fills ``first_fit_cost``. Raises ``ValueError`` only for a malformed
    request (world size not a multiple of ``tp * cp * pp``).
    """
    layout = layout or Layout()
    shape = layout.mesh_shape(world_size)
    if layout.tp > topology.max_nvlink:
        return None
    state = SlotState(topology)
    if free_slots is not None:
        owner = np.zeros(topology.n_slots, dtype=np.int64)
        owner[topology.indices(list(free_slots))] = FREE
        state = SlotState(topology, owner)
    idx = place_indices(state, world_size, layout, policy=policy, seed=seed)
    if idx is None:
        return None
    ff = None
    if compare:
        ff_idx = place_indices(state, world_size, layout, policy="first_fit")
        ff = None if ff_idx is None else comm_cost(topology, ff_idx, layout, model)
    return Placement(
        slots=tuple(topology.slot_ids[i] for i in idx.tolist()),
        indices=tuple(idx.tolist()),
        layout=layout,
        mesh_shape=shape,
        cost=comm_cost(topology, idx, layout, model),
        first_fit_cost=ff,
    )


def check_feasible(topology: Topology, world_size: int, layout: Layout, *,
                   check_size: bool = True) -> None:
    """Raise ``ValueError`` naming the fix when no free state of ``topology`` can hold the job.

    ``check_size=False`` skips the size check, for a cluster that may still grow.
    """
    layout.mesh_shape(world_size)
    if not check_size:
        return
    if layout.tp > topology.max_nvlink:
        raise ValueError(
            f"tp={layout.tp} needs an NVLink domain of {layout.tp} slots but the largest here has "
            f"{topology.max_nvlink}: lower tp to at most {topology.max_nvlink}"
        )
    cap = int((np.diff(topology.bounds["nvlink"]) // layout.tp).sum()) * layout.tp
    if world_size > cap:
        raise ValueError(
            f"world_size={world_size} with tp={layout.tp} exceeds what this cluster can ever hold "
            f"({cap} slots in whole TP groups of {topology.n_slots}): ask for at most {cap}"
        )


def place_indices(
    state: SlotState,
    world_size: int,
    layout: Layout,
    *,
    policy: str = "topology",
    seed: int = 0,
    rng: np.random.Generator | None = None,
) -> IntArray | None:
    """The placement core on slot indices: the rank -> slot index array, or ``None``.

    Does not change ``state``. Assumes ``layout.mesh_shape(world_size)`` is valid.
    """
    if world_size > state.n_free:
        return None
    if policy == "topology":
        return _place_topology(state, world_size, layout)
    if policy == "first_fit":
        return state.free_indices()[:world_size]
    if policy == "random":
        gen = rng if rng is not None else np.random.default_rng(seed)
        free = state.free_indices()
        return np.sort(gen.choice(free, size=world_size, replace=False)).astype(np.int64)
    raise ValueError(f"unknown placement policy {policy!r}; choose one of {POLICIES}")


def tp_capacity(state: SlotState, tp: int) -> dict[str, IntArray]:
    """Whole TP groups that fit in each domain, for every tree level.

    At and above the NVLink level a group needs one NVLink domain, so the capacity is the sum of
    ``free // tp`` over its NVLink domains; below it (hosts inside a multi-host NVLink domain)
    it is ``free // tp`` of the domain itself, a conservative figure used only for best fit.
    """
    topo = state.topo
    p = topo.nvl_pos
    nvl = topo.tree[p]
    base = state.free_count[nvl] // tp
    cap: dict[str, IntArray] = {nvl: base}
    cs = np.concatenate(([0], np.cumsum(base)))
    for name in topo.tree[p + 1 :]:
        nb = topo.nvl_bounds[name]
        cap[name] = cs[nb[1:]] - cs[nb[:-1]]
    for name in topo.tree[:p]:
        cap[name] = state.free_count[name] // tp
    return cap


def _place_topology(state: SlotState, world_size: int, layout: Layout) -> IntArray | None:
    topo = state.topo
    tp = layout.tp
    k = world_size // tp
    cap = tp_capacity(state, tp)
    if int(cap[topo.tree[-1]].sum()) < k:
        return None
    # Best fit: the tightest domain at the smallest level that holds the whole job.
    for i, name in enumerate(topo.tree):
        c = cap[name]
        fits = c >= k
        if fits.any():
            d = int(np.where(fits, c, np.iinfo(np.int64).max).argmin())
            out: list[IntArray] = []
            _allocate(state, cap, i, d, k, layout, out)
            return np.concatenate(out)
    return None  # unreachable: the top level holds k


def _allocate(
    state: SlotState,
    cap: dict[str, IntArray],
    level: int,
    d: int,
    units: int,
    layout: Layout,
    out: list[IntArray],
) -> None:
    """Append the slots for ``units`` TP groups taken from domain ``d`` of tree level ``level``.

    At or below the NVLink level a TP group may use any free slots of the domain, so the work
    is counted in slots; above it, in whole TP groups per child domain.
    """
    topo = state.topo
    tree = topo.tree
    if level == 0:
        b = topo.bounds[tree[0]]
        out.append(state.free_indices(int(b[d]), int(b[d + 1]))[: units * layout.tp])
        return
    cb = topo.child_bounds[tree[level]]
    c0, c1 = int(cb[d]), int(cb[d + 1])
    child = tree[level - 1]
    if level <= topo.nvl_pos:
        # Inside one NVLink domain: plain slots, best fit over hosts.
        _allocate_slots(state, level, d, units * layout.tp, out)
        return
    caps = cap[child][c0:c1]
    r = layout.replica // layout.tp
    if r > 1 and units % r == 0 and int((caps // r).sum()) >= units // r:
        js, amounts = _multi_fit(caps // r, units // r)
        amounts = amounts * r
    else:
        js, amounts = _multi_fit(caps, units)
    if level - 1 == 0:
        out.append(_gather(state, c0 + js, amounts * layout.tp))
        return
    for j, amount in zip(js.tolist(), amounts.tolist(), strict=True):
        _allocate(state, cap, level - 1, c0 + j, amount, layout, out)


def _allocate_slots(state: SlotState, level: int, d: int, need: int, out: list[IntArray]) -> None:
    """``need`` free slots from domain ``d`` of tree level ``level`` (inside one NVLink domain)."""
    topo = state.topo
    tree = topo.tree
    if level == 0:
        b = topo.bounds[tree[0]]
        out.append(state.free_indices(int(b[d]), int(b[d + 1]))[:need])
        return
    cb = topo.child_bounds[tree[level]]
    c0, c1 = int(cb[d]), int(cb[d + 1])
    js, amounts = _multi_fit(state.free_count[tree[level - 1]][c0:c1], need)
    if level - 1 == 0:
        out.append(_gather(state, c0 + js, amounts))
        return
    for j, amount in zip(js.tolist(), amounts.tolist(), strict=True):
        _allocate_slots(state, level - 1, c0 + j, amount, out)


def _gather(state: SlotState, doms: IntArray, amounts: IntArray) -> IntArray:
    """The first ``amounts[i]`` free slots of finest-level domain ``doms[i]``, in order.

    One pass of array operations for all domains: a 1,024-rank job touches 128 domains.
    """
    b = state.topo.bounds[state.topo.tree[0]]
    starts = b[doms]
    lens = b[doms + 1] - starts
    total = int(lens.sum())
    owner_of = np.repeat(np.arange(doms.shape[0]), lens)
    offsets = np.repeat(np.cumsum(lens) - lens, lens)
    slots = np.repeat(starts, lens) + np.arange(total) - offsets
    free = state.owner[slots] == FREE
    slots, owner_of = slots[free], owner_of[free]
    first = np.searchsorted(owner_of, owner_of, side="left")
    rank = np.arange(slots.shape[0]) - first
    picked: IntArray = slots[rank < amounts[owner_of]].astype(np.int64)
    return picked


def _multi_fit(caps: IntArray, need: int) -> tuple[IntArray, IntArray]:
    """Split ``need`` over children with capacities ``caps``: (children, amounts), in order.

    One child when one can hold it all (the tightest such child); otherwise the largest
    children whole, then the tightest remaining child that holds the remainder.
    """
    big = np.iinfo(np.int64).max
    fits = caps >= need
    if fits.any():
        j = int(np.where(fits, caps, big).argmin())
        return np.asarray([j], dtype=np.int64), np.asarray([need], dtype=np.int64)
    order = np.argsort(-caps, kind="stable")
    cums = np.cumsum(caps[order])
    m = int(np.searchsorted(cums, need))  # the first m children (largest) fall short
    if m >= order.shape[0]:
        raise RuntimeError(f"capacity {caps.tolist()} cannot hold {need}: placement bug")
    rem = need - int(cums[m - 1])
    rest = order[m:]
    rc = caps[rest]
    j = int(rest[int(np.where(rc >= rem, rc, big).argmin())])
    js = np.concatenate((order[:m], [j])).astype(np.int64)
    amounts = np.concatenate((caps[order[:m]], [rem])).astype(np.int64)
    sort = np.argsort(js)
    return js[sort], amounts[sort]


def comm_cost(
    topology: Topology,
    indices: IntArray | tuple[int, ...],
    layout: Layout,
    model: CommModel | None = None,
) -> CommCost:
    """Traffic per level of a placement (``indices[r]`` = slot of rank r) under ``model``.

    TP, CP and DP groups exchange in rings, PP stages with their neighbours; each adjacent pair
    adds the dim's weight at the level where the two slots meet.
    """
    model = model or CommModel()
    idx = np.asarray(indices, dtype=np.int64)
    shape = layout.mesh_shape(int(idx.shape[0]))
    grid = idx.reshape(shape)
    traffic = np.zeros(len(LEVELS), dtype=np.float64)
    bw = np.asarray(topology.bandwidth.as_tuple())
    dim_time = [0.0, 0.0, 0.0, 0.0]
    for axis, name in enumerate(MESH_DIM_NAMES):
        n = shape[axis]
        if n < 2:
            continue
        if name == "pp":
            a = np.take(grid, np.arange(n - 1), axis=axis).ravel()
            b = np.take(grid, np.arange(1, n), axis=axis).ravel()
        else:
            a = grid.ravel()
            b = np.roll(grid, -1, axis=axis).ravel()
            if n == 2:  # a ring of two is one pair
                a = np.take(grid, [0], axis=axis).ravel()
                b = np.take(grid, [1], axis=axis).ravel()
        levels = topology.pair_level(a, b)
        traffic += np.bincount(levels, minlength=len(LEVELS)) * getattr(model, name)
        dim_time[axis] = float(getattr(model, name) / bw[levels].min())
    tp_groups = 0
    tp_in = 0
    if layout.tp > 1:
        groups = topology.dom["nvlink"][idx].reshape(-1, layout.tp)
        tp_groups = int(groups.shape[0])
        tp_in = int((groups == groups[:, :1]).all(axis=1).sum())
    return CommCost(
        traffic=tuple(float(x) for x in traffic),
        time=float((traffic / bw).sum()),
        tp_groups=tp_groups,
        tp_in_nvlink=tp_in,
        dim_time=(dim_time[0], dim_time[1], dim_time[2], dim_time[3]),
    )
