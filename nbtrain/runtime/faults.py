"""Deterministic fault injection by (rank, step), for tests, teaching notebooks and the UI.

A fault is planned at submit time (``submit(..., faults=[Fault("kill", rank=1, step=30)])``)
or sent to a running job (``job.inject("slow", rank=1, factor=2.0)``); the engine delivers the
latter straight into the rank's worker process (``Client.run``) where the step loop sees it at
its next step boundary. Each one-shot fault fires once per job: the engine remembers fired
faults, so a job that recovers to a step before the fault does not hit it again.

Kinds:
- ``kill``: SIGKILL this rank's worker process (the nanny starts a new one).
- ``raise``: raise :class:`InjectedFault` in the rank (a user-code exception).
- ``hang``: stop making progress (sleep ``duration_s``, forever by default) without exiting.
- ``slow``: make this rank's compute ``factor`` times slower from ``step`` on (persistent until
  a ``slow`` with factor 1 replaces it); the rank sleeps ``(factor - 1) x`` its compute time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("kill", "raise", "hang", "slow")


class InjectedFault(RuntimeError):
    """Raised in a rank by a ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int | None = None  # None: at the next step boundary
    factor: float = 1.0  # slow only
    duration_s: float | None = None  # hang only; None = forever
    id: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.rank < 0:
            raise ValueError(f"fault rank must be >= 0, got {self.rank}")
        if self.kind == "slow" and self.factor < 1.0:
            raise ValueError(f"slow factor must be >= 1.0 (1.0 clears), got {self.factor}")
        if not self.id:
            object.__setattr__(self, "id", f"{self.kind}-r{self.rank}-s{self.step}-"
                                           f"{time.monotonic_ns()}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Worker-process-wide mailbox: job id -> faults pushed by the engine, read by the step loop.
_MAILBOX: dict[str, list[Fault]] = {}
_LOCK = threading.Lock()


def deliver(job_id: str, fault: dict[str, Any]) -> None:
    """Runs in the worker process (``Client.run``): queue a fault for the rank there."""
    with _LOCK:
        _MAILBOX.setdefault(job_id, []).append(Fault(**fault))


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
