"""The controller's inbox: events for the job machine in arrival order, fed in short slices.

The machine runs on the Dask scheduler's event loop, so the time one event takes is time
every other client, worker and heartbeat waits. Most events are small; a rank's batch of step
rows is not: the straggler detector judges each step the batch completes (~0.1 ms a step on
this project's CPU machine), so a 40-step batch held the loop for 5 ms and more. The inbox
splits such a batch into events of at most ``rows_per_event`` rows (same rank, same arrival
times, the same verdicts: the detector judges steps one at a time either way) and feeds what
is waiting in slices of about ``slice_s``, giving the loop back between slices.

Order is exact: every event goes through the one queue, and :meth:`Inbox.drain` feeds all
that waits before a caller that needs an answer now (a submission, a request) feeds its own
event. ``then`` runs right after its event was fed (the controller journals a committed
checkpoint there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

from nbtrain.core.lifecycle_types import Event
from nbtrain.core.machine_events import RankSteps

__all__ = ["ROWS_PER_EVENT", "SLICE_S", "Inbox", "split_rows"]

logger = logging.getLogger("nbtrain.engine")

#: Step rows per machine event: a few steps' judging, well under a millisecond.
ROWS_PER_EVENT = 8
#: How long one slice of waiting events may hold the loop before it yields.
SLICE_S = 0.002


def split_rows(event: Event, rows_per_event: int = ROWS_PER_EVENT) -> list[Event]:
    """A step-row message of more than ``rows_per_event`` rows as several messages, in
    order, each with the original's times; any other event as itself."""
    if not isinstance(event, RankSteps) or len(event.rows) <= rows_per_event:
        return [event]
    rows = event.rows
    return [dataclasses.replace(event, rows=list(rows[i:i + rows_per_event]))
            for i in range(0, len(rows), rows_per_event)]


class Inbox:
    """Events waiting for the machine; ``feed`` applies one, ``after_slice`` runs when a
    slice fed something (the controller wakes its followers)."""

    def __init__(self, feed: Callable[[Event], object], after_slice: Callable[[], None],
                 *, rows_per_event: int = ROWS_PER_EVENT, slice_s: float = SLICE_S) -> None:
        self._feed = feed
        self._after_slice = after_slice
        self.rows_per_event = rows_per_event
        self.slice_s = slice_s
        self._waiting: deque[tuple[Event, Callable[[], None] | None]] = deque()
        self._scheduled = False
        #: True while an event is being fed: an event fed from inside a command (a
        #: re-entrant feed) goes straight to the machine, as it would without the inbox.
        self.feeding = False
        #: How long each recent slice held the loop (seconds), for the controller's figures.
        self.slice_s_seen: deque[float] = deque(maxlen=10_000)

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, event: Event, then: Callable[[], None] | None = None) -> None:
        """Queue ``event`` (split when it is a long batch of step rows) and make sure a slice
        will feed it; with nothing waiting, its first part is fed at once."""
        parts = split_rows(event, self.rows_per_event)
        for part in parts[:-1]:
            self._waiting.append((part, None))
        self._waiting.append((parts[-1], then))
        if len(self._waiting) == len(parts) and not self.feeding:
            self._one()  # nothing was waiting: no reason to delay the first part
        if self._waiting and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._slice)

    def drain(self) -> None:
        """Feed everything waiting now (before an event whose caller needs its answer)."""
        if self.feeding:
            return
        while self._waiting:
            self._one()

    def _one(self) -> None:
        event, then = self._waiting.popleft()
        self.feeding = True
        try:
            self._feed(event)
        finally:
            self.feeding = False
        if then is not None:
            try:
                then()
            except Exception:  # a follow-up failing must not stop the events behind it
                logger.exception("nbtrain controller: after %s", type(event).__name__)

    def _slice(self) -> None:
        self._scheduled = False
        if not self._waiting:
            return
        t0 = time.perf_counter()
        self._one()  # at least one event a slice, whatever the budget
        while self._waiting and time.perf_counter() - t0 < self.slice_s:
            self._one()
        self.slice_s_seen.append(time.perf_counter() - t0)
        self._after_slice()
        if self._waiting:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._slice)
