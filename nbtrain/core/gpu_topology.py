"""NVLink domains from what NVML or ``nvidia-smi`` says about a host's GPUs (pure).

Placement keeps tensor parallelism inside one NVLink domain, so the domains must be the real
ones. A worker reads its host's GPUs (``nbtrain.runtime.nvml``: NVML through nvidia-ml-py,
or the text of ``nvidia-smi -q`` and ``nvidia-smi topo -m``) and this module turns those
readings into one label per GPU. The readings are plain dicts in NVML's own terms, so
recorded outputs of real machines (``tests/data/gpu``) test the logic without a GPU.

How GPUs group, strongest evidence first:

1. **Multi-node NVLink (NVL72-like racks).** NVML's fabric info names the NVLink cluster and
   the clique (partition) each GPU belongs to. GPUs whose fabric registration completed
   successfully with a non-zero cluster UUID share a domain with every GPU, on any host, of
   the same cluster UUID and clique id. (Hopper HGX hosts may report a completed state with
   an all-zero UUID or an error status: that is no multi-node domain.)
2. **NVSwitch hosts.** All GPUs with an active NVLink to an NVSwitch form one domain (an
   HGX/DGX baseboard has one switch fabric). ``nvidia-smi topo -m`` shows them as ``NV#``
   between every pair, which gives the same answer.
3. **Direct NVLinks** (bridged pairs, hybrid cube-mesh): GPUs joined by active links, directly
   or through other GPUs, form one domain.
4. **PCIe only**: each GPU is a domain of its own (tensor parallelism would cross PCIe).

A host whose GPUs do not all agree on one multi-node clique (a GPU whose registration
failed) falls back to the per-host rules for all its GPUs, because a multi-host domain must
hold whole hosts (``Topology.from_hosts``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FABRIC_COMPLETED",
    "NVLINK_GPU",
    "NVLINK_SWITCH",
    "FabricInfo",
    "GpuInfo",
    "HostGpus",
    "describe",
    "gpus_from_nvidia_smi",
    "gpus_from_nvml",
    "normalize_bus_id",
    "nvlink_domains",
    "parse_nvidia_smi_query",
    "parse_topo_matrix",
    "visible_gpu",
    "worker_gpu_labels",
]

#: ``nvmlNvLinkDeviceType``: what the far end of a link is.
NVLINK_GPU = 0
NVLINK_SWITCH = 2
#: ``NVML_GPU_FABRIC_STATE_COMPLETED``: the GPU finished registering with the NVLink fabric.
FABRIC_COMPLETED = 3
_NVML_SUCCESS = 0
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"


@dataclass(frozen=True)
class FabricInfo:
    """``nvmlDeviceGetGpuFabricInfoV``: a GPU's place in a multi-node NVLink fabric."""

    cluster_uuid: str
    clique_id: int
    state: int
    status: int = _NVML_SUCCESS

    @property
    def registered(self) -> bool:
        """True when this names a real multi-node domain (see the module docstring)."""
        return (self.state == FABRIC_COMPLETED and self.status == _NVML_SUCCESS
                and _uuid_hex(self.cluster_uuid) not in ("", "0" * 32))

    @property
    def label(self) -> str:
        return f"clique:{self.cluster_uuid.lower()}/{self.clique_id}"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU of a host as the labelling needs it.

    ``nvlink_peers``: PCI bus ids of GPUs at the far end of an active NVLink;
    ``nvswitch_links``: active NVLinks to an NVSwitch; ``nvlinks``: active links in all.
    """

    index: int
    uuid: str
    pci_bus_id: str
    nvlink_peers: frozenset[str] = frozenset()
    nvswitch_links: int = 0
    nvlinks: int = 0
    fabric: FabricInfo | None = None
    name: str = ""


@dataclass(frozen=True)
class HostGpus:
    """Every GPU of one host, and where the picture came from (``nvml`` or ``nvidia-smi``)."""

    host: str
    gpus: tuple[GpuInfo, ...]
    source: str
    notes: tuple[str, ...] = field(default=())


# ------------------------------------------------------------------------------- labelling
def nvlink_domains(host: HostGpus) -> dict[str, str]:
    """GPU UUID -> NVLink domain label, for every GPU of ``host`` (see the module docstring).

    Host-local labels are ``"<host>/nvl<k>"`` (k numbers the host's multi-GPU domains by
    their lowest GPU index) and ``"<host>/gpu<index>"`` for a GPU that NVLink joins to no
    other; multi-node cliques are ``"clique:<cluster uuid>/<clique id>"``.
    """
    gpus = sorted(host.gpus, key=lambda g: g.index)
    label = _fabric_label(gpus)
    if label is not None:
        return {g.uuid: label for g in gpus}
    out: dict[str, str] = {}
    k = 0
    for group in _linked_groups(gpus):
        if len(group) == 1:
            out[gpus[group[0]].uuid] = f"{host.host}/gpu{gpus[group[0]].index}"
        else:
            for i in group:
                out[gpus[i].uuid] = f"{host.host}/nvl{k}"
            k += 1
    return out


def _fabric_label(gpus: Sequence[GpuInfo]) -> str | None:
    """The multi-node clique every GPU is registered in, if they all are in the same one."""
    fabrics = {g.fabric.label for g in gpus if g.fabric is not None and g.fabric.registered}
    if gpus and len(fabrics) == 1 and all(g.fabric is not None and g.fabric.registered
                                          for g in gpus):
        return fabrics.pop()
    return None


def _linked_groups(gpus: Sequence[GpuInfo]) -> list[list[int]]:
    """Positions of GPUs NVLink joins (directly, or all through NVSwitches), each group in
    order, the groups by their lowest position."""
    parent = list(range(len(gpus)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(i: int, j: int) -> None:
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)

    by_bus = {normalize_bus_id(g.pci_bus_id): i for i, g in enumerate(gpus)}
    switched = [i for i, g in enumerate(gpus) if g.nvswitch_links > 0]
    for i in switched[1:]:
        union(switched[0], i)
    for i, g in enumerate(gpus):
        for peer in g.nvlink_peers:
            j = by_bus.get(normalize_bus_id(peer))
            if j is not None:
                union(i, j)
    members: dict[int, list[int]] = {}
    for i in range(len(gpus)):
        members.setdefault(find(i), []).append(i)
    return [members[root] for root in sorted(members)]


def visible_gpu(cuda_visible_devices: str | None, gpus: Sequence[GpuInfo]) -> GpuInfo | None:
    """The GPU a CUDA process sees as ``cuda:0``, given its ``CUDA_VISIBLE_DEVICES``.

    Entries are indices (NVML's order, which is CUDA's with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
    as dask-cuda and nbtrain's own workers assume) or GPU UUIDs (a unique prefix is enough,
    as for CUDA). Unset: GPU 0. Empty, ``-1`` or ``NoDevFiles``: no GPU. A MIG instance
    (``MIG-...``) is not a slot nbtrain can label: ``ValueError`` says so.
    """
    by_index = sorted(gpus, key=lambda g: g.index)
    if cuda_visible_devices is None:
        return by_index[0] if by_index else None
    first = cuda_visible_devices.split(",")[0].strip()
    if first in ("", "-1", "NoDevFiles"):
        return None
    if first.startswith("MIG-"):
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names a MIG instance; nbtrain "
            "labels whole GPUs: give each worker a whole GPU, or declare its labels with "
            "NBTRAIN_WORKER_NVLINK")
    if first.startswith("GPU-"):
        hits = [g for g in gpus if g.uuid.lower().startswith(first.lower())]
        if len(hits) != 1:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: {first!r} matches "
                f"{len(hits)} of this host's GPUs ({', '.join(g.uuid for g in by_index)})")
        return hits[0]
    try:
        index = int(first)
    except ValueError:
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: {first!r} is neither a GPU index "
            "nor a GPU UUID") from None
    hits = [g for g in gpus if g.index == index]
    if not hits:
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: this host has GPUs "
            f"{[g.index for g in by_index]}, not {index}")
    return hits[0]


def normalize_bus_id(bus_id: str) -> str:
    """``"0000:18:00.0"`` and ``"00000000:18:00.0"`` name the same device: pad the PCI domain
    to 8 hex digits and lower-case, as NVML's ``busId`` is written."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or rest.count(":") != 1:
        return text
    return f"{int(domain, 16):08x}:{rest}" if re.fullmatch(r"[0-9a-f]+", domain) else text


