"""Pull-based refresh of live views on the kernel's own event loop.

Why pull, and why this loop: rank events arrive on Dask's IO thread and the controller
thread. ipywidgets and Bokeh documents are not thread-safe, and since ipykernel 7 moved shell
handling to its own thread, widget writes from foreign threads race with the kernel's own
message handling. So nothing is pushed into widgets from those threads. Instead the view asks
the :class:`~nbtrain.engine.job.JobHandle` (whose reads are lock-protected) for what is new,
a few times a second, from the thread that runs the notebook's cells: the asyncio loop that
ipykernel's tornado IOLoop runs on. Between cells that loop is idle, so a tick runs at once;
while a cell computes, ticks wait and then resume (they do not pile up: each tick schedules
the next only after it finished).

We use ``loop.call_later`` rather than tornado's ``PeriodicCallback``: it is plain asyncio
(works in any kernel on asyncio, and in tests with ``asyncio.run``), and scheduling the next
tick after the current one ends bounds the rate even when a tick is slow. A tick that costs
more than :data:`MAX_DUTY` of its period stretches the period, so the view never takes more
than that share of the kernel, whatever the job's size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: The most of the kernel's time a view may take: a tick costing c seconds waits at least
#: c * (1 / MAX_DUTY - 1) before the next one.
MAX_DUTY = 0.1
#: After this many failed ticks in a row the view stops refreshing (and says so) rather than
#: logging the same error forever.
MAX_CONSECUTIVE_ERRORS = 5


class Poller:
    """Calls ``tick()`` on an asyncio loop at most ``hz`` times a second while it returns True.

    ``tick`` returns False when there is nothing more to draw (the job ended and its last rows
    are shown); the poller then stops by itself. ``on_error(exc)`` is told about failed ticks.
    """

    def __init__(self, tick: Callable[[], bool], hz: float, *, name: str = "view",
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        if hz <= 0:
            raise ValueError(f"refresh rate must be positive, got {hz} Hz")
        self._tick = tick
        self.period_s = 1.0 / hz
        self.name = name
        self._on_error = on_error
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._running = False
        self._errors = 0
        #: Statistics: ticks run, total and last tick cost in seconds (for benchmarks/tests).
        self.ticks = 0
        self.busy_s = 0.0
        self.last_s = 0.0
        self.last_error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._running

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> bool:
        """Start ticking on ``loop`` (default: the loop running in this thread, i.e. the
        kernel's). Returns False when there is no loop to tick on (plain Python): the owner
        then refreshes on demand instead."""
        if self._running:
            return True
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return False
        self._loop = loop
        self._running = True
        try:
            same_thread = asyncio.get_running_loop() is loop
        except RuntimeError:
            same_thread = False
        if same_thread:
            self._handle = loop.call_soon(self._run)
        else:
            self._handle = None
            loop.call_soon_threadsafe(self._run)
        return True

    def stop(self) -> None:
        """Stop ticking (idempotent). Call from the loop's thread."""
        self._running = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _run(self) -> None:
        if not self._running or self._loop is None:
            return
        started = time.perf_counter()
        more = True
        try:
            more = bool(self._tick())
            self._errors = 0
        except Exception as exc:  # a broken tick must not take the kernel's loop down
            self._errors += 1
            self.last_error = exc
            logger.exception("nbtrain %s refresh failed", self.name)
            if self._on_error is not None:
                try:
                    self._on_error(exc)
                except Exception:
                    logger.exception("nbtrain %s error handler failed", self.name)
            if self._errors >= MAX_CONSECUTIVE_ERRORS:
                more = False
        cost = time.perf_counter() - started
        self.ticks += 1
        self.busy_s += cost
        self.last_s = cost
        if not more or not self._running:
            self._running = False
            self._handle = None
            return
        delay = max(self.period_s, cost * (1.0 / MAX_DUTY - 1.0))
        self._handle = self._loop.call_later(delay, self._run)
