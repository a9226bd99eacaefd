"""``cluster.topology``: the slots as the scheduler places on them, grouped for reading.

Leaf switch, then host, then NVLink domain, then slots with their GPU (UUID, PCI bus id,
model) and where the domain came from (``nvml``, ``nvml-fabric`` for a multi-node NVLink
clique, ``nvidia-smi``, ``declared``). Built from ``Cluster.snapshot()["slots"]``, so it is
what the controller knows, not what this client's machine has.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TopologyView"]


class TopologyView:
    """Read-only: ``slots`` (dicts as in ``Cluster.snapshot()``), ``domains()``,
    ``describe()``; shown as text in a terminal and as a table in a notebook."""

    def __init__(self, slots: Sequence[Mapping[str, Any]]) -> None:
        self.slots: tuple[dict[str, Any], ...] = tuple(dict(s) for s in slots)

    def domains(self) -> dict[str, list[str]]:
        """NVLink domain -> its slot ids (a multi-node domain lists slots of several hosts)."""
        out: dict[str, list[str]] = {}
        for s in self.slots:
            out.setdefault(str(s["nvlink"]), []).append(str(s["slot"]))
        return out

    def tree(self) -> dict[str, dict[str, dict[str, list[dict[str, Any]]]]]:
        """leaf -> host -> NVLink domain -> slots, in the order the slots were added."""
        out: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
        for s in self.slots:
            hosts = out.setdefault(str(s.get("leaf") or "-"), {})
            domains = hosts.setdefault(str(s["host"]), {})
            domains.setdefault(str(s["nvlink"]), []).append(s)
        return out

    def describe(self) -> str:
        gpus = sum(1 for s in self.slots if s.get("device") == "gpu")
        cpus = len(self.slots) - gpus
        hosts = {s["host"] for s in self.slots}
        lines = [f"{gpus} GPU slots, {cpus} CPU slots on {len(hosts)} host(s); "
                 f"{len(self.domains())} NVLink domain(s)"]
        for leaf, by_host in self.tree().items():
            lines.append(f"leaf {leaf}")
            for host, by_domain in by_host.items():
                lines.append(f"  host {host}")
                for domain, slots in by_domain.items():
                    source = slots[0].get("nvlink_source") or (
                        "the host" if domain == host else "declared")
                    lines.append(f"    NVLink domain {domain} ({source}): {len(slots)} slot(s)")
                    lines += [f"      {_slot_line(s)}" for s in slots]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()

    def _repr_html_(self) -> str:
        cells = ("slot", "state", "host", "leaf", "nvlink", "nvlink_source", "gpu",
                 "pci_bus_id", "gpu_name", "address")
        head = "".join(f"<th>{c}</th>" for c in cells)
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(s.get(c) or ''))}</td>" for c in cells)
            + "</tr>" for s in self.slots)
        summary = html.escape(self.describe().splitlines()[0])
        return f"<div><b>{summary}</b><table><tr>{head}</tr>{rows}</table></div>"


def _slot_line(s: Mapping[str, Any]) -> str:
    parts = [str(s["slot"]), str(s.get("state", ""))]
    if s.get("gpu"):
        parts += [str(s["gpu"]), str(s.get("pci_bus_id") or ""), str(s.get("gpu_name") or "")]
    else:
        parts.append("CPU")
    return "  ".join(p for p in parts if p)
