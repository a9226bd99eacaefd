"""Notebook -> ranks control plane.

The controller writes requests into one Dask ``Variable`` per job. Rank 0 polls it from a
background thread (so the step loop never waits on the scheduler); at every step boundary all
ranks agree on the requests with one tiny all-reduce (MAX), so every rank acts on the same
step and no rank is left alone in a collective.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from distributed import Client, Variable

#: Requests, in vector order. ``checkpoint`` is a sequence number: a new number = a new request.
FLAGS = ("stop", "preempt", "checkpoint")


def control_name(job_id: str) -> str:
    return f"nbtrain-ctl-{job_id}"


def empty_control() -> dict[str, int]:
    return dict.fromkeys(FLAGS, 0)


class ControlChannel:
    """Rank-side view of the control variable."""

    def __init__(self, job_id: str, rank: int, client: Client, poll_s: float,
                 device: torch.device) -> None:
        self._requested = torch.zeros(len(FLAGS), dtype=torch.int64)
        self._agreed = torch.zeros(len(FLAGS), dtype=torch.int64, device=device)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if rank == 0:
            var = Variable(control_name(job_id), client=client)
            self._thread = threading.Thread(
                target=self._poll, args=(var, poll_s), name="nbtrain-control", daemon=True
            )
            self._thread.start()

    def _poll(self, var: Variable, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                value: Any = var.get(timeout=max(1.0, 10 * poll_s))
            except Exception:  # the variable is not set yet, or the scheduler is busy
                continue
            if isinstance(value, dict):
                with self._lock:
                    for i, flag in enumerate(FLAGS):
                        self._requested[i] = int(value.get(flag, 0))

    def agree(self) -> dict[str, int]:
        """Collective: the requests every rank acts on at this step boundary."""
        with self._lock:
            self._agreed.copy_(self._requested)
        dist.all_reduce(self._agreed, op=dist.ReduceOp.MAX)
        values = self._agreed.tolist()
        return dict(zip(FLAGS, (int(v) for v in values), strict=True))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
