"""Rank -> notebook event stream over Dask's structured events.

``Worker.log_event`` is thread-safe and goes over the worker's batched stream to the
scheduler, which forwards to subscribed clients (``Client.subscribe_topic``). Step records are
buffered and flushed at most every ``flush_s`` seconds per rank, so 16 ranks at 20 steps/s
make ~64 small messages/s rather than 320.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from distributed import get_worker

#: Column order of one step row (a list, to keep messages small).
STEP_COLUMNS = ("step", "time", "step_s", "data_s", "compute_s", "comm_s", "opt_s")


def topic_for(job_id: str) -> str:
    return f"nbtrain-{job_id}"


class EventEmitter:
    """Batches step rows and sends other events at once, on one job's topic."""

    def __init__(self, job_id: str, rank: int, generation: int, *, flush_s: float,
                 batch_max: int) -> None:
        self.topic = topic_for(job_id)
        self.rank = rank
        self.generation = generation
        self.flush_s = flush_s
        self.batch_max = batch_max
        self._rows: list[list[Any]] = []
        self._lock = threading.Lock()  # the checkpoint writer thread emits too
        self._last_flush = time.monotonic()
        self._worker = get_worker()

    def step(self, row: list[Any]) -> None:
        with self._lock:
            self._rows.append(row)
            now = time.monotonic()
            if len(self._rows) >= self.batch_max or now - self._last_flush >= self.flush_s:
                self._flush_locked(now)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked(time.monotonic())

    def emit(self, kind: str, **info: Any) -> None:
        """Send a non-step event now (flushing buffered steps first, to keep order)."""
        with self._lock:
            self._flush_locked(time.monotonic())
            self._send({"kind": kind, **info})

    def _flush_locked(self, now: float) -> None:
        self._last_flush = now
        if self._rows:
            rows, self._rows = self._rows, []
            self._send({"kind": "steps", "rows": rows})

    def _send(self, msg: dict[str, Any]) -> None:
        msg["rank"] = self.rank
        msg["gen"] = self.generation
        self._worker.log_event(self.topic, msg)
