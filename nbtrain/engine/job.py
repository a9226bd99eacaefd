"""``JobHandle``: the notebook's handle on one job. Every method returns at once."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pandas as pd

from nbtrain.core.goodput import GoodputLedger
from nbtrain.core.job import JobSpec, JobState
from nbtrain.core.mitigation import MitigationSettings
from nbtrain.core.straggler import StragglerSettings
from nbtrain.engine.stragglers import StragglerWatch
from nbtrain.runtime.events import STEP_COLUMNS
from nbtrain.runtime.faults import Fault

if TYPE_CHECKING:
    from nbtrain.engine.controller import Controller


class JobFailedError(RuntimeError):
    """Raised by :meth:`JobHandle.result` when the job failed."""


class JobHandle:
    """Live view and controls of one job. State is written by the controller thread only."""

    def __init__(self, spec: JobSpec, recipe: bytes, controller: Controller,
                 checkpoint_url: str, faults: list[Fault] | None = None,
                 mitigation: MitigationSettings | None = None) -> None:
        self.spec = spec
        self._recipe = recipe
        self._controller = controller
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._state = JobState.QUEUED
        self._reason = "waiting for the scheduler"
        self._generation = -1
        self._slots: list[str] = []
        self._rows: list[tuple[Any, ...]] = []  # (gen, rank, *STEP_COLUMNS, metrics)
        self._events: list[dict[str, Any]] = []
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._step = 0
        self._error: str | None = None
        self.submitted_at = time.time()
        self.started_at: float | None = None
        self.ended_at: float | None = None
        # Controller-owned bookkeeping (written on the controller thread only).
        self._ckpt_url = checkpoint_url
        self._restore: tuple[str, int | None] | None = None
        self._faults: list[Fault] = list(faults or [])
        self._fired: set[str] = set()
        self._fault_log: list[dict[str, Any]] = []
        self._restarts: list[float] = []
        self._recovering = ""
        self._avoid_slots: set[str] = set()
        self._stop_requested = False
        self._preempt_requested = False
        self._checkpoint_seq = 0
        self._ledger = GoodputLedger(time.monotonic())
        self._stragglers = StragglerWatch(spec.world_size, mitigation=mitigation)
        self._replace: dict[str, str] | None = None

    # -- identity -----------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.spec.job_id

    @property
    def name(self) -> str:
        return self.spec.name

    # -- state (read from any thread) ---------------------------------------------------
    @property
    def status(self) -> JobState:
        with self._lock:
            return self._state

    @property
    def reason(self) -> str:
        """Why the job is in its state: what it waits for, or how it ended."""
        with self._lock:
            return self._reason

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def slots(self) -> list[str]:
        """Dask worker addresses, index = rank (empty while not holding slots)."""
        with self._lock:
            return list(self._slots)

    @property
    def step(self) -> int:
        """Steps completed (as last reported by rank 0)."""
        with self._lock:
            return self._step

    @property
    def error(self) -> str | None:
        """The failure report (rank, step, remote traceback) when FAILED."""
        with self._lock:
            return self._error

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def events(self) -> list[dict[str, Any]]:
        """Non-step events (rank started/finished/failed, state changes), oldest first."""
        with self._lock:
            return list(self._events)

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per rank per step: phase times in seconds and the recipe's metrics."""
        with self._lock:
            rows = list(self._rows)
        base = ["generation", "rank", *STEP_COLUMNS]
        if not rows:
            return pd.DataFrame(columns=base)
        frame = pd.DataFrame([r[: len(base)] for r in rows], columns=base)
        extra = [r[len(base)] if len(r) > len(base) else {} for r in rows]
        if any(extra):
            frame = frame.join(pd.DataFrame(extra, index=frame.index))
        return frame

    @property
    def row_count(self) -> int:
        """Step rows received so far (all ranks and generations)."""
        with self._lock:
            return len(self._rows)

    def rows_since(self, index: int) -> tuple[list[tuple[Any, ...]], int]:
        """Step rows appended after position ``index``, and the new position (for live views)."""
        with self._lock:
            return self._rows[index:], len(self._rows)

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener(event)`` for each future non-step event (on the controller thread:
        keep it short and thread-safe)."""
        with self._lock:
            self._listeners.append(listener)

    # -- controls -----------------------------------------------------------------------
    def stop(self) -> None:
        """Stop at the next step boundary (or leave the queue) and release the slots."""
        self._controller.request(self, "stop")

    def preempt(self) -> None:
        """Checkpoint at the next step boundary, wait for it to commit, release every slot
        (state PREEMPTED). :meth:`resume` continues from that checkpoint."""
        self._controller.request(self, "preempt")

    def resume(self) -> None:
        """Queue a PREEMPTED job again; it continues from its newest committed checkpoint."""
        state = self.status
        if state is not JobState.PREEMPTED:
            raise ValueError(
                f"job {self.name} is {state.value}: only a PREEMPTED job can resume(); to "
                f"continue an ended job submit it again with resume='latest'"
            )
        self._controller.request(self, "resume")

    def checkpoint(self) -> None:
        """Take a checkpoint at the next agreed step boundary (asynchronously)."""
        self._controller.request(self, "checkpoint")

    def inject(self, kind: str, rank: int, *, step: int | None = None, factor: float = 2.0,
               duration_s: float | None = None) -> Fault:
        """Inject a fault into a rank: ``kill`` its worker process, ``raise`` an exception,
        ``hang`` it, or ``slow`` its compute by ``factor`` (``factor=1`` clears a slowdown).

        ``step=None`` fires at the rank's next step; a step number fires there (at most once
        per job, also across restarts). For teaching, tests and the dashboard.
        """
        if not 0 <= rank < self.spec.world_size:
            raise ValueError(f"rank must be in 0..{self.spec.world_size - 1}, got {rank}")
        fault = Fault(kind=kind, rank=rank, step=step,
                      factor=factor if kind == "slow" else 1.0, duration_s=duration_s)
        self._controller.request(self, "inject", fault)
        return fault

    @property
    def checkpoint_dir(self) -> str:
        """This job's checkpoint directory (local path or fsspec URL)."""
        return self._ckpt_url

    @property
    def checkpoints(self) -> list[dict[str, Any]]:
        """Committed checkpoints of this job, newest first: step, bytes, created, url."""
        from nbtrain.engine.checkpoints import committed_checkpoints

        return committed_checkpoints(self._ckpt_url)

    @property
    def faults(self) -> list[dict[str, Any]]:
        """Faults seen so far: what, rank, host, step, detection latency, recovery time."""
        with self._lock:
            return [{k: v for k, v in f.items() if k != "detected_mono"}
                    for f in self._fault_log]

    @property
    def alerts(self) -> list[dict[str, Any]]:
        """Straggler verdicts (suspect / confirmed / cleared, with rank, phase, ratio, since
        and a hint) and the mitigation policy's actions, oldest first."""
        return [e for e in self.events if e["kind"] in ("straggler", "mitigation")]

    def tune_stragglers(self, **changes: Any) -> None:
        """Change straggler-detector thresholds while the job runs (fields of
        ``nbtrain.core.straggler.StragglerSettings``: ratio, window, suspect_votes, ...)."""


        dataclasses.replace(StragglerSettings(), **changes)  # validate now, in the caller
        self._controller.request(self, "stragglers", changes)

    @property
    def restarts(self) -> int:
        return len(self._restarts)

    def goodput(self) -> dict[str, float]:
        """Wall time split into productive steps, queueing, startup, checkpoint blocking,
        recovery and lost (recomputed) work, in seconds, plus the productive fraction."""
        return self._ledger.snapshot(time.monotonic()).as_dict()

    def wait(self, timeout: float | None = None) -> JobState:
        """Block until the job ends; return its final state. Raises TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"job {self.name} still {self.status.value} after {timeout} s "
                f"(step {self.step}/{self.spec.steps}); call job.stop() to end it"
            )
        return self.status

    def result(self, timeout: float | None = None) -> JobHandle:
        """Wait, then raise :class:`JobFailedError` unless the job succeeded."""
        state = self.wait(timeout)
        if state is not JobState.SUCCEEDED:
            detail = f"\n{self.error}" if self.error else ""
            raise JobFailedError(f"job {self.name} {state.value}: {self.reason}{detail}")
        return self

    # -- views ----------------------------------------------------------------------------
    def dashboard(self, display: str | None = None, **options: Any) -> Any:
        """A live dashboard: a widget in JupyterLab, or text progress when headless.

        ``display`` is "auto" (default; env NBTRAIN_DISPLAY overrides), "widget" or "text".
        ``options`` tune the view (``rate_hz``, ``lines_max_ranks``, ``window_steps``).
        Returns at once; the view updates on the kernel's event loop.
        """
        from nbtrain.ui.dashboard import job_dashboard

        return job_dashboard(self, display=display, **options)

    def report(self, path: str) -> str:
        """Write a standalone HTML report (plots and summary) to ``path``; returns the path."""
        from nbtrain.ui.report import write_report

        return write_report(self, path)

    # -- controller side (called on the controller thread) --------------------------------
    def _set_state(self, state: JobState, reason: str) -> None:
        with self._lock:
            if self._state is state and self._reason == reason:
                return
            self._state = state
            self._reason = reason
            if state.terminal:
                self.ended_at = time.time()
        self._add_event({"kind": "state", "state": state.value, "reason": reason})
        if state.terminal:
            self._done.set()

    def _add_event(self, event: dict[str, Any]) -> None:
        event.setdefault("time", time.time())
        with self._lock:
            self._events.append(event)
            listeners = list(self._listeners)
        for listener in listeners:
            with contextlib.suppress(Exception):  # a broken view must not break the controller
                listener(event)

    def _add_rows(self, generation: int, rank: int, rows: list[list[Any]]) -> None:
        with self._lock:
            for row in rows:
                self._rows.append((generation, rank, *row))
            if rank == 0 and rows:
                self._step = max(self._step, int(rows[-1][0]))

    # -- notebook display -----------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"<JobHandle {self.name} {self.status.value} step {self.step}/{self.spec.steps} "
                f"world_size={self.spec.world_size}: {self.reason}>")

    def _repr_html_(self) -> str:
        import html

        state = self.status.value
        colour = {"RUNNING": "#2a7", "SUCCEEDED": "#27a", "FAILED": "#c33",
                  "QUEUED": "#a80"}.get(state, "#666")
        err = (f"<pre style='max-height:12em;overflow:auto'>{html.escape(self.error)}</pre>"
               if self.error else "")
        return (
            f"<div><b>nbtrain job {html.escape(self.name)}</b> "
            f"<span style='color:{colour}'>{state}</span> — step {self.step}/{self.spec.steps}, "
            f"world size {self.spec.world_size}, generation {max(self.generation, 0)}<br>"
            f"<i>{html.escape(self.reason)}</i>{err}</div>"
        )