# ------------------------------------------------------------------------------- NVML readings
def gpus_from_nvml(host: str, readings: Mapping[str, Any]) -> HostGpus:
    """A host's GPUs from raw NVML readings (what ``nbtrain.runtime.nvml.read_nvml`` records):

    ``{"gpus": [{"index", "uuid", "pci_bus_id", "name", "nvlinks": [{"link", "state",
    "remote_device_type", "remote_pci_bus_id"}], "fabric": {"cluster_uuid", "clique_id",
    "state", "status"} | None}]}``. Inactive links and links of unknown type are ignored.
    """
    gpus: list[GpuInfo] = []
    for g in readings.get("gpus", ()):
        peers: set[str] = set()
        switch = links = 0
        for link in g.get("nvlinks", ()) or ():
            if not link.get("state"):
                continue
            links += 1
            kind = link.get("remote_device_type")
            if kind == NVLINK_SWITCH:
                switch += 1
            elif kind == NVLINK_GPU and link.get("remote_pci_bus_id"):
                peers.add(normalize_bus_id(str(link["remote_pci_bus_id"])))
        fab = g.get("fabric")
        fabric = None if not fab else FabricInfo(
            cluster_uuid=str(fab.get("cluster_uuid", "")), clique_id=int(fab.get("clique_id", 0)),
            state=int(fab.get("state", 0)), status=int(fab.get("status", _NVML_SUCCESS)))
        gpus.append(GpuInfo(index=int(g["index"]), uuid=str(g["uuid"]),
                            pci_bus_id=normalize_bus_id(str(g["pci_bus_id"])),
                            nvlink_peers=frozenset(peers), nvswitch_links=switch, nvlinks=links,
                            fabric=fabric, name=str(g.get("name", ""))))
    return HostGpus(host=host, gpus=tuple(gpus), source="nvml",
                    notes=tuple(str(n) for n in readings.get("notes", ())))


