"""Where the ranks of one gang go on the live cluster.

Temporary: packs ranks onto the hosts with the most free slots. To be replaced by
``nbtrain.core.placement`` (topology-aware) so the engine and the simulator share one logic.
"""

from __future__ import annotations


def place_gang(free_by_host: dict[str, list[str]], world_size: int) -> list[str] | None:
    """Slot addresses for ranks 0..world_size-1, or None when the gang does not fit whole."""
    if sum(len(v) for v in free_by_host.values()) < world_size:
        return None
    chosen: list[str] = []
    for host in sorted(free_by_host, key=lambda h: (-len(free_by_host[h]), h)):
        for addr in free_by_host[host]:
            if len(chosen) == world_size:
                return chosen
            chosen.append(addr)
    return chosen if len(chosen) == world_size else None
