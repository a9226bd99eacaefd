"""Rank -> controller event stream over Dask's structured events.

``Worker.log_event`` is thread-safe and goes over the worker's batched stream to the
scheduler, where the controller's ``log_event`` hook takes it. Every rank of every job writes
to one topic (``RANK_TOPIC``), so the scheduler's own copy of the stream is one bounded deque,
not one per job. Step records are buffered and flushed at most every ``flush_s`` seconds per
rank, so 16 ranks at 20 steps/s make ~64 small messages/s rather than 320.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from distributed import get_worker

from nbtrain.core.jobevents import rank_event
from nbtrain.core.rankseal import seal
from nbtrain.core.records import ROW_COLUMNS

#: Column order of one step row (a list, to keep messages small); defined in core.records.
STEP_COLUMNS = ROW_COLUMNS
#: The Dask event topic of every rank's events.
RANK_TOPIC = "nbtrain-ranks"
_OWN_FIELDS = frozenset({"kind", "job", "rank", "generation", "time", "seq", "seal"})


class EventEmitter:
    """Batches step rows and sends other events at once, on one job's topic; each event
    is numbered and sealed with the generation's secret (:mod:`nbtrain.core.rankseal`)."""

    def __init__(self, job_id: str, rank: int, generation: int, *, flush_s: float,
                 batch_max: int, secret: str = "") -> None:
        self.job_id = job_id
        self.topic = RANK_TOPIC
        self.rank = rank
        self.generation = generation
        self.flush_s = flush_s
        self.batch_max = batch_max
        self._rows: list[list[Any]] = []
        self._lock = threading.Lock()  # the checkpoint writer thread emits too
        self._last_flush = time.monotonic()
        self._worker = get_worker()
        self._secret = secret
        self._seq = 0

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
            self._send(kind, info)

    def emit_aside(self, kind: str, **info: Any) -> None:
        """Send a non-step event now, leaving buffered steps buffered: for an event whose
        order relative to step rows does not matter (a flush per such event would break the
        step batches)."""
        with self._lock:
            self._send(kind, info)

    def _flush_locked(self, now: float) -> None:
        self._last_flush = now
        if self._rows:
            rows, self._rows = self._rows, []
            self._send("steps", {"rows": rows})

    def _send(self, kind: str, info: dict[str, Any]) -> None:
        # The emitter's own fields win (a checkpoint writer's info repeats the rank).
        extra = {k: v for k, v in info.items() if k not in _OWN_FIELDS}
        seq, self._seq = self._seq, self._seq + 1  # under the lock
        self._worker.log_event(self.topic, rank_event(
            kind, job=self.job_id, rank=self.rank, generation=self.generation, time=time.time(),
            seq=seq, seal=seal(self._secret, self.job_id, self.generation, self.rank, seq, kind),
            **extra))
