"""Slots: one Dask worker = one slot (one GPU, or one CPU slot), grouped by host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distributed import Client


@dataclass(frozen=True)
class Slot:
    address: str
    host: str
    name: str


def read_slots(client: Client) -> dict[str, Slot]:
    """The scheduler's current workers as slots, keyed by worker address."""
    info: dict[str, Any] = client.scheduler_info(n_workers=-1)["workers"]
    return {
        addr: Slot(address=addr, host=str(w.get("host", addr)), name=str(w.get("name", addr)))
        for addr, w in info.items()
    }


def by_host(slots: dict[str, Slot]) -> dict[str, list[str]]:
    hosts: dict[str, list[str]] = {}
    for addr in sorted(slots):
        hosts.setdefault(slots[addr].host, []).append(addr)
    return hosts
