"""Firing planned faults inside a rank (the fault itself is :class:`nbtrain.core.faults.Fault`).

The controller delivers faults for a running job straight into the rank's worker process
(``deliver``, run there through Dask); the step loop sees them at its next step boundary.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from nbtrain.core.faults import KINDS, Fault

__all__ = ["KINDS", "Fault", "FaultInjector", "InjectedFault", "deliver", "take"]


class InjectedFault(RuntimeError):
    """Raised in a rank by a ``raise`` fault."""


# Worker-process-wide mailbox: job id -> faults pushed by the engine, read by the step loop.
_MAILBOX: dict[str, list[Fault]] = {}
_LOCK = threading.Lock()


def deliver(job_id: str, fault: dict[str, Any]) -> None:
    """Runs in the worker process (``Client.run``): queue a fault for the rank there."""
    with _LOCK:
        _MAILBOX.setdefault(job_id, []).append(Fault.from_dict(fault))


def take(job_id: str) -> list[Fault]:
    with _LOCK:
        return _MAILBOX.pop(job_id, [])


class FaultInjector:
    """Rank-side: holds this rank's planned faults and fires them at their steps."""

    def __init__(self, job_id: str, rank: int, planned: list[Fault]) -> None:
        self.job_id = job_id
        self.rank = rank
        self.pending = [f for f in planned if f.rank == rank]
        self.slow_factor = 1.0

    def poll(self, step: int) -> list[Fault]:
        """Faults due at the start of ``step`` (the next step to run); fires all but ``slow``
        compute stretching, which the loop applies via :meth:`stretch`."""
        self.pending.extend(f for f in take(self.job_id) if f.rank == self.rank)
        due = [f for f in self.pending if f.step is None or f.step <= step]
        if not due:
            return []
        self.pending = [f for f in self.pending if f not in due]
        return due

    def fire(self, fault: Fault) -> None:
        if fault.kind == "slow":
            self.slow_factor = fault.factor
        elif fault.kind == "raise":
            raise InjectedFault(f"injected exception on rank {self.rank} ({fault.id})")
        elif fault.kind == "hang":
            if fault.duration_s is None:
                threading.Event().wait()  # forever: only a worker restart ends this
            else:
                time.sleep(fault.duration_s)
        elif fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    def stretch(self, compute_s: float) -> float:
        """Extra time to spend to make this step's compute ``slow_factor`` times longer."""
        if self.slow_factor <= 1.0:
            return 0.0
        extra = (self.slow_factor - 1.0) * compute_s
        time.sleep(extra)
        return extra
