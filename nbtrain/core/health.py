"""Worker and host health: repeated-failure exclusion and hang diagnosis (pure).

Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["HostHealth", "hung_ranks", "waits_for_checkpoint_writer"]

#: The frame of a rank waiting for its own checkpoint writer thread.
_WRITER_WAIT = "nbtrain/runtime/async_ckpt.py"
#: Frames that mean "waiting for something else", not "stuck on my own": other ranks
#: (collectives, the control agreement), or this rank's checkpoint writer thread finishing
#: the previous checkpoint (at most one is in flight; on a loaded machine its nice-10 thread
#: can be starved for seconds). A wait that never ends is still caught by the watchdog's
#: give-up bound (``give_up_factor`` x the limit without a step, see core/watchdog.py).
_WAITING_MARKERS = ("torch/distributed", "torch/autograd", "torch/nn/parallel",
                    "nbtrain/runtime/control.py", _WRITER_WAIT)


def waits_for_checkpoint_writer(stack: str) -> bool:
    """The rank waits for its writer thread to finish the previous checkpoint: its own stack
    stands still while the writer (a thread the stacks do not show) makes progress."""
    return _WRITER_WAIT in stack


class HostHealth:
    """Hosts with ``limit`` failures within ``window_s`` are excluded for ``exclude_s``."""

    def __init__(self, limit: int, window_s: float, exclude_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self.exclude_s = exclude_s
        self._failures: dict[str, list[float]] = defaultdict(list)
        self._until: dict[str, float] = {}

    def record(self, host: str, now: float) -> None:
        recent = [t for t in self._failures[host] if now - t < self.window_s] + [now]
        self._failures[host] = recent
        if len(recent) >= self.limit:
            self._until[host] = now + self.exclude_s

    def excluded(self, now: float) -> set[str]:
        return {h for h, until in self._until.items() if until > now}


def hung_ranks(keys: Mapping[int, Any], stacks: Mapping[str, Any]) -> list[int]:
    """Ranks whose running task is not inside a collective, from Dask's call stacks
    (``{worker: {task key: [frame text, ...]}}``).

    A rank blocked in an all-reduce waits for a peer; the peer stuck elsewhere is the one to
    restart. Returns [] when no rank can be told apart (the caller restarts them all).
    """
    by_key: dict[str, Sequence[str]] = {}
    for per_worker in stacks.values():
        for key, frames in (per_worker or {}).items():
            by_key[str(key)] = [str(f) for f in frames]
    culprits = []
    for rank, key in keys.items():
        frames = by_key.get(str(key))
        if frames is None:
            continue
        text = "\n".join(frames)
        if not any(marker in text for marker in _WAITING_MARKERS):
            culprits.append(rank)
    return culprits if len(culprits) < len(keys) else []


def rank_stacks(keys: Mapping[int, Any], stacks: Mapping[str, Any]) -> dict[int, str]:
    """Each rank's call stack as one text (frames joined), from Dask's call stacks; ranks
    whose task has no stack (not running) are left out."""
    by_key: dict[str, str] = {}
    for per_worker in stacks.values():
        for key, frames in (per_worker or {}).items():
            by_key[str(key)] = "\n".join(str(f) for f in frames)
    return {rank: by_key[str(key)] for rank, key in keys.items() if str(key) in by_key}

