"""Who holds which slot, with free counts per domain kept up to date incrementally (pure).

Placement asks "how many free slots does each NVLink domain / leaf / pod have?" on every
decision. Recounting 8,192 slots each time is what makes schedulers slow at scale, so the counts
are updated when slots are taken or given back (cost proportional to the slots that changed).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from nbtrain.core.topology import Topology

__all__ = ["FREE", "OFFLINE", "SlotState"]

FREE = -1
"""Owner value of a free slot."""
OFFLINE = -2
"""Owner value of a slot whose worker is gone (or not yet back)."""

IntArray = npt.NDArray[np.int64]


class SlotState:
    """Owner of every slot (a job number, ``FREE`` or ``OFFLINE``) and free counts per domain.

    ``free_count[level]`` exists for every level in ``topology.tree``.
    """

    def __init__(self, topology: Topology, owner: IntArray | None = None) -> None:
        self.topo = topology
        if owner is None:
            owner = np.full(topology.n_slots, FREE, dtype=np.int64)
        self.owner: IntArray = owner
        # Slots whose worker is gone; a held one turns OFFLINE (not FREE) when released.
        self.gone: npt.NDArray[np.bool_] = owner == OFFLINE
        self.free_count: dict[str, IntArray] = {}
        free = (owner == FREE).astype(np.int64)
        cs = np.concatenate(([0], np.cumsum(free)))
        for name in topology.tree:
            b = topology.bounds[name]
            self.free_count[name] = cs[b[1:]] - cs[b[:-1]]
        self.n_free = int(free.sum())

    def copy(self) -> SlotState:
        new = SlotState.__new__(SlotState)
        new.topo = self.topo
        new.owner = self.owner.copy()
        new.gone = self.gone.copy()
        new.free_count = {k: v.copy() for k, v in self.free_count.items()}
        new.n_free = self.n_free
        return new

    def _count(self, idx: IntArray, delta: int) -> None:
        for name in self.topo.tree:
            np.add.at(self.free_count[name], self.topo.dom[name][idx], delta)
        self.n_free += delta * int(idx.shape[0])

    def take(self, idx: IntArray, owner: int) -> None:
        """Give free slots ``idx`` to ``owner``; raises if any is not free (a scheduler bug)."""
        if idx.shape[0] == 0:
            return
        current = self.owner[idx]
        if (current != FREE).any():
            bad = idx[current != FREE][:5].tolist()
            raise RuntimeError(f"slots {bad} are not free (owners {current[current != FREE][:5]})")
        self.owner[idx] = owner
        self._count(idx, -1)

    def release(self, idx: IntArray) -> None:
        """Free slots ``idx`` that a job held; offline slots stay offline."""
        if idx.shape[0] == 0:
            return
        held = idx[self.owner[idx] >= 0]
        lost = held[self.gone[held]]
        back = held[~self.gone[held]]
        self.owner[lost] = OFFLINE
        self.owner[back] = FREE
        self._count(back, +1)

    def set_offline(self, idx: IntArray) -> None:
        """Mark slots gone. Free ones stop counting at once; held ones keep their owner until
        released, so the caller can see who lost a rank, and then turn ``OFFLINE``."""
        self.gone[idx] = True
        free = idx[self.owner[idx] == FREE]
        self.owner[free] = OFFLINE
        self._count(free, -1)

    def set_online(self, idx: IntArray) -> None:
        """Slots whose worker is back: offline ones become free, held ones stay held."""
        self.gone[idx] = False
        back = idx[self.owner[idx] == OFFLINE]
        self.owner[back] = FREE
        self._count(back, +1)

    def free_indices(self, start: int = 0, stop: int | None = None) -> IntArray:
        """Free slot indices in ``[start, stop)``, ascending."""
        stop = self.topo.n_slots if stop is None else stop
        return np.flatnonzero(self.owner[start:stop] == FREE).astype(np.int64) + start

    def held_by(self, owner: int) -> IntArray:
        return np.flatnonzero(self.owner == owner).astype(np.int64)