# ------------------------------------------------------------------------------- nvidia-smi
_NV = re.compile(r"^NV(\d+)$")
_ESCAPES = re.compile(r"\x1b\[[0-9;]*m")


def parse_topo_matrix(text: str) -> dict[int, dict[int, str]]:
    """``nvidia-smi topo -m`` -> {GPU index: {peer GPU index: connection}}.

    Connections are the matrix's codes: ``NV<n>`` (n bonded NVLinks), ``PIX``, ``PXB``,
    ``PHB``, ``NODE``, ``SYS``. NIC columns and rows, the CPU/NUMA affinity columns and the
    legend are skipped; the terminal's underline escapes around the header are removed.
    """
    lines = [_ESCAPES.sub("", line).rstrip() for line in text.splitlines()]
    header: list[str] | None = None
    out: dict[int, dict[int, str]] = {}
    for line in lines:
        cells = line.split()
        if not cells:
            if header is not None and out:
                break  # the blank line before the legend
            continue
        if header is None:
            if cells[0].startswith("GPU") and cells[0][3:].isdigit():
                header = [c for c in cells if re.fullmatch(r"GPU\d+|NIC\d+|mlx\S*", c)]
            continue
        name = cells[0]
        if not (name.startswith("GPU") and name[3:].isdigit()):
            continue
        row = int(name[3:])
        out[row] = {}
        for col, value in zip(header, cells[1:], strict=False):
            if col.startswith("GPU") and col[3:].isdigit() and value != "X":
                out[row][int(col[3:])] = value
    if header is None:
        raise ValueError("no GPU matrix in this text: expected the output of nvidia-smi topo -m "
                         "(a header line 'GPU0 GPU1 ...' and one row per GPU)")
    return out


