"""Fold a job's non-step events into what the views show: checkpoint state, alerts, stragglers.

One object, fed event by event, shared by the live widget, the text progress and the HTML
report, so all three say the same thing. It does no I/O and reads no clock: ages are computed
by the caller from the event times. Unknown event kinds are kept as plain alerts, so a view
built before a feature landed still shows its events.

Stragglers: by default only confirmed verdicts (and their clearing) become alerts, because
those are what is worth acting on; suspects are the detector's early signal, which on a busy
machine also fires for slowdowns that pass. ``show_suspects=True`` shows them too (they are
always in ``job.alerts``, each with its level).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from nbtrain.core.jobevents import generation_of
from nbtrain.core.straggler import ratio_text

#: Events that happen on every normal start and end: counted, not shown as alerts.
_QUIET_KINDS = frozenset({"rank_started", "rank_finished", "steps"})


@dataclass
class Alert:
    """One line of the alerts panel."""

    time: float | None  # epoch seconds, None when the event carried no wall-clock time
    level: str  # "info" | "warn" | "error"
    kind: str
    text: str


@dataclass
class CheckpointState:
    """The checkpoint panel: the last committed checkpoint and the one in flight, if any."""

    committed_step: int | None = None
    committed_at: float | None = None
    bytes: int | None = None
    blocking_ms: float | None = None
    persist_ms: float | None = None
    commits: int = 0
    in_flight_step: int | None = None
    in_flight_phase: str | None = None  # "snapshot" | "persisted"
    last_error: str | None = None

    def describe(self, now: float) -> str:
        """A short plain-text summary (the HTML panel and the text mode use it)."""
        if self.committed_step is None:
            text = "no checkpoint committed yet"
        else:
            age = "" if self.committed_at is None else f", {format_age(now - self.committed_at)}"
            size = "" if self.bytes is None else f", {format_bytes(self.bytes)}"
            block = "" if self.blocking_ms is None else f", blocked {self.blocking_ms:.1f} ms"
            text = f"last committed step {self.committed_step}{age}{size}{block}"
        if self.in_flight_step is not None:
            text += f"; in flight: step {self.in_flight_step} ({self.in_flight_phase})"
        if self.last_error:
            text += f"; last failure: {self.last_error}"
        return text


@dataclass
class Straggler:
    rank: int
    phase: str
    state: str  # "suspect" | "confirmed"
    ratio: float | None  # None when the peers spend about no time in the phase
    since_step: int | None
    hint: str = ""


@dataclass
class EventLog:
    """Everything the views derive from non-step events. Feed with :meth:`add`."""

    max_alerts: int = 200
    show_suspects: bool = False
    """Also alert suspect stragglers (the early signal), not only confirmed ones."""
    alerts: deque[Alert] = field(default_factory=deque)
    checkpoint: CheckpointState = field(default_factory=CheckpointState)
    stragglers: dict[int, Straggler] = field(default_factory=dict)
    """Ranks shown as slow now (confirmed, or suspect with ``show_suspects``), one verdict
    each: a confirmed one before a suspect one."""
    _shown: dict[tuple[int, str], Straggler] = field(default_factory=dict, repr=False)
    restarts: int = 0
    failures: int = 0
    resizes: int = 0
    resized_generations: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    #: generation -> (kind, text): how it ended, when a fault or a preemption ended it
    ended_by: dict[int, tuple[str, str]] = field(default_factory=dict)
    goodput: float | None = None
    goodput_parts: dict[str, float] = field(default_factory=dict)
    #: The newest generation's ``memory`` events by rank (state bytes, strategy).
    memory: dict[int, dict[str, Any]] = field(default_factory=dict)
    memory_generation: int = -1
    events_seen: int = 0

    def add(self, event: dict[str, Any]) -> Alert | None:
        """Fold one event in; return the alert it raised, if any."""
        self.events_seen += 1
        kind = str(event.get("kind", "?"))
        when = event_time(event)
        handler = getattr(self, f"_on_{kind}", None)
        if kind in _QUIET_KINDS:
            return None
        alert = handler(event, when) if handler is not None else self._generic(kind, event, when)
        if alert is not None:
            self.alerts.append(alert)
            while len(self.alerts) > self.max_alerts:
                self.alerts.popleft()
        return alert

    def recent(self, n: int) -> list[Alert]:
        """The ``n`` newest alerts, newest first."""
        return list(reversed(list(self.alerts)[-n:]))

    # -- one method per event kind ----------------------------------------------------------
    def _on_state(self, ev: dict[str, Any], when: float | None) -> Alert:
        state = str(ev.get("state", "?"))
        level = {"FAILED": "error", "PREEMPTED": "warn", "CANCELLED": "warn"}.get(state, "info")
        return Alert(when, level, "state", f"{state}: {ev.get('reason', '')}")

    def _on_rank_failed(self, ev: dict[str, Any], when: float | None) -> Alert:
        self.failures += 1
        rank = ev.get("rank", "?")
        return Alert(when, "error", "rank_failed",
                     f"rank {rank} failed at step {ev.get('step', '?')} "
                     f"(generation {generation_of(ev, '?')}): {_first_line(ev.get('error'))}")

    def _on_checkpoint(self, ev: dict[str, Any], when: float | None) -> Alert | None:
        ck = self.checkpoint
        phase = str(ev.get("phase", "?"))
        step = _int_or_none(ev.get("step"))
        if phase == "committed":
            ck.committed_step = step
            ck.committed_at = when
            ck.commits += 1
            ck.bytes = _int_or_none(ev.get("bytes")) if ev.get("bytes") is not None else ck.bytes
            ck.blocking_ms = _float_or(ev.get("blocking_ms"), ck.blocking_ms)
            ck.persist_ms = _float_or(ev.get("persist_ms"), ck.persist_ms)
            if ck.in_flight_step is not None and (step is None or ck.in_flight_step <= step):
                ck.in_flight_step = ck.in_flight_phase = None
            return None
        if phase == "failed":
            ck.last_error = _first_line(ev.get("error")) or "unknown error"
            if ck.in_flight_step == step:
                ck.in_flight_step = ck.in_flight_phase = None
            stage = f" during {ev['stage']}" if ev.get("stage") else ""
            return Alert(when, "error", "checkpoint",
                         f"checkpoint of step {step} failed{stage}: {ck.last_error}")
        # snapshot / persisted: a checkpoint newer than the committed one is on its way
        if step is not None and (ck.committed_step is None or step > ck.committed_step):
            ck.in_flight_step = step
            ck.in_flight_phase = phase
            if ev.get("blocking_ms") is not None:
                ck.blocking_ms = _float_or(ev.get("blocking_ms"), ck.blocking_ms)
            if ev.get("bytes") is not None:
                ck.bytes = _int_or_none(ev.get("bytes"))
        return None

    def _on_straggler(self, ev: dict[str, Any], when: float | None) -> Alert | None:
        rank = int(ev.get("rank", -1))
        state = str(ev.get("state", "suspect"))
        phase = str(ev.get("phase", "step"))
        ratio = _float_or(ev.get("ratio"), None)
        if state == "cleared":
            if self._shown.pop((rank, phase), None) is None:
                return None  # an episode that was never shown ends quietly
            self._sync_stragglers()
            return Alert(when, "info", "straggler", f"rank {rank} is no longer slow ({phase})")
        if state == "suspect" and not self.show_suspects:
            return None
        since = _int_or_none(ev.get("since_step"))
        hint = str(ev.get("hint", "") or "")
        self._shown[rank, phase] = Straggler(rank, phase, state, ratio, since, hint)
        self._sync_stragglers()
        compared = ratio_text(ratio, _float_or(ev.get("peer_s"), None))
        excess = _float_or(ev.get("excess_s"), None)
        if ratio is None and excess is not None:  # the detector nulls a ratio that says nothing
            compared = f"+{excess * 1e3:.1f} ms/step ({compared})"
        since_txt = "" if since is None else f" since step {since}"
        hint_txt = f" — {hint}" if hint else ""
        return Alert(when, "warn", "straggler",
                     f"rank {rank} {state} straggler in {phase}: {compared}"
                     f"{since_txt}{hint_txt}")

    def _sync_stragglers(self) -> None:
        ordered = sorted(self._shown.values(), key=lambda s: (s.rank, s.state == "confirmed"))
        self.stragglers = {s.rank: s for s in ordered}  # the last one per rank wins

    def _on_mitigation(self, ev: dict[str, Any], when: float | None) -> Alert | None:
        if ev.get("action") == "alert":
            return None  # report-only policy: the straggler alert already says it
        return Alert(when, "warn", "mitigation",
                     f"{ev.get('action', '?')} rank {ev.get('rank', '?')}: "
                     f"{ev.get('reason', '')}")

    def _on_fault(self, ev: dict[str, Any], when: float | None) -> Alert:
        host = f" on {ev['host']}" if ev.get("host") else ""
        detect = (f", detected in {float(ev['detect_s']):.1f} s"
                  if ev.get("detect_s") is not None else "")
        cause = f": {ev['cause']}" if ev.get("cause") else ""
        gen = _int_or_none(ev.get("generation"))
        if gen is not None:
            self.ended_by[gen] = ("restart", f"restart after {ev.get('what', 'a fault')} on "
                                             f"rank {ev.get('rank', '?')}{cause}")
        return Alert(when, "error", "fault",
                     f"fault: {ev.get('what', '?')} rank {ev.get('rank', '?')}{host} at step "
                     f"{ev.get('step', '?')}{detect}{cause}")

    def _on_preemption(self, ev: dict[str, Any], when: float | None) -> Alert:
        gen = _int_or_none(ev.get("generation"))
        why = str(ev.get("reason") or ev.get("cause") or "preempted")
        if gen is not None:
            self.ended_by[gen] = ("resume", f"resumed after a preemption ({why})")
        forced = " (forced: grace ran out)" if ev.get("forced") else ""
        return Alert(when, "warn", "preemption",
                     f"preempted at step {ev.get('step', '?')}: {why}{forced}")

    def _on_uncommitted(self, ev: dict[str, Any], when: float | None) -> Alert:
        return Alert(when, "warn", "checkpoint", str(ev.get("reason") or "checkpoint lost"))

    def _on_slow(self, ev: dict[str, Any], when: float | None) -> Alert:
        return Alert(when, "warn", "slow", str(ev.get("note") or "slow steps"))

    def _on_tracker(self, ev: dict[str, Any], when: float | None) -> Alert:
        return Alert(when, "warn", "tracker", f"tracker: {ev.get('error', '?')}")

    def _on_nonfinite(self, ev: dict[str, Any], when: float | None) -> Alert:
        then = "; halting the job" if ev.get("halting") else ""
        return Alert(when, "error", "nonfinite",
                     f"rank {ev.get('rank', '?')} reported {ev.get('metric', '?')} = "
                     f"{ev.get('value', '?')} at step {ev.get('step', '?')}{then}")

    def _on_fault_injected(self, ev: dict[str, Any], when: float | None) -> Alert:
        raw = ev.get("fault")
        fault: dict[str, Any] = raw if isinstance(raw, dict) else {}
        kind = fault.get("kind", "?")
        slow = (f" x{float(fault['factor']):g}"
                if kind == "slow" and fault.get("factor") is not None else "")
        return Alert(when, "warn", "fault_injected",
                     f"injected {kind}{slow} into rank {fault.get('rank', ev.get('rank', '?'))}"
                     f" at step {ev.get('step', '?')}")

    def _on_recovery(self, ev: dict[str, Any], when: float | None) -> Alert:
        self.restarts += 1
        rec = ev.get("recovery_s")
        rec_txt = f" in {float(rec):.1f} s" if rec is not None else ""
        lost = ev.get("lost_steps")
        lost_txt = f", {lost} steps redone" if lost is not None else ""
        return Alert(when, "info", "recovery",
                     f"recovered: generation {ev.get('generation', '?')}{rec_txt}{lost_txt}")

    def _on_resize(self, ev: dict[str, Any], when: float | None) -> Alert | None:
        phase = str(ev.get("phase", "done"))
        old, new = ev.get("old", "?"), ev.get("new", "?")
        reason = f" ({ev['reason']})" if ev.get("reason") else ""
        if phase == "started":
            gen = _int_or_none(ev.get("generation"))
            if gen is not None:
                self.resized_generations[gen] = (old, new)
            return None  # "requested" and "done" say it
        if phase == "requested":
            return Alert(when, "info", "resize", f"resizing {old} -> {new} ranks at the next "
                                                 f"step boundary{reason}")
        if phase == "waiting":
            return Alert(when, "info", "resize", str(ev.get("reason") or
                                                     f"waiting to grow to {new} ranks"))
        self.resizes += 1
        took = ev.get("duration_s")
        took_txt = f" in {float(took):.1f} s" if took is not None else ""
        return Alert(when, "info", "resize", f"resized {old} -> {new} ranks{took_txt}")

    def _on_memory(self, ev: dict[str, Any], when: float | None) -> None:
        """A rank's state bytes after its generation's first step (no alert: a panel line)."""
        rank, gen = _int_or_none(ev.get("rank")), _int_or_none(generation_of(ev))
        if rank is None or gen is None or gen < self.memory_generation:
            return None
        if gen > self.memory_generation:
            self.memory, self.memory_generation = {}, gen
        self.memory[rank] = dict(ev)
        return None

    def describe_memory(self) -> str:
        """Per-rank parameter and optimizer-state bytes, e.g. ``state per rank (fsdp):
        r0 params 1.2 MB + optimizer 2.4 MB; r1 ...`` ("" before the first report)."""
        if not self.memory:
            return ""
        how = sorted({f"{m.get('strategy') or '?'}, {m.get('precision') or '?'}"
                      for m in self.memory.values()})
        parts = [f"r{r} params {format_bytes(int(m.get('params_bytes', 0)))} + optimizer "
                 f"{format_bytes(int(m.get('optimizer_bytes', 0)))}"
                 for r, m in sorted(self.memory.items())]
        if len(parts) > 8:
            parts = [*parts[:4], f"... {len(parts) - 6} more ...", *parts[-2:]]
        return f"state per rank ({'; '.join(how)}): " + "; ".join(parts)

    def _on_data(self, ev: dict[str, Any], when: float | None) -> Alert:
        """Where a generation's data starts: the global position, split over its ranks."""
        ranks = ev.get("world_size", "?")
        parts = [f"step {ev.get('step', '?')}: {ranks} rank{'' if ranks == 1 else 's'}"]
        if ev.get("global_batch_size") is not None:
            parts.append(f"global batch {ev['global_batch_size']}, continuing at sample "
                         f"{ev.get('cursor', '?')} of epoch {ev.get('epoch', '?')}")
        if ev.get("lr_rule"):
            parts.append(f"LR x{float(ev.get('lr_factor') or 1.0):.3g} ({ev['lr_rule']} rule, "
                         f"base {ev.get('lr_base_world_size')} ranks)")
        return Alert(when, "info", "data", "; ".join(parts))

    def _on_knobs(self, ev: dict[str, Any], when: float | None) -> Alert | None:
        """Rank 0's declarations: shown once per generation only when it has knobs of its
        own (the optimizer's built-ins are always there)."""
        own = [s.get("name") for s in ev.get("specs") or () if not s.get("builtin")]
        if not own:
            return None
        values = ev.get("values") or {}
        return Alert(when, "info", "knobs", "knobs: " + ", ".join(
            f"{n}={_num(values.get(n))}" for n in own))

    def _on_knob_set(self, ev: dict[str, Any], when: float | None) -> Alert:
        change = ev.get("change") or {}
        return Alert(when, "info", "knobs", f"knob change by {change.get('who') or '?'}: "
                     f"{_values(change)} (pending: every rank applies it at its next "
                     "agreement)")

    def _on_knob_applied(self, ev: dict[str, Any], when: float | None) -> Alert:
        step = ev.get("step", "?")
        parts = [f"{_values(c)} by {c.get('who') or '?'}" for c in ev.get("changes") or ()]
        return Alert(when, "info", "knobs", f"knobs applied at step {step} on every rank: "
                     + "; ".join(parts))

    def describe_generation(self, gen: int) -> tuple[str, str]:
        """What started generation ``gen`` (for the plots' marks): ("resize", "2→1 ranks"),
        ("restart", "restart after ...: <cause>") or ("resume", "resumed after ...")."""
        sizes = self.resized_generations.get(gen)
        if sizes is not None:
            return "resize", f"{sizes[0]}\u2192{sizes[1]} ranks"
        return self.ended_by.get(gen - 1, ("restart", f"generation {gen}"))

    def _on_goodput(self, ev: dict[str, Any], when: float | None) -> None:
        fraction = ev.get("fraction")
        if fraction is not None:
            self.goodput = float(fraction)
        self.goodput_parts = {k: float(v) for k, v in ev.items()
                              if k.endswith("_s") and isinstance(v, (int, float))}
        return None

    def _generic(self, kind: str, ev: dict[str, Any], when: float | None) -> Alert:
        skip = {"kind", "time", "rank", "generation", "gen"}
        detail = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in skip)
        rank = f"rank {ev['rank']}: " if "rank" in ev else ""
        return Alert(when, "info", kind, f"{kind}: {rank}{detail}")


def _num(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, int | float) else "?"


def _values(change: dict[str, Any]) -> str:
    """``lr=0.0003, aux_weight=0.2 over 100 steps (cosine)``."""
    text = ", ".join(f"{k}={_num(v)}" for k, v in (change.get("values") or {}).items())
    ramp = change.get("ramp")
    return text + (f" over {ramp} steps ({change.get('shape', 'linear')})" if ramp else "")


def event_time(event: dict[str, Any]) -> float | None:
    """The event's wall-clock time (epoch seconds), or None. Some producers stamp events with
    a monotonic clock; those values are not times of day and are not shown as such."""
    value = event.get("time")
    try:
        when = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return when if when > 1e9 else None


def format_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"  # pragma: no cover


def _first_line(value: object) -> str:
    text = "" if value is None else str(value)
    return text.strip().splitlines()[0] if text.strip() else ""


def _int_or_none(value: object) -> int | None:
    try:
        return None if value is None else int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def _float_or(value: object, default: float | None) -> float | None:
    try:
        return default if value is None else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default
