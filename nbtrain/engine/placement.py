"""Where the ranks of one gang go on the live cluster: ``nbtrain.core.placement`` decides.

The engine builds the topology from the Dask workers it sees (one worker = one slot, grouped by
host) and asks the same placement code the scheduler and the simulator use. Recently failed
hosts and slots are avoided softly: the gang is first placed without them and only falls back
to them when it does not fit otherwise (a one-host cluster must still be able to recover).
"""

from __future__ import annotations

from collections.abc import Collection
from functools import lru_cache

from nbtrain.core.placement import place
from nbtrain.core.topology import Topology


def place_gang(free_by_host: dict[str, list[str]], world_size: int, *,
               all_by_host: dict[str, list[str]] | None = None,
               avoid_hosts: Collection[str] = (),
               avoid_slots: Collection[str] = ()) -> list[str] | None:
    """Slot addresses for ranks 0..world_size-1, or None when the gang does not fit whole."""
    hosts = all_by_host or free_by_host
    if not any(hosts.values()):
        return None
    topology = _topology(tuple((h, tuple(slots)) for h, slots in hosts.items()))
    free = [a for slots in free_by_host.values() for a in slots]
    preferred = [a for h, slots in free_by_host.items() if h not in avoid_hosts
                 for a in slots if a not in avoid_slots]
    for candidates in (preferred, free):
        placement = place(topology, candidates, world_size)
        if placement is not None:
            return [str(s) for s in placement.slots]
    return None


@lru_cache(maxsize=8)
def _topology(hosts: tuple[tuple[str, tuple[str, ...]], ...]) -> Topology:
    """The cluster's topology, rebuilt only when the worker inventory changes (a waiting
    gang is re-placed on every controller tick)."""
    return Topology.from_hosts(dict(hosts))