def parse_nvidia_smi_query(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi -q`` -> one dict per GPU, in the listed (index) order: ``index``,
    ``pci_bus_id``, ``uuid``, ``name`` and ``fabric`` (its Fabric block: ``state``,
    ``status``, ``cluster_uuid``, ``clique_id``; None when the block says N/A or is absent).
    """
    gpus: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    block: str | None = None
    fabric: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.rstrip()
        head = re.match(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$",
                        line)
        if head:
            if current is not None:
                current["fabric"] = _fabric_from_query(fabric)
            current = {"index": len(gpus), "pci_bus_id": normalize_bus_id(head.group(1)),
                       "uuid": "", "name": ""}
            gpus.append(current)
            block, fabric = None, {}
            continue
        if current is None or not line.strip():
            continue
        block = _query_line(line, current, block, fabric)
    if current is not None:
        current["fabric"] = _fabric_from_query(fabric)
    if not gpus:
        raise ValueError("no GPU in this text: expected the output of nvidia-smi -q "
                         "(blocks that start 'GPU 00000000:18:00.0')")
    return gpus


def _query_line(line: str, gpu: dict[str, Any], block: str | None,
                fabric: dict[str, str]) -> str | None:
    """One line of a GPU's block of ``nvidia-smi -q``: its UUID, its name or a field of its
    Fabric block; returns the block the next lines are in."""
    indent = len(line) - len(line.lstrip())
    key, sep, value = line.strip().partition(":")
    key, value = key.strip(), value.strip()
    if indent <= 4:
        block = key if not sep or not value else None
    if sep and value:
        if indent <= 4 and key == "GPU UUID":
            gpu["uuid"] = value
        elif indent <= 4 and key == "Product Name":
            gpu["name"] = value
        elif block == "Fabric" and indent > 4:
            fabric[key] = value
    return block


_FABRIC_STATES = {"not supported": 0, "not started": 1, "in progress": 2, "completed": 3}


def _fabric_from_query(block: Mapping[str, str]) -> dict[str, Any] | None:
    state = block.get("State", "N/A").strip().lower()
    if state not in _FABRIC_STATES:
        return None
    status = block.get("Status", "Success").strip().lower()
    clique = block.get("CliqueId", "0").strip()
    return {"state": _FABRIC_STATES[state],
            "status": _NVML_SUCCESS if status == "success" else -1,
            "cluster_uuid": block.get("ClusterUUID", "").strip(),
            "clique_id": int(clique) if clique.isdigit() else 0}


def gpus_from_nvidia_smi(host: str, query: str, topo: str) -> HostGpus:
    """A host's GPUs from the text of ``nvidia-smi -q`` (UUIDs, bus ids, fabric) and
    ``nvidia-smi topo -m`` (which pairs NVLink joins): the fallback without nvidia-ml-py.

    The matrix cannot tell an NVSwitch from direct links; NVSwitch hosts show ``NV#``
    between every pair, which groups them the same way.
    """
    listed = parse_nvidia_smi_query(query)
    matrix = parse_topo_matrix(topo)
    bus_of = {g["index"]: g["pci_bus_id"] for g in listed}
    notes: list[str] = []
    if set(matrix) != set(bus_of):
        notes.append(f"nvidia-smi topo -m lists GPUs {sorted(matrix)}, nvidia-smi -q lists "
                     f"{sorted(bus_of)}; NVLink peers only for GPUs in both")
    gpus = []
    for g in listed:
        row = matrix.get(g["index"], {})
        peers = {bus_of[j] for j, conn in row.items() if _NV.match(conn) and j in bus_of}
        links = max((int(m.group(1)) for c in row.values() if (m := _NV.match(c))), default=0)
        fab = g.get("fabric")
        fabric = None if fab is None else FabricInfo(
            cluster_uuid=fab["cluster_uuid"], clique_id=fab["clique_id"], state=fab["state"],
            status=fab["status"])
        gpus.append(GpuInfo(index=g["index"], uuid=g["uuid"], pci_bus_id=g["pci_bus_id"],
                            nvlink_peers=frozenset(peers), nvlinks=links, fabric=fabric,
                            name=g["name"]))
    return HostGpus(host=host, gpus=tuple(gpus), source="nvidia-smi", notes=tuple(notes))


def _uuid_hex(uuid: str) -> str:
    return "".join(ch for ch in uuid.lower() if ch in "0123456789abcdef")


def describe(host: HostGpus, labels: Mapping[str, str] | None = None) -> Iterable[str]:
    """Lines for a person: each GPU with its bus id and domain."""
    labels = labels if labels is not None else nvlink_domains(host)
    for g in sorted(host.gpus, key=lambda g: g.index):
        yield (f"GPU{g.index} {g.uuid} {g.pci_bus_id}: {labels.get(g.uuid, '?')} "
               f"({g.nvlinks} NVLinks, {g.nvswitch_links} to NVSwitches)")


def worker_gpu_labels(host: HostGpus | None, cuda_visible_devices: str | None,
                      declared_nvlink: str = "") -> dict[str, str]:
    """The labels a worker reports for the GPU it runs on (empty for a CPU worker).

    ``gpu`` (its UUID: the slot's identity, and what makes it a GPU slot), ``pci_bus_id``,
    ``gpu_name``, ``nvlink`` (the discovered domain, unless ``declared_nvlink``, the
    worker's ``NBTRAIN_WORKER_NVLINK``, overrides it) and ``nvlink_source`` (``declared``,
    ``nvml``, ``nvml-fabric``, ``nvidia-smi`` or ``nvidia-smi-fabric``). A
    ``CUDA_VISIBLE_DEVICES`` that names no usable GPU gives ``gpu_note`` instead.
    """
    if host is None or not host.gpus:
        return {}
    try:
        gpu = visible_gpu(cuda_visible_devices, host.gpus)
    except ValueError as exc:
        return {"gpu_note": str(exc)}
    if gpu is None:
        return {}
    label = nvlink_domains(host)[gpu.uuid]
    source = host.source + ("-fabric" if label.startswith("clique:") else "")
    return {"gpu": gpu.uuid, "pci_bus_id": gpu.pci_bus_id, "gpu_name": gpu.name,
            "nvlink": declared_nvlink or label,
            "nvlink_source": "declared" if declared_nvlink else source}
