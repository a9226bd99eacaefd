"""Slots with stable identities while the workers behind them come and go (pure).

One Dask worker is one slot. A worker restarted by its nanny comes back under a new address,
so addresses cannot name slots: the scheduler's topology would grow by one slot per restart.
Here each slot has a stable id (``"<host>#<n>"``) and the worker address it currently has, if
any. A joining worker takes over an offline slot of its host (the one that had its worker
name, else the lowest-numbered), or a new slot is added. The gang scheduler keys everything by
slot id; only the engine speaks addresses.

A worker's host, NVLink domain and leaf switch come from its labels (declared for CPU
clusters and teaching labs, discovered on GPU machines); the host defaults to the address's
host and the NVLink domain to the host. A GPU worker also names its GPU (UUID): a slot is
that GPU, and a restarted worker takes back the slot of the GPU it runs on.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

__all__ = ["Inventory", "SlotRecord", "WorkerInfo"]


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine knows of a worker when it joins."""

    address: str
    host: str
    name: str = ""
    nvlink: str = ""  # NVLink domain label; "" = the whole host
    leaf: str = ""  # leaf switch label; "" = one shared leaf
    gpu: str = ""  # the UUID of the GPU it runs on; "" = a CPU worker
    about: tuple[tuple[str, str], ...] = ()  # more of what it reported, for the views

    def __post_init__(self) -> None:
        if not self.address or not self.host:
            raise ValueError(f"a worker needs an address and a host, got {self!r}")


@dataclass
class SlotRecord:
    slot: str
    host: str
    nvlink: str  # "" = the whole host is one NVLink domain
    leaf: str
    name: str
    address: str | None  # None while offline
    gpu: str = ""  # the GPU's UUID; "" = a CPU slot
    about: tuple[tuple[str, str], ...] = ()  # what its worker reported besides, for the views


class Inventory:
    """Slot ids, their labels and their current worker addresses."""

    def __init__(self) -> None:
        self._slots: dict[str, SlotRecord] = {}
        self._by_address: dict[str, str] = {}
        self._per_host: dict[str, int] = {}

    def join(self, worker: WorkerInfo) -> SlotRecord:
        """A worker joined: the slot it now backs (an offline slot taken over, or a new one)."""
        if worker.address in self._by_address:
            return self._slots[self._by_address[worker.address]]
        offline = [r for r in self._slots.values()
                   if r.address is None and r.host == worker.host and r.nvlink == worker.nvlink
                   and r.leaf == worker.leaf and r.gpu == worker.gpu]
        named = [r for r in offline if worker.name and r.name == worker.name]
        if named or offline:
            record = (named or sorted(offline, key=lambda r: _ordinal(r.slot)))[0]
            record.address = worker.address
            record.name = worker.name
            record.about = worker.about
        else:
            n = self._per_host.get(worker.host, 0)
            self._per_host[worker.host] = n + 1
            record = SlotRecord(slot=f"{worker.host}#{n}", host=worker.host, nvlink=worker.nvlink,
                                leaf=worker.leaf, name=worker.name, address=worker.address,
                                gpu=worker.gpu, about=worker.about)
            self._slots[record.slot] = record
        self._by_address[worker.address] = record.slot
        return record

    def leave(self, address: str) -> SlotRecord | None:
        """A worker left: its slot goes offline (None for an unknown address)."""
        slot = self._by_address.pop(address, None)
        if slot is None:
            return None
        record = self._slots[slot]
        record.address = None
        return record

    def forget(self, slot: str) -> SlotRecord:
        """Drop an offline slot for good (a departed host's); a host left with no slot is
        forgotten too, so a worker that joins there later starts its numbering again."""
        record = self._slots[slot]
        if record.address is not None:
            raise ValueError(f"slot {slot} has a worker ({record.address}): it is not departed")
        del self._slots[slot]
        if not any(r.host == record.host for r in self._slots.values()):
            self._per_host.pop(record.host, None)
        return record

    def slot_of(self, address: str) -> str | None:
        return self._by_address.get(address)

    def address_of(self, slot: str) -> str | None:
        record = self._slots.get(slot)
        return None if record is None else record.address

    def record(self, slot: str) -> SlotRecord:
        return self._slots[slot]

    def host_of(self, slot: str) -> str:
        return self._slots[slot].host

    def online(self) -> dict[str, str]:
        """Slot id -> worker address, for slots with a worker now."""
        return {s: r.address for s, r in self._slots.items() if r.address is not None}

    def records(self) -> list[SlotRecord]:
        """Every slot ever seen, online or not, in the order they were added."""
        return list(self._slots.values())

    def hosts(self) -> dict[str, list[str]]:
        """Host -> its slot ids (online or not), in the order they were added."""
        out: dict[str, list[str]] = {}
        for r in self._slots.values():
            out.setdefault(r.host, []).append(r.slot)
        return out

    def labels(self) -> tuple[Mapping[Hashable, str], Mapping[str, str]]:
        """(slot -> NVLink domain label, host -> leaf label) for ``Topology.from_hosts``:
        only the labels workers declared."""
        nvlink: dict[Hashable, str] = {s: r.nvlink for s, r in self._slots.items() if r.nvlink}
        leaf = {r.host: r.leaf for r in self._slots.values() if r.leaf}
        return nvlink, leaf

    def __len__(self) -> int:
        return len(self._by_address)


def _ordinal(slot: str) -> int:
    return int(slot.rsplit("#", 1)[1])
