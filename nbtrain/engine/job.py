"""``JobHandle``: a notebook's handle on one job. Every method returns at once.

The job lives in the cluster's controller (inside the Dask scheduler); the handle mirrors what
the controller says about it, kept current by the cluster's follower thread, and sends the
user's requests. Any client of the cluster can hold a handle on any job (``cluster.jobs``,
``cluster.job(name)``); only the handle that submitted it, a client holding its token, or the
cluster's operator may steer it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd

from nbtrain.core.faults import Fault
from nbtrain.core.job import JobSpec, JobState
from nbtrain.core.jobevents import generation_of
from nbtrain.core.jobrecord import JobStatus
from nbtrain.core.knobs import KnobState, check_change, knob_state
from nbtrain.core.records import JOB_ROW_COLUMNS
from nbtrain.core.straggler import StragglerSettings
from nbtrain.engine.joblog import Tail
from nbtrain.engine.safeload import result_loads

if TYPE_CHECKING:
    from nbtrain.engine.cluster import Cluster

__all__ = ["JobFailedError", "JobHandle"]

_log = logging.getLogger(__name__)
#: How long wait() lets each text view finish printing once the job ended.
FINISH_VIEWS_S = 5.0
#: What a handle keeps in memory without a cluster's settings (``Settings.handle_rows_kept``).
ROWS_KEPT = 50_000
EVENTS_KEPT = 20_000
OUTPUT_KEPT = 20_000


def row_frame(rows: list[Any]) -> pd.DataFrame:
    """Step rows (``JOB_ROW_COLUMNS`` then an optional metrics dict) as a DataFrame."""
    base = list(JOB_ROW_COLUMNS)
    if not rows:
        return pd.DataFrame(columns=base)
    frame = pd.DataFrame([r[: len(base)] for r in rows], columns=base)
    extra = [r[len(base)] if len(r) > len(base) else {} for r in rows]
    if any(extra):
        frame = frame.join(pd.DataFrame(extra, index=frame.index))
    return frame


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch))


class JobFailedError(RuntimeError):
    """Raised by :meth:`JobHandle.result` when the job failed."""


class JobHandle:
    """Live view and controls of one job (a mirror of the controller's record)."""

    def __init__(self, spec: JobSpec, cluster: Cluster | None = None, *, token: str = "",
                 checkpoint_url: str = "", status: Mapping[str, Any] | None = None,
                 follow: bool = False) -> None:
        self.spec = spec
        self._cluster = cluster
        self._token = token
        self._checkpoint_url = checkpoint_url
        self._lock = threading.RLock()
        self._done = threading.Event()
        #: What the controller said of the job, typed (``core.jobrecord.JobStatus``); the
        #: spec stands in for what it has not said yet.
        self._blank = JobStatus.before_news(spec, submitted=time.time())
        self._status = JobStatus.from_dict(status or {}, self._blank)
        self._hidden = str((status or {}).get("hidden") or "")
        # The newest rows, events and output lines by absolute position (older rows are
        # read back from the controller's journal when asked for).
        keep = cluster.settings.handle_rows_kept if cluster is not None else ROWS_KEPT
        self._rows = Tail(keep)  # JOB_ROW_COLUMNS, then the metrics dict
        self._events = Tail(EVENTS_KEPT)
        self._output = Tail(OUTPUT_KEPT)  # the ranks' output lines
        self._frame: pd.DataFrame | None = None  # job.metrics as last built ...
        self._frame_end = 0  # ... up to this row position
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._trackers: list[Any] = []  # client-side TrackerSinks (track())
        #: Views to let finish when wait() sees the end (see finish_with).
        self._finishers: list[Callable[[float], None]] = []
        self._following = False
        self._problem: str | None = None
        self._unreachable_since: float | None = None
        #: What the controller will not show this client of the job ("rows", "events",
        #: "output"), with why (``nbtrain.engine.access``).
        self._refused: dict[str, str] = {}
        self.submitted_at = float(self._status.submitted or time.time())
        if follow:
            self._follow()

    # -- identity -----------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.spec.job_id

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def token(self) -> str:
        """The secret that lets a client steer this job (empty on a handle that only
        watches). ``cluster.job(name, token=...)`` in another kernel steers with it."""
        return self._token

    def steer_with(self, token: str) -> None:
        """Steer this job with ``token`` from now on (the owner's ``job.token``, handed
        over from another kernel); a wrong one is refused by the controller."""
        with self._lock:
            self._token = token
            hidden, self._refused = bool(self._refused), {}
        if self._cluster is not None:
            info = self._cluster.rpc("nbtrain_job", key=self.id, token=token,
                                     operator=self._cluster.operator_token)
            self._checkpoint_url = str(info.get("checkpoint_url") or "")
            if hidden:  # it followed without the token: follow again, from the start
                with self._lock:
                    self._rows.rewind(0)
                    self._events.rewind(0)
                    self._output.rewind(0)
                    self._frame = None
                    self._following = False
                    self._done.clear()

    @property
    def owner(self) -> str:
        return self._now().owner

    @property
    def hidden(self) -> str:
        """Why this client sees only the scheduling facts of the job (its step, metrics,
        events and errors are its owner's: the cluster's ``visibility="owner"``); "" when it
        sees them."""
        self._follow()
        with self._lock:
            return self._hidden

    def _readable(self, part: str) -> None:
        """PermissionError naming the job, its owner and the fix, when the controller does
        not show this client ``part`` ("rows", "events", "output") of the job."""
        with self._lock:
            why = self._refused.get(part)
        if why:
            raise PermissionError(why)

    def _checkpoint_location(self) -> str:
        if not self._checkpoint_url and self._cluster is not None:
            from nbtrain.engine.access import refusal

            raise refusal({"name": self.name, "job_id": self.id, "owner": self.owner},
                          "checkpoint location")
        return self._checkpoint_url

    # -- state (read from any thread) ---------------------------------------------------
    def _now(self) -> JobStatus:
        self._follow()
        with self._lock:
            return self._status

    def snapshot(self) -> JobStatus:
        """The job's status as the controller last said it, typed (one consistent
        snapshot: every field from the same update)."""
        return self._now()

    @property
    def status(self) -> JobState:
        return JobState(self._now().state)

    @property
    def reason(self) -> str:
        """Why the job is in its state: what it waits for, or how it ended (and, while the
        controller cannot be reached, since when)."""
        reason = self._now().reason
        lost = self.unreachable_since
        if lost is not None:
            return (f"controller unreachable since {_clock(lost)} (last known: "
                    f"{self.status.value}, {reason})")
        return reason

    @property
    def unreachable_since(self) -> float | None:
        """When the cluster's controller stopped answering this handle's follower (epoch
        seconds), None while it answers. The handle keeps its last known state meanwhile and
        picks up where it was when the controller is back (a restarted scheduler restores
        its jobs from its state directory). It is set when a call to the controller fails,
        so an outage shorter than a follow call (``remote.NOTICE_WITHIN_S``, 4 s) may pass
        unnoticed; ``faults`` records every restart of the controller either way."""
        with self._lock:
            return self._unreachable_since

    @property
    def generation(self) -> int:
        return self._now().generation

    @property
    def slots(self) -> list[str]:
        """Dask worker addresses, index = rank (empty while not holding slots)."""
        return list(self._now().slots)

    @property
    def size(self) -> int:
        """Ranks it runs with now (0 while it holds no slots); an elastic job's size changes
        with resizes, ``spec.world_size`` is the size it was submitted with."""
        return self._now().size

    @property
    def target_size(self) -> int:
        """The size asked for: ``world_size``, or the last :meth:`resize`."""
        return self._now().target_size

    @property
    def size_bounds(self) -> tuple[int, int]:
        """``(min_size, max_size)``: the sizes :meth:`resize` accepts."""
        return self.spec.bounds

    @property
    def resize_note(self) -> str:
        """Why the job runs below its target size ("" when it does not)."""
        return self._now().resize_note

    @property
    def step(self) -> int:
        """Steps completed (as last reported by rank 0)."""
        return self._now().step

    @property
    def error(self) -> str | None:
        """The failure report (rank, step, remote traceback) when FAILED."""
        return self._now().error

    @property
    def restarts(self) -> int:
        return self._now().restarts

    @property
    def started_at(self) -> float | None:
        return self._now().started

    @property
    def ended_at(self) -> float | None:
        return self._now().ended

    @property
    def done(self) -> bool:
        self._follow()
        return self._done.is_set()

    @property
    def events(self) -> list[dict[str, Any]]:
        """Non-step events (ranks started/finished/failed, state changes, checkpoints,
        faults, stragglers), oldest first."""
        self._follow()
        self._readable("events")
        with self._lock:
            return list(self._events.items)

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per rank per step: phase times in seconds and the recipe's metrics (the
        whole run: rows older than the handle keeps come from the controller's journal).
        Built once and extended with new rows on later reads."""
        self._follow()
        self._readable("rows")
        with self._lock:
            end, base = self._rows.end, self._rows.base
            frame, frame_end = self._frame, self._frame_end
            if frame is not None and frame_end == end:
                return frame.copy()
            if frame is not None and base <= frame_end <= end:
                _, new = self._rows.since(frame_end, end)
                older: list[Any] = []
            else:
                frame, new = None, list(self._rows.items)
        if frame is None:
            older = self._fetch_rows(0, base) if base else []
        built = row_frame(older + new)
        if frame is not None and len(built):
            built = pd.concat([frame, built], ignore_index=True)
        elif frame is not None:
            built = frame
        with self._lock:
            self._frame, self._frame_end = built, end
        return built.copy()

    def _fetch_rows(self, start: int, stop: int) -> list[Any]:
        """Rows ``start..stop`` from the controller (its journal), oldest first; what could
        be read if it cannot be reached."""
        out: list[Any] = []
        if self._cluster is None:
            return out
        pos = start
        while pos < stop:
            try:
                reply = self._cluster.rpc(
                    "nbtrain_follow", cursors={self.id: [pos, 1 << 62, 1 << 62]}, timeout=0,
                    **self._cluster.read_tokens(self.id, self._token))
            except Exception as exc:
                _log.warning("nbtrain: job %s: rows %d-%d could not be read from the "
                             "controller (%s)", self.name, pos, stop, exc)
                break
            update = reply["jobs"].get(self.id) or {}
            rows = update.get("rows") or []
            at = int(update.get("rows_at", pos))
            if not rows or at >= stop:
                break
            out.extend(tuple(r) for r in rows[: stop - at])
            pos = at + len(rows)
        return out

    @property
    def row_count(self) -> int:
        """Step rows received so far (all ranks and generations): the position after the
        newest."""
        self._follow()
        with self._lock:
            return self._rows.end

    def rows_since(self, index: int) -> tuple[list[tuple[Any, ...]], int]:
        """Step rows after position ``index``, and the new position (for live views); rows
        older than the handle keeps are read from the controller."""
        self._follow()
        with self._lock:
            base, end = self._rows.base, self._rows.end
            _, rows = self._rows.since(index, end)
        if index < base:
            rows = self._fetch_rows(index, base) + rows
        return rows, end

    def track(self, *trackers: Any) -> None:
        """Feed trackers from this notebook: ``"wandb:PROJECT"``, any ``"KIND:TARGET"``
        (run here instead of in the controller), a ``TrackerSpec`` or your own
        ``nbtrain.Tracker`` object. They get the job's history kept so far, then every new
        step, checkpoint and fault, while this kernel follows the job (``submit(...,
        trackers=...)`` does this for client-side trackers)."""
        from nbtrain.engine.trackers import TrackerSink, TrackerSpec, parse_trackers

        items = [parse_trackers([t])[0] if isinstance(t, str) else t for t in trackers]
        items = [TrackerSpec(t.kind, t.target, t.experiment, "client")
                 if isinstance(t, TrackerSpec) else t for t in items]
        sink = TrackerSink(items, run=f"{self.spec.name}-{self.id}",
                           params=self.spec.describe(),
                           on_error=lambda msg: _log.warning("%s: %s", self.name, msg))
        with self._lock:  # the history so far, then the updates: nothing twice or missed
            sink.rows(list(self._rows.items))
            for event in self._events.items:
                sink.event(event)
            self._trackers.append(sink)
            ended = JobState(self._status.state).terminal and self._done.is_set()
        if ended:  # the end already passed through the history's events
            self._trackers.remove(sink)

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener(event)`` for each future non-step event (on the cluster's follower
        thread: keep it short and thread-safe)."""
        with self._lock:
            self._listeners.append(listener)

    def logs(self, rank: int | None = None, tail: int | None = 200) -> list[str]:
        """What the ranks printed, logged and warned (``[rank 1 g0] text``), oldest first:
        every rank's, or ``rank``'s; the last ``tail`` lines (None: all kept)."""
        from nbtrain.runtime.output import format_lines

        self._follow()
        self._readable("output")
        with self._lock:
            records = [o for o in self._output.items if rank is None or o["rank"] == rank]
        return format_lines(records[-tail:] if tail else records)

    def output_since(self, index: int) -> tuple[list[dict[str, Any]], int]:
        """Output records after position ``index`` and the new position (for live views)."""
        self._follow()
        with self._lock:
            return self._output.since(index, self._output.end)[1], self._output.end

    @property
    def faults(self) -> list[dict[str, Any]]:
        """Faults seen so far: what, its cause, rank, host, step, detection latency, recovery
        time, steps lost."""
        return [dict(f) for f in self._now().faults]

    @property
    def alerts(self) -> list[dict[str, Any]]:
        """Straggler verdicts (suspect / confirmed / cleared, with rank, phase, ratio, since
        and a hint) and the mitigation policy's actions, oldest first. Each carries a
        ``level``: "critical" for confirmed stragglers and replacements (what the dashboard
        and text progress show), "warning" for suspects (the early signal, listed here and
        shown with ``job.dashboard(show_suspects=True)``), "info" otherwise."""
        return [e for e in self.events if e["kind"] in ("straggler", "mitigation")]

    @property
    def memory(self) -> dict[int, dict[str, Any]]:
        """Each rank's training state of the newest generation that reported it:
        ``params_bytes``, ``grads_bytes``, ``optimizer_bytes`` (local shards: under FSDP a
        rank holds its share), ``rss_bytes``, ``strategy``, ``precision``; by rank."""
        newest: dict[int, dict[str, Any]] = {}
        gen = -1
        for e in self.events:
            if e["kind"] != "memory":
                continue
            generation = int(generation_of(e))
            if generation > gen:
                newest, gen = {}, generation
            if generation == gen:
                newest[int(e["rank"])] = {k: v for k, v in e.items() if k not in (
                    "kind", "job", "rank", "generation", "gen", "time")}
        return newest

    def goodput(self) -> dict[str, float]:
        """Wall time split into productive steps, queueing, startup, checkpoint blocking,
        recovery and lost (recomputed) work, in seconds, plus the productive fraction (as of
        the controller's last word, at most a couple of seconds old while the job runs)."""
        return dict(self._now().goodput)

    # -- controls -----------------------------------------------------------------------
    def _request(self, what: str, arg: Any = None) -> None:
        if self._cluster is None:
            raise RuntimeError(f"job {self.name}: this handle is not attached to a cluster")
        reply = self._cluster.rpc("nbtrain_request", job_id=self.id, what=what, arg=arg,
                                  token=self._cluster.credential(self._token))
        self.follow_update({"status": reply["status"]})

    def stop(self) -> None:
        """Stop at the next step boundary (or leave the queue) and release the slots."""
        self._request("stop")

    def preempt(self) -> None:
        """Checkpoint at the next step boundary, wait for it to commit, release every slot
        (state PREEMPTED). :meth:`resume` continues from that checkpoint."""
        self._request("preempt")

    def resume(self) -> None:
        """Queue a PREEMPTED job again; it continues from its newest committed checkpoint.
        Raises ValueError for a job in another state (the controller judges)."""
        self._request("resume")

    def resize(self, n: int, *, wait_for_workers: bool = False) -> None:
        """Run with ``n`` ranks (between ``min_size`` and ``max_size``). Returns at once; at
        the next agreed step boundary the ranks checkpoint, the generation ends and the next
        one starts at ``n`` from that checkpoint, with the rest of the epoch split over the
        new ranks (every sample once) and the global batch unchanged.

        A shrink happens at once. Growth takes the slots that are free now (whole gangs
        only) and waits for the rest (``resize_note`` says what for). A size above the
        cluster's slots is refused unless ``wait_for_workers=True`` (then the job grows
        when workers join). Events ``resize`` (phase requested/waiting/started/done) follow
        it; raises ValueError with the bounds for a size the job may not have."""
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"resize(n): n must be an integer number of ranks, got {n!r}")
        from nbtrain.core.explain import resize_rejected

        # The bounds are known here: refused before anything is sent (the machine checks
        # again, with the cluster's size).
        why = resize_rejected(name=self.name, resizable=self.spec.resizable,
                              world_size=self.spec.world_size, bounds=self.size_bounds, size=n,
                              total=n, unit="slots", wait_for_workers=True)
        if why:
            raise ValueError(why)
        self._request("resize", {"size": n, "wait_for_workers": wait_for_workers})

    def checkpoint(self) -> None:
        """Take a checkpoint at the next agreed step boundary (asynchronously)."""
        self._request("checkpoint")

    def inject(self, kind: str, rank: int, *, step: int | None = None, factor: float = 2.0,
               duration_s: float | None = None) -> Fault:
        """Inject a fault into a rank: ``kill`` its worker process, ``raise`` an exception,
        ``hang`` it, or ``slow`` its compute by ``factor`` (``factor=1`` clears a slowdown).

        ``step=None`` fires at the rank's next step; a step number fires there (at most once
        per job, also across restarts). For teaching, tests and the dashboard.
        """
        fault = Fault(kind=kind, rank=rank, step=step,
                      factor=factor if kind == "slow" else 1.0, duration_s=duration_s)
        self._request("inject", fault.to_dict())
        return fault

    @property
    def knobs(self) -> KnobState:
        """The job's live knobs: ``declared`` (bounds), ``values`` in force now, the applied
        ``history`` (step, values, who) and the changes still ``pending``."""
        return knob_state(self.events, self.step)

    def set(self, *, ramp: int = 0, shape: str = "linear", wait: bool = True,
            timeout: float = 30.0, **values: float) -> int | None:
        """Change declared knobs live, ``job.set(lr=3e-4, aux_weight=0.2)``: every rank
        applies the change at the same agreed step (the next agreement, usually within a
        fraction of a second) and it is recorded, so restarts and ``submit(replay=job)``
        apply it again at that step. ``ramp=N``: move there over N steps (``shape``
        ``"linear"`` or ``"cosine"``) instead of at once.

        Checked against the declared bounds here and again by the controller (ValueError
        naming the values and the bounds); only the job's owner or the operator may set.
        Returns the step it was applied at (in force from the next step), or None with
        ``wait=False``; TimeoutError when the ranks did not apply it within ``timeout``."""
        declared = self.knobs.declared
        if declared:  # known here once the ranks declared them: refused before sending
            check_change(declared, values, ramp=ramp, shape=shape, job=f"job {self.name}")
        self._request("set", {"values": values, "ramp": ramp, "shape": shape})
        seq = self._now().knob_seq
        if not wait:
            return None
        deadline = time.monotonic() + timeout
        while True:
            step = self._knob_applied(seq)
            if step is not None:
                return step
            if self.done:
                raise RuntimeError(f"job {self.name} ended ({self.status.value}) before its "
                                   f"ranks applied the knob change")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.name}: its ranks did not apply the knob change "
                                   f"{values} within {timeout} s ({self.reason}); it stays "
                                   "pending and applies when they next agree")
            time.sleep(0.01)

    def _knob_applied(self, seq: int) -> int | None:
        """The step knob change ``seq`` was applied at (None: not yet), newest events first
        (back to the change's own ``knob_set``)."""
        for event in reversed(self.events):
            kind = event.get("kind")
            if kind == "knob_applied":
                for change in event.get("changes") or ():
                    if change.get("seq") == seq:
                        return int(event["step"])
            elif kind == "knob_set" and (event.get("change") or {}).get("seq") == seq:
                return None
        return None

    def tune_stragglers(self, **changes: Any) -> None:
        """Change straggler-detector thresholds while the job runs (fields of
        ``nbtrain.core.straggler.StragglerSettings``: ratio, window, suspect_votes, ...)."""
        dataclasses.replace(StragglerSettings(), **changes)  # validate now, in the caller
        self._request("stragglers", changes)

    @property
    def checkpoint_dir(self) -> str:
        """This job's checkpoint directory (local path or fsspec URL): for its owner and
        the operator."""
        return self._checkpoint_location()

    @property
    def checkpoints(self) -> list[dict[str, Any]]:
        """Committed checkpoints of this job, newest first: step, bytes, created, url."""
        from nbtrain.engine.checkpoints import committed_checkpoints

        return committed_checkpoints(self._checkpoint_location())

    def state_dict(self, step: int | str = "latest") -> dict[str, Any]:
        """The job's tracked state from its newest (or ``step``'s) committed checkpoint, as
        plain state dicts: ``model.load_state_dict(job.state_dict()["model"])``."""
        from nbtrain.checkpoints import load_checkpoint

        return load_checkpoint(self, step).state

    def finish_with(self, finisher: Callable[[float], None]) -> None:
        """``finisher(timeout_s)`` is called by :meth:`wait` once the job ended, before it
        returns: a text view prints its last lines then, inside the cell that waited
        (printed later, from its own thread, they would reach no cell)."""
        with self._lock:
            self._finishers.append(finisher)

    def wait(self, timeout: float | None = None) -> JobState:
        """Block until the job ends; return its final state. Raises TimeoutError."""
        self._follow()
        if self._done.wait(timeout):
            with self._lock:  # kept: the view's own thread waits too, and returns at once
                finishers = list(self._finishers)
            for finish in finishers:
                with contextlib.suppress(Exception):  # a view never fails the wait
                    finish(FINISH_VIEWS_S)
        else:
            lost = self.unreachable_since
            if lost is not None:
                raise TimeoutError(
                    f"job {self.name}: the nbtrain controller has been unreachable since "
                    f"{_clock(lost)} ({self._problem}); last known {self.status.value} at "
                    f"step {self.spec.progress(self.step)}. If its scheduler restarts on "
                    "the same state directory the job continues: wait again")
            raise TimeoutError(
                f"job {self.name} still {self.status.value} after {timeout} s "
                f"(step {self.spec.progress(self.step)}); call job.stop() to end it"
            )
        return self.status

    def wait_for_size(self, n: int, timeout: float | None = None) -> None:
        """Block until the job trains at ``n`` ranks (its first step at that size), e.g.
        after :meth:`resize`. Raises TimeoutError with what it waits for, or RuntimeError
        when the job ends first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self.size == n and self.status is JobState.RUNNING):
            if self.status.terminal:
                raise RuntimeError(f"job {self.name} ended ({self.status.value}: "
                                   f"{self.reason}) before it ran at {n} ranks")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {self.name} runs at {self.size} ranks, not {n}, after {timeout} s: "
                    f"{self.resize_note or self.reason}")
            time.sleep(0.05)

    def result(self, timeout: float | None = None, *, trust: bool = False) -> Any:
        """Wait, then raise :class:`JobFailedError` unless the job succeeded. Returns the
        training function's return value on rank 0 (a Recipe job returns this handle).

        A result of a job this handle cannot steer (another user's: no token) is read as
        data only (numbers, strings, lists, dicts, NumPy arrays, tensors), never unpickled
        in full, since that would run its owner's code here: anything else raises
        ``UntrustedResultError``. ``trust=True`` loads it in full anyway."""
        state = self.wait(timeout)
        if state is not JobState.SUCCEEDED:
            detail = f"\n{self.error}" if self.error else ""
            raise JobFailedError(f"job {self.name} {state.value}: {self.reason}{detail}")
        if self.spec.extra.get("kind") != "function":
            return self
        if self._cluster is None:
            raise RuntimeError(f"job {self.name}: this handle is not attached to a cluster")
        reply = self._cluster.rpc("nbtrain_result", job_id=self.id, token=self._token,
                                  operator=self._cluster.operator_token)
        if reply.get("error"):
            raise JobFailedError(f"job {self.name} succeeded but its result did not come back: "
                                 f"{reply['error']}")
        data = reply.get("result")
        if data is None:
            return None
        return result_loads(data, job=f"{self.name} ({self.id})", owner=self.owner,
                            trusted=trust or bool(self._token))

    # -- views ----------------------------------------------------------------------------
    def dashboard(self, display: str | None = None, **options: Any) -> Any:
        """The job's live view. Returns at once.

        ``display``: "auto" (default; env NBTRAIN_DISPLAY overrides): the page the cluster
        serves, shown here in an iframe, when in a notebook, else text progress; "page";
        "widget" (a kernel-side widget: it updates on the kernel's event loop, so it waits
        while a cell runs); "text". The page has controls (preempt, resume, checkpoint, stop,
        resize) for the job's owner and the operator, and is read-only for anyone else; it
        keeps updating while this kernel is busy or gone. ``options`` tune the widget
        (``rate_hz``, ``lines_max_ranks``, ``window_steps``); ``show_suspects=True`` lists
        suspect stragglers (the early signal) too, not only confirmed ones.
        """
        from nbtrain.ui.dashboard import job_dashboard

        return job_dashboard(self, display=display, **options)

    def page(self, *, show_suspects: bool = False) -> Any:
        """The job's page served by the cluster (a ``PageView``: ``.url``, shown in a
        notebook as the live page); with controls when this handle owns the job.
        ``show_suspects=True`` lists suspect stragglers among its alerts too."""
        from nbtrain.ui.pageview import PageView

        if self._cluster is None:
            raise RuntimeError(f"job {self.name}: this handle is not attached to a cluster")
        reply = self._cluster.rpc("nbtrain_view", job_id=self.id,
                                  token=self._cluster.credential(self._token))
        if reply["served"] == "none":
            raise RuntimeError("this cluster's scheduler has no web server (its dashboard is "
                               "off), so it serves no pages: use display='widget' or 'text'")
        path = reply["path"] + ("&suspects=1" if show_suspects else "")
        return PageView(self._cluster.page_url(path), f"job {self.name}",
                        controls=bool(reply["controls"]))

    def report(self, path: str) -> str:
        """Write a standalone HTML report (plots and summary) to ``path``; returns the path."""
        from nbtrain.ui.report import write_report

        return write_report(self, path)

    # -- the mirror (fed by the cluster's follower thread) --------------------------------
    def _follow(self) -> None:
        """Start mirroring: fetch what the controller has now (so a handle attached to a
        running or ended job shows its history at once), then keep following."""
        if self._following or self._cluster is None or self._done.is_set():
            return
        self._following = True
        # Rows: only the newest window (a negative cursor); older ones are read on demand.
        reply = self._cluster.rpc(
            "nbtrain_follow", cursors={self.id: [-self._rows.keep, 0, 0]}, timeout=0,
            **self._cluster.read_tokens(self.id, self._token))
        update = reply["jobs"].get(self.id)
        if update is not None:
            self.follow_update(update)
        if not self._done.is_set():
            self._cluster.follow(self)

    # -- what the cluster's follower uses (``nbtrain.engine.remote.Mirror``) ---------------
    def follow_position(self) -> tuple[int, int, int]:
        """(for the cluster's follower) The positions of the next row, event and output
        line this handle needs from the controller."""
        with self._lock:
            return self._rows.end, self._events.end, self._output.end

    def follow_finished(self) -> bool:
        """(for the cluster's follower) True once the job ended and everything is here."""
        return self._done.is_set()

    def follow_lost(self, exc: BaseException, since: float | None = None) -> None:
        """(for the cluster's follower) The controller could not be reached (``since``: when
        it first failed); the handle says so until the next update."""
        with self._lock:
            self._problem = f"{type(exc).__name__}: {exc}"
            if self._unreachable_since is None:
                self._unreachable_since = since or time.time()

    def follow_update(self, update: Mapping[str, Any]) -> None:
        """(for the cluster's follower) Take what the controller sent: rows, events and
        output after our positions, and the status."""
        if update.get("gone"):
            # Neither in its memory nor in its journal: say so, and invent no end state.
            with self._lock:
                state = self._status.state
                if not JobState(state).terminal:
                    self._status = dataclasses.replace(self._status, reason=(
                        f"the controller does not know this job (was it started again on "
                        f"another state directory?); last known: {state}"))
            self._done.set()
            return
        new_events: list[dict[str, Any]] = []
        with self._lock:
            self._problem = None
            self._unreachable_since = None
            self._rewind(update)
            rows = update.get("rows") or []
            new_rows: list[tuple[Any, ...]] = []
            if rows:
                at = int(update.get("rows_at", self._rows.end))
                new_rows = [tuple(r) for r in rows[max(0, self._rows.end - at):]]
                self._rows.put(at, [tuple(r) for r in rows])
            events = update.get("events") or []
            if events:
                at = int(update.get("events_at", self._events.end))
                new_events = [dict(e) for e in events[max(0, self._events.end - at):]]
                self._events.put(at, [dict(e) for e in events])
            output = update.get("output") or []
            if output:
                self._output.put(int(update.get("output_at", self._output.end)),
                                 [dict(o) for o in output])
            if "status" in update:
                self._status = JobStatus.from_dict(update["status"], self._blank)
                self._hidden = str(update["status"].get("hidden") or "")
            self._refused = {str(k): str(v) for k, v in dict(update.get("refused") or {}).items()}
            drained = (self._rows.end >= int(update.get("rows_end", self._rows.end))
                       and self._events.end >= int(update.get("events_end", self._events.end)))
            terminal = JobState(self._status.state).terminal
            listeners = list(self._listeners)
            sinks = list(self._trackers)
        for sink in sinks:  # enqueue only: their own thread writes
            sink.rows(new_rows)
            for event in new_events:
                sink.event(event)
        for event in new_events:
            for listener in listeners:
                with contextlib.suppress(Exception):  # a broken view must not stop following
                    listener(event)
        if terminal and drained:
            self._done.set()

    def _rewind(self, update: Mapping[str, Any]) -> None:
        """A restarted controller lost what it had not journaled yet (its last fraction of a
        second): where its log ends before our position, drop what we hold past that end, so
        what it writes there next is not skipped."""
        for key, tail in (("rows", self._rows), ("events", self._events),
                          ("output", self._output)):
            end = update.get(f"{key}_end")
            if end is not None and int(end) < tail.end:
                tail.rewind(int(end))
                if key == "rows":
                    self._frame = None

    # -- notebook display -----------------------------------------------------------------
    def __repr__(self) -> str:
        state = self.status.value
        if self.unreachable_since is not None:
            state = f"{state}? (controller unreachable)"
        step = "(hidden)" if self.hidden else self.spec.progress(self.step)
        return (f"<JobHandle {self.name} {state} step {step} "
                f"world_size={self.spec.world_size}: {self.hidden or self.reason}>")

    def _repr_html_(self) -> str:
        import html

        state = self.status.value
        colour = {"RUNNING": "#2a7", "SUCCEEDED": "#27a", "FAILED": "#c33",
                  "QUEUED": "#a80"}.get(state, "#666")
        err = (f"<pre style='max-height:12em;overflow:auto'>{html.escape(self.error)}</pre>"
               if self.error else "")
        owner = f", owner {html.escape(self.owner)}" if self.owner else ""
        return (
            f"<div><b>nbtrain job {html.escape(self.name)}</b> "
            f"<span style='color:{colour}'>{state}</span> — step {self.spec.progress(self.step)}, "
            f"world size {self.spec.world_size}, generation {max(self.generation, 0)}{owner}"
            f"<br><i>{html.escape(self.reason)}</i>{err}</div>"
        )

