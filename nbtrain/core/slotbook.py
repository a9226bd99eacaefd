"""The job machine's slot book: which worker backs each slot, and which slots are away (pure).

A slot is one device behind one Dask worker (:mod:`nbtrain.core.inventory` gives it a stable
id while its workers come and go). The gang scheduler must never offer a slot without a
worker, so the book remembers which slots it has been told are *offline* (their worker left,
or was asked to restart) and which wait for a worker asked to *restart*: a slot whose new
worker does not join within ``worker_return_s`` is reported lost (the cluster has one slot
fewer until a worker joins on that host). A slot offline for longer than ``forget_s`` that no
job holds is forgotten (:meth:`SlotBook.departed`): on a cluster whose hosts come and go under
new names (autoscaled pods, cloud nodes) the book stays the size of what was recently there.
Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from nbtrain.core.inventory import Inventory, SlotRecord, WorkerInfo
from nbtrain.core.pools import CPU, GPU
from nbtrain.core.sched_types import WorkersForgotten

__all__ = ["SlotBook", "SlotView"]


class SlotView(dict[str, Any]):
    """A slot for display: ``slot``, ``host``, ``nvlink``, ``leaf``, ``address`` (None while
    offline), ``state`` (free / held / restarting / offline), ``job`` (the holder's id),
    ``device`` (``gpu`` or ``cpu``) and ``gpu`` (its GPU's UUID, "" for a CPU slot), and what
    else its worker reported of its device (``gpu_name``, ``pci_bus_id``, ...)."""


class SlotBook:
    """Slots, their workers, and the slots offline or waiting for a restarted worker."""

    def __init__(self, worker_return_s: float, forget_s: float = float("inf")) -> None:
        self.inventory = Inventory()
        self.worker_return_s = worker_return_s
        self.forget_s = forget_s
        #: Slots the scheduler has been told are offline, and since when (None: not known,
        #: e.g. refused at join: counted from the next check).
        self._offline: dict[str, float | None] = {}
        self._restarting: dict[str, float] = {}  # slot -> when its worker's restart was asked

    # ------------------------------------------------------------------ workers
    def sharing(self, gpu: str) -> SlotRecord | None:
        """The online slot of another worker on GPU ``gpu`` (None for a CPU worker)."""
        if not gpu:
            return None
        return next((r for r in self.inventory.records()
                     if r.gpu == gpu and r.address is not None), None)

    def join(self, worker: WorkerInfo) -> SlotRecord:
        """A worker joined: the slot it backs is neither restarting nor offline any more (the
        caller tells the scheduler)."""
        rec = self.inventory.join(worker)
        self._restarting.pop(rec.slot, None)
        self._offline.pop(rec.slot, None)
        return rec

    def refuse(self, address: str, slot: str) -> None:
        """A worker that joined was kept out after all (the scheduler refused its labels)."""
        self.inventory.leave(address)
        self._offline.setdefault(slot, None)

    def leave(self, address: str) -> SlotRecord | None:
        """A worker left: its slot (None for an unknown address); see :meth:`take_offline`."""
        return self.inventory.leave(address)

    def take_offline(self, slots: Iterable[str], now: float) -> tuple[str, ...]:
        """Mark slots offline; the ones the scheduler has not been told about yet."""
        new = tuple(s for s in slots if s not in self._offline)
        self._offline.update(dict.fromkeys(new, now))
        return new

    def departed(self, now: float, held: set[str]) -> list[str]:
        """Slots offline for longer than ``forget_s``, with no worker, no restart asked and
        not in ``held``: for the caller to tell the scheduler, then :meth:`forget`."""
        out: list[str] = []
        for slot, since in list(self._offline.items()):
            if since is None:
                self._offline[slot] = now
            elif (now - since > self.forget_s and slot not in held
                  and slot not in self._restarting
                  and self.inventory.address_of(slot) is None):
                out.append(slot)
        return out

    def forget_departed(self, now: float, held: set[str],
                        tell: Callable[[WorkersForgotten], object],
                        has_slot: Callable[[str], bool]) -> list[SlotRecord]:
        """Forget the :meth:`departed` slots: ``tell`` the scheduler, then drop those its
        topology let go (``has_slot`` False; one it keeps, e.g. a pool's last slot, stays
        for a later try); their records."""
        departed = self.departed(now, held)
        if not departed:
            return []
        tell(WorkersForgotten(now, tuple(departed)))
        gone = []
        for slot in departed:
            if not has_slot(slot):
                del self._offline[slot]
                gone.append(self.inventory.forget(slot))
        return gone

    def restart(self, addresses: Iterable[str], now: float) -> tuple[list[str], list[str]]:
        """Workers asked to restart: (their addresses, their slots), leaving out unknown
        workers and slots already restarting. The slots stay away until a worker backs them
        again (take them offline)."""
        todo: list[str] = []
        slots: list[str] = []
        for address in dict.fromkeys(addresses):
            slot = self.inventory.slot_of(address)
            if slot is None or slot in self._restarting:
                continue
            self._restarting[slot] = now
            todo.append(address)
            slots.append(slot)
        return todo, slots

    def restarting(self, slot: str) -> bool:
        return slot in self._restarting

    def lost(self, now: float) -> list[str]:
        """Slots whose restarted worker did not come back within ``worker_return_s``; they
        stop counting as restarting (reported once)."""
        gone = [s for s, asked in self._restarting.items() if now - asked > self.worker_return_s]
        for slot in gone:
            del self._restarting[slot]
        return gone

    # ------------------------------------------------------------------ views
    def kind_of(self, slot: Hashable) -> str:
        """A slot's device kind, ``gpu`` or ``cpu``."""
        return GPU if self.inventory.record(str(slot)).gpu else CPU

    def has_gpu(self) -> bool:
        return any(r.gpu for r in self.inventory.records())

    def counts(self, kind: str, by_kind: bool) -> tuple[int, int]:
        """(slots ever seen, slots restarting), of ``kind`` only when ``by_kind``."""
        if not by_kind:
            return len(self.inventory.records()), len(self._restarting)
        return (sum(1 for r in self.inventory.records() if self.kind_of(r.slot) == kind),
                sum(1 for s in self._restarting if self.kind_of(s) == kind))

    def views(self, owners: Mapping[Hashable, str | None]) -> list[SlotView]:
        """Every slot the cluster has had, with its state and holder."""
        out = []
        for rec in self.inventory.records():
            holder = owners.get(rec.slot)
            if rec.slot in self._restarting:
                state = "restarting"
            elif rec.address is None:
                state = "offline"
            else:
                state = "held" if holder is not None else "free"
            out.append(SlotView(dict(rec.about), slot=rec.slot, host=rec.host,
                                nvlink=rec.nvlink or rec.host, leaf=rec.leaf,
                                address=rec.address, state=state, job=holder,
                                device=GPU if rec.gpu else CPU, gpu=rec.gpu))
        return out
