"""Cluster topology: slots grouped into NVLink domains, hosts, leaf switches, pods (pure).

Why a model at all: whether tensor parallelism runs over NVLink or over the network decides a
2x-5x step time, and whether a job sits under one leaf switch decides how much traffic crosses
the oversubscribed spine. Placement (``nbtrain.core.placement``) and the gang scheduler
(``nbtrain.core.scheduler``) read this model; they never look at real hardware.

A slot is one device (one GPU, or one CPU slot on a Dask worker). Slot ids are opaque hashables
(the engine uses Dask worker addresses). Internally slots are numbered ``0..n_slots-1`` in tree
order, so every domain at every level is one contiguous index range; that keeps placement a
matter of prefix sums and slices instead of scans over thousands of slots.

Levels, tightest first (``LEVELS``): ``nvlink`` (an NVLink/NVSwitch domain: a whole 8-GPU node,
a pair of GPUs on a partial-NVLink node, or several hosts of an NVL72-like rack), ``host``,
``leaf`` (the top-of-rack switch), ``pod`` (the spine block) and ``cluster``. NVLink domains and
hosts nest one way or the other; both nest inside leaves.

Two constructors:

``Topology.declare(hosts=1024, gpus_per_host=8, hosts_per_leaf=32, leaves_per_pod=8)``
    a simulated or documented cluster; ``nvlink_gpus=2`` for NVLink pairs inside a host,
    ``nvlink_hosts=18`` (with ``gpus_per_host=4``) for a 72-GPU multi-host NVLink domain.
``Topology.from_hosts({"10.0.0.1": ["tcp://10.0.0.1:4001", ...], ...})``
    what the live engine knows: Dask workers grouped by host. Each host is one NVLink domain
    and all hosts share one leaf unless ``nvlink_of`` and ``leaf_of`` (the workers' labels)
    say otherwise.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import numpy.typing as npt

__all__ = ["LEVELS", "Bandwidth", "Topology"]

LEVELS: tuple[str, ...] = ("nvlink", "host", "leaf", "pod", "cluster")
"""Communication levels, tightest first. A pair of slots talks at the first level they share."""

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, kw_only=True)
class Bandwidth:
    """Bandwidth per GPU in GB/s at each level; used only to turn traffic into an estimate.

    The defaults are of the order of an H100 cluster: NVLink 4 through NVSwitch, PCIe between
    GPUs of a host that NVLink does not join, one 400 Gb/s NIC per GPU under the leaf, a 2:1
    oversubscribed spine, and a thinner link between pods.
    """

    nvlink: float = 450.0
    host: float = 64.0
    leaf: float = 50.0
    pod: float = 25.0
    cluster: float = 12.5

    def __post_init__(self) -> None:
        for name in LEVELS:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Bandwidth.{name} must be > 0 GB/s, got {value!r}")

    def as_tuple(self) -> tuple[float, ...]:
        return tuple(float(getattr(self, name)) for name in LEVELS)


@dataclass(frozen=True)
class _Origin:
    """How a topology was built, so hosts can be added later (``Topology.with_hosts``)."""

    kind: str
    leaf_of: Mapping[str, str] = field(default_factory=dict)
    pod_of: Mapping[str, str] = field(default_factory=dict)
    nvlink_of: Mapping[Hashable, str] = field(default_factory=dict)


class Topology:
    """Immutable slot hierarchy. Build it with ``declare`` or ``from_hosts``.

    Public read-only attributes: ``slot_ids`` (index -> id), ``host_names`` (host index -> name),
    ``n_slots``, ``bandwidth``, ``dom[level]`` (domain number of each slot, for every level in
    ``LEVELS``), ``bounds[level]`` (slot index where each domain starts, plus ``n_slots``),
    ``tree`` (the distinct levels in containment order, finest first) and ``max_nvlink``
    (the largest NVLink domain, which caps the tensor-parallel degree).
    """

    def __init__(
        self,
        *,
        slot_ids: Sequence[Hashable],
        host_of_slot: Sequence[int],
        nvl_of_slot: Sequence[int],
        leaf_of_host: Sequence[int],
        pod_of_leaf: Sequence[int],
        host_names: Sequence[str],
        bandwidth: Bandwidth | None = None,
        origin: _Origin | None = None,
    ) -> None:
        """Low-level constructor: every array numbered in tree order. Prefer the classmethods."""
        n = len(slot_ids)
        if n == 0:
            raise ValueError("a topology needs at least one slot; got none")
        self.slot_ids: tuple[Hashable, ...] = tuple(slot_ids)
        self.index: dict[Hashable, int] = {s: i for i, s in enumerate(self.slot_ids)}
        if len(self.index) != n:
            counts: dict[Hashable, int] = {}
            for s in self.slot_ids:
                counts[s] = counts.get(s, 0) + 1
            dup = [s for s, c in counts.items() if c > 1][:3]
            raise ValueError(f"slot ids must be unique; these appear more than once: {dup!r}")
        self.n_slots = n
        self.host_names: tuple[str, ...] = tuple(host_names)
        self.bandwidth = bandwidth or Bandwidth()
        self._origin = origin or _Origin(kind="raw")
        host = np.asarray(host_of_slot, dtype=np.int64)
        nvl = np.asarray(nvl_of_slot, dtype=np.int64)
        leaf = np.asarray(leaf_of_host, dtype=np.int64)[host]
        pod = np.asarray(pod_of_leaf, dtype=np.int64)[leaf]
        self.dom: dict[str, IntArray] = {
            "nvlink": nvl,
            "host": host,
            "leaf": leaf,
            "pod": pod,
            "cluster": np.zeros(n, dtype=np.int64),
        }
        self.bounds: dict[str, IntArray] = {}
        for name, arr in self.dom.items():
            if arr.shape != (n,):
                raise ValueError(f"{name} numbering has {arr.shape[0]} entries for {n} slots")
            self.bounds[name] = _contiguous_bounds(name, arr)
        self.tree: tuple[str, ...] = self._containment_order()
        # For each tree level, where its domains start in units of the next finer tree level.
        self.child_bounds: dict[str, IntArray] = {}
        for fine, coarse in pairwise(self.tree):
            self.child_bounds[coarse] = np.searchsorted(
                self.bounds[fine], self.bounds[coarse]
            ).astype(np.int64)
        # For every level at or above the NVLink level, where its domains start in NVLink domains.
        self.nvl_pos = self.tree.index(self.rep["nvlink"])
        self.nvl_bounds: dict[str, IntArray] = {
            name: np.searchsorted(self.bounds["nvlink"], self.bounds[name]).astype(np.int64)
            for name in self.tree[self.nvl_pos :]
        }
        sizes = np.diff(self.bounds["nvlink"])
        self.max_nvlink = int(sizes.max())
        self.n_domains: dict[str, int] = {k: len(v) - 1 for k, v in self.bounds.items()}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def declare(
        cls,
        hosts: int,
        gpus_per_host: int,
        *,
        hosts_per_leaf: int | None = None,
        leaves_per_pod: int | None = None,
        nvlink_gpus: int | None = None,
        nvlink_hosts: int = 1,
        bandwidth: Bandwidth | None = None,
    ) -> Topology:
        """A regular cluster: ``hosts`` x ``gpus_per_host`` slots named ``"h0007:3"``.

        ``nvlink_gpus`` splits a host into NVLink groups of that many GPUs (2 for NVLink pairs);
        the default is the whole host (an NVSwitch node). ``nvlink_hosts`` joins that many hosts
        into one NVLink domain (NVL72: ``gpus_per_host=4, nvlink_hosts=18``). The last leaf or
        pod may be partly filled when the counts do not divide.
        """
        _positive("hosts", hosts)
        _positive("gpus_per_host", gpus_per_host)
        hpl = hosts if hosts_per_leaf is None else hosts_per_leaf
        _positive("hosts_per_leaf", hpl)
        n_leaves = -(-hosts // hpl)
        lpp = n_leaves if leaves_per_pod is None else leaves_per_pod
        _positive("leaves_per_pod", lpp)
        ng = gpus_per_host if nvlink_gpus is None else nvlink_gpus
        _positive("nvlink_gpus", ng)
        _positive("nvlink_hosts", nvlink_hosts)
        if gpus_per_host % ng:
            raise ValueError(
                f"nvlink_gpus={ng} must divide gpus_per_host={gpus_per_host}: NVLink groups "
                "split a host evenly (e.g. nvlink_gpus=2 for pairs)"
            )
        if nvlink_hosts > 1 and ng != gpus_per_host:
            raise ValueError(
                f"nvlink_hosts={nvlink_hosts} joins whole hosts; it cannot be combined with "
                f"nvlink_gpus={ng} < gpus_per_host={gpus_per_host}"
            )
        if hpl % nvlink_hosts:
            raise ValueError(
                f"nvlink_hosts={nvlink_hosts} must divide hosts_per_leaf={hpl}: a multi-host "
                "NVLink domain (e.g. an NVL72 rack) sits under one leaf switch"
            )
        host_of_slot = np.repeat(np.arange(hosts), gpus_per_host)
        gpu = np.tile(np.arange(gpus_per_host), hosts)
        if nvlink_hosts > 1:
            nvl = host_of_slot // nvlink_hosts
        else:
            nvl = host_of_slot * (gpus_per_host // ng) + gpu // ng
        width = max(4, len(str(hosts - 1)))
        names = [f"h{h:0{width}d}" for h in range(hosts)]
        slot_ids = [f"{names[h]}:{g}" for h, g in zip(host_of_slot, gpu, strict=True)]
        leaf_of_host = np.arange(hosts) // hpl
        pod_of_leaf = np.arange(n_leaves) // lpp
        return cls(
            slot_ids=slot_ids,
            host_of_slot=host_of_slot.tolist(),
            nvl_of_slot=nvl.tolist(),
            leaf_of_host=leaf_of_host.tolist(),
            pod_of_leaf=pod_of_leaf.tolist(),
            host_names=names,
            bandwidth=bandwidth,
            origin=_Origin(kind="declare"),
        )

    @classmethod
    def from_hosts(
        cls,
        hosts: Mapping[str, Sequence[Hashable]],
        *,
        leaf_of: Mapping[str, str] | None = None,
        pod_of: Mapping[str, str] | None = None,
        nvlink_of: Mapping[Hashable, str] | None = None,
        bandwidth: Bandwidth | None = None,
    ) -> Topology:
        """Slots grouped by host, as the engine sees Dask workers (one worker = one slot).

        ``nvlink_of`` maps slot id -> NVLink domain label. Without it (or for slots it does not
        name) a whole host is one NVLink domain (CPU slots share memory; GPUs per host are
        NVSwitch-joined until discovery says otherwise). Labels may split a host into groups
        (NVLink pairs) or join whole hosts into one domain (an NVL72-like rack), not both.
        ``leaf_of`` maps host -> leaf switch label and ``pod_of`` maps leaf label -> pod label;
        hosts without a label share one leaf. Hosts are ordered by (pod, leaf, multi-host
        NVLink domain, given order); slots keep the given order within a host, grouped by
        NVLink domain.
        """
        leaf_of = dict(leaf_of or {})
        pod_of = dict(pod_of or {})
        nvlink_of = dict(nvlink_of or {})
        items = [(h, list(s)) for h, s in hosts.items() if len(s) > 0]
        if not items:
            raise ValueError(
                "from_hosts got no slots: pass {host: [slot ids]}, e.g. Dask workers by host"
            )
        # Labels per (host, position): a slot id listed twice is left for the constructor to
        # report as a duplicate.
        labels = {h: [nvlink_of.get(s) or f"host:{h}" for s in slots] for h, slots in items}
        leaf_label = {h: leaf_of.get(h, "") for h, _ in items}
        pod_label = {h: pod_of.get(leaf_label[h], "") for h, _ in items}
        _check_multi_host(labels, leaf_label)
        first_seen: dict[str, int] = {}
        for i, (h, _) in enumerate(items):
            first_seen.setdefault(labels[h][0], i)
        order = sorted(range(len(items)), key=lambda i: (
            pod_label[items[i][0]], leaf_label[items[i][0]],
            first_seen[labels[items[i][0]][0]], i))
        slot_ids: list[Hashable] = []
        host_of_slot: list[int] = []
        nvl_of_slot: list[int] = []
        nvl_index: dict[str, int] = {}
        names: list[str] = []
        leaf_of_host: list[int] = []
        leaf_index: dict[tuple[str, str], int] = {}
        pod_index: dict[str, int] = {}
        pod_of_leaf: list[int] = []
        for new_h, i in enumerate(order):
            name, slots = items[i]
            names.append(name)
            host_labels = labels[name]
            within = {lab: k for k, lab in enumerate(dict.fromkeys(host_labels))}
            for k in sorted(range(len(slots)), key=lambda k: within[host_labels[k]]):  # stable
                slot_ids.append(slots[k])
                host_of_slot.append(new_h)
                nvl_of_slot.append(nvl_index.setdefault(host_labels[k], len(nvl_index)))
            key = (pod_label[name], leaf_label[name])
            if key not in leaf_index:
                leaf_index[key] = len(leaf_index)
                pod_of_leaf.append(pod_index.setdefault(key[0], len(pod_index)))
            leaf_of_host.append(leaf_index[key])
        return cls(
            slot_ids=slot_ids,
            host_of_slot=host_of_slot,
            nvl_of_slot=nvl_of_slot,
            leaf_of_host=leaf_of_host,
            pod_of_leaf=pod_of_leaf,
            host_names=names,
            bandwidth=bandwidth,
            origin=_Origin(kind="from_hosts", leaf_of=leaf_of, pod_of=pod_of,
                           nvlink_of=nvlink_of),
        )

    def with_hosts(
        self,
        hosts: Mapping[str, Sequence[Hashable]],
        *,
        leaf_of: Mapping[str, str] | None = None,
        nvlink_of: Mapping[Hashable, str] | None = None,
    ) -> Topology:
        """This topology plus (or with replaced) hosts; for topologies built by ``from_hosts``.

        The engine calls this when Dask workers join on a host the topology has not seen;
        ``leaf_of`` and ``nvlink_of`` label the new hosts and slots.
        """
        if self._origin.kind != "from_hosts":
            raise ValueError(
                "with_hosts works on topologies built by Topology.from_hosts; a declared "
                "topology is fixed: declare the larger cluster instead"
            )
        merged = self.hosts()
        for h, slots in hosts.items():
            merged[h] = list(dict.fromkeys([*merged.get(h, []), *slots]))
        return Topology.from_hosts(
            merged, leaf_of={**self._origin.leaf_of, **(leaf_of or {})},
            pod_of=self._origin.pod_of,
            nvlink_of={**self._origin.nvlink_of, **(nvlink_of or {})},
            bandwidth=self.bandwidth,
        )

    def without_slots(self, slots: Iterable[Hashable]) -> Topology:
        """This topology less ``slots`` (a host left with none goes too); for topologies built
        by ``from_hosts``. Raises ValueError when no slot would be left."""
        if self._origin.kind != "from_hosts":
            raise ValueError("without_slots works on topologies built by Topology.from_hosts")
        drop = set(slots)
        hosts = {h: kept for h, ss in self.hosts().items()
                 if (kept := [s for s in ss if s not in drop])}
        return Topology.from_hosts(
            hosts, leaf_of={h: v for h, v in self._origin.leaf_of.items() if h in hosts},
            pod_of=self._origin.pod_of,
            nvlink_of={s: v for s, v in self._origin.nvlink_of.items() if s not in drop},
            bandwidth=self.bandwidth,
        )

    # ------------------------------------------------------------------ queries
    def hosts(self) -> dict[str, list[Hashable]]:
        """Host name -> its slot ids, in tree order."""
        b = self.bounds["host"]
        return {
            name: list(self.slot_ids[b[i] : b[i + 1]]) for i, name in enumerate(self.host_names)
        }

    def indices(self, slot_ids: Sequence[Hashable] | set[Hashable]) -> IntArray:
        """Slot ids -> slot indices; unknown ids raise ``KeyError`` naming the id."""
        try:
            return np.fromiter((self.index[s] for s in slot_ids), dtype=np.int64)
        except KeyError as err:
            raise KeyError(
                f"slot {err.args[0]!r} is not in this topology ({self.n_slots} slots); "
                "build the topology from the same workers, or add the host with with_hosts()"
            ) from None

    def pair_level(self, a: IntArray, b: IntArray) -> IntArray:
        """For slot index arrays ``a`` and ``b``: index into ``LEVELS`` where each pair meets."""
        level = np.full(a.shape, len(LEVELS) - 1, dtype=np.int64)
        # Walk from the widest level down so the tightest shared level wins.
        for i in range(len(LEVELS) - 2, -1, -1):
            d = self.dom[LEVELS[i]]
            level[d[a] == d[b]] = i
        return level

    def describe(self) -> str:
        """One line: counts per level, e.g. ``8192 slots, 1024 nvlink, 1024 host, 32 leaf...``."""
        parts = [f"{self.n_slots} slots"]
        parts += [f"{self.n_domains[name]} {name}" for name in LEVELS[:-1]]
        return ", ".join(parts) + f"; largest NVLink domain {self.max_nvlink}"

    def __repr__(self) -> str:
        return f"Topology({self.describe()})"

    def _containment_order(self) -> tuple[str, ...]:
        """Distinct partitions from finest to coarsest; checks that they nest."""
        # Identical partitions (one NVSwitch per host, one leaf per pod...) appear once, under
        # the tighter name; ``rep`` maps every level to the tree level that stands for it.
        self.rep: dict[str, str] = {}
        names: list[str] = []
        for name in LEVELS:
            same = [k for k in names if np.array_equal(self.bounds[k], self.bounds[name])]
            if same:
                self.rep[name] = same[0]
            else:
                self.rep[name] = name
                names.append(name)
        names.sort(key=lambda name: -self.n_domains_of(name))
        for fine, coarse in pairwise(names):
            if not np.isin(self.bounds[coarse], self.bounds[fine]).all():
                raise ValueError(
                    f"{fine} domains straddle {coarse} boundaries; every {fine} domain must sit "
                    f"inside one {coarse} domain"
                )
        return tuple(names)

    def n_domains_of(self, name: str) -> int:
        return len(self.bounds[name]) - 1


def _contiguous_bounds(name: str, arr: IntArray) -> IntArray:
    """Start index of each domain (plus the end); domains must be numbered 0.. in slot order."""
    change = np.flatnonzero(np.diff(arr)) + 1
    starts = np.concatenate(([0], change, [arr.shape[0]])).astype(np.int64)
    labels = arr[starts[:-1]]
    if not np.array_equal(labels, np.arange(labels.shape[0])):
        raise ValueError(
            f"{name} domains must be contiguous and numbered 0, 1, ... in slot order; "
            "use Topology.declare or Topology.from_hosts, which order slots for you"
        )
    return starts


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_multi_host(labels: Mapping[str, list[str]], leaf_label: Mapping[str, str]) -> None:
    """A multi-host NVLink domain holds whole hosts, under one leaf switch (``labels``: each
    host's slots' domain labels, in host order)."""
    hosts_of_label: dict[str, set[str]] = {}
    for h in labels:
        for lab in labels[h]:
            hosts_of_label.setdefault(lab, set()).add(h)
    multi = {lab for lab, hs in hosts_of_label.items() if len(hs) > 1}
    for h in labels:
        distinct = set(labels[h])
        if distinct & multi and len(distinct) > 1:
            raise ValueError(
                f"host {h!r} has slots in NVLink domains {sorted(distinct)}, one of which "
                "spans hosts: a multi-host NVLink domain must hold whole hosts"
            )
    for lab in multi:
        leaves = {leaf_label[h] for h in hosts_of_label[lab]}
        if len(leaves) > 1:
            raise ValueError(
                f"NVLink domain {lab!r} spans leaf switches {sorted(leaves)}: a multi-host "
                "NVLink domain sits under one leaf switch"
            )
