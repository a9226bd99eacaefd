"""Notebook -> ranks control plane.

The controller writes requests into one Dask ``Variable`` per job. Rank 0 polls it from a
background thread (so the step loop never waits on the scheduler). Ranks agree on the requests
with one tiny all-reduce (MAX) at agreed step boundaries, so every rank acts on the same step
and no rank is left alone in a collective.

The all-reduce costs ~0.1-2 ms on CPU gloo, a lot for a 5 ms step, so ranks do not agree every
step: each agreement also fixes the step of the next one, about ``interval_s`` of training
later (the minimum of every rank's proposal, so all ranks hold the same schedule).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from distributed import Client, Variable

#: Requests, in vector order. ``checkpoint`` is a sequence number: a new number = a new request.
#: ``due`` is set by a rank itself: its time-based checkpoint policy says a checkpoint is due.
FLAGS = ("stop", "preempt", "checkpoint", "due")
#: Upper bound on steps between agreements, whatever the step time.
MAX_INTERVAL_STEPS = 64


def control_name(job_id: str) -> str:
    return f"nbtrain-ctl-{job_id}"


def empty_control() -> dict[str, int]:
    return dict.fromkeys(FLAGS[:-1], 0)


class ControlChannel:
    """Rank-side view of the control variable."""

    def __init__(self, job_id: str, rank: int, client: Client, poll_s: float,
                 device: torch.device) -> None:
        self._requested = torch.zeros(len(FLAGS), dtype=torch.int64)
        # Flags, then the negated interval proposal (MAX of negatives = MIN of proposals).
        self._agreed = torch.zeros(len(FLAGS) + 1, dtype=torch.int64, device=device)
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
                    for i, flag in enumerate(FLAGS[:-1]):
                        self._requested[i] = int(value.get(flag, 0))

    def agree(self, proposed_interval: int, due: bool = False) -> tuple[dict[str, int], int]:
        """Collective: the requests every rank acts on now, and steps until the next agreement.

        ``proposed_interval`` is this rank's wish (from its own step time); the agreed
        interval is the smallest wish, clamped to 1..MAX_INTERVAL_STEPS.
        """
        with self._lock:
            self._agreed[: len(FLAGS)].copy_(self._requested)
        self._agreed[len(FLAGS) - 1] = int(due)
        self._agreed[len(FLAGS)] = -max(1, min(MAX_INTERVAL_STEPS, proposed_interval))
        dist.all_reduce(self._agreed, op=dist.ReduceOp.MAX)
        values = [int(v) for v in self._agreed.tolist()]
        return dict(zip(FLAGS, values[: len(FLAGS)], strict=True)), -values[len(FLAGS)]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
