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

from nbtrain.core.eventrecords import (
    CheckpointRecord,
    DataRecord,
    EventRecord,
    FaultInjectedRecord,
    FaultRecord,
    GoodputRecord,
    KnobAppliedRecord,
    KnobSetRecord,
    KnobsRecord,
    MemoryRecord,
    MitigationRecord,
    NonFiniteRecord,
    PreemptionRecord,
    RankFailedRecord,
    RecoveryRecord,
    ResizeRecord,
    SlowRecord,
    StateRecord,
    StragglerRecord,
    TrackerRecord,
    UncommittedRecord,
    parse_event,
)
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
        if kind in _QUIET_KINDS:
            return None
        ev = parse_event(event)
        when = event_time(event)
        handler = getattr(self, f"_on_{kind}", None)
        alert = handler(ev, when) if handler is not None else self._generic(ev, when)
        if alert is not None:
            self.alerts.append(alert)
            while len(self.alerts) > self.max_alerts:
                self.alerts.popleft()
        return alert

    def recent(self, n: int) -> list[Alert]:
        """The ``n`` newest alerts, newest first."""
        return list(reversed(list(self.alerts)[-n:]))

    # -- one method per event kind (each reads its kind's record, core.eventrecords) ------
    def _on_state(self, ev: StateRecord, when: float | None) -> Alert:
        level = {"FAILED": "error", "PREEMPTED": "warn", "CANCELLED": "warn"}.get(ev.state,
                                                                                  "info")
        return Alert(when, level, "state", f"{ev.state}: {ev.reason}")

    def _on_rank_failed(self, ev: RankFailedRecord, when: float | None) -> Alert:
        self.failures += 1
        return Alert(when, "error", "rank_failed",
                     f"rank {_q(ev.rank)} failed at step {_q(ev.step)} "
                     f"(generation {_q(ev.generation)}): {_first_line(ev.error)}")

    def _on_checkpoint(self, ev: CheckpointRecord, when: float | None) -> Alert | None:
        ck = self.checkpoint
        step = ev.step
        if ev.phase == "committed":
            ck.committed_step = step
            ck.committed_at = when
            ck.commits += 1
            ck.bytes = ev.bytes if ev.bytes is not None else ck.bytes
            ck.blocking_ms = _or(ev.blocking_ms, ck.blocking_ms)
            ck.persist_ms = _or(ev.persist_ms, ck.persist_ms)
            if ck.in_flight_step is not None and (step is None or ck.in_flight_step <= step):
                ck.in_flight_step = ck.in_flight_phase = None
            return None
        if ev.phase == "failed":
            ck.last_error = _first_line(ev.error) or "unknown error"
            if ck.in_flight_step == step:
                ck.in_flight_step = ck.in_flight_phase = None
            stage = f" during {ev.stage}" if ev.stage else ""
            return Alert(when, "error", "checkpoint",
                         f"checkpoint of step {step} failed{stage}: {ck.last_error}")
        # snapshot / persisted: a checkpoint newer than the committed one is on its way
        if step is not None and (ck.committed_step is None or step > ck.committed_step):
            ck.in_flight_step = step
            ck.in_flight_phase = ev.phase
            ck.blocking_ms = _or(ev.blocking_ms, ck.blocking_ms)
            if ev.bytes is not None:
                ck.bytes = ev.bytes
        return None

    def _on_straggler(self, ev: StragglerRecord, when: float | None) -> Alert | None:
        rank = -1 if ev.rank is None else ev.rank
        state, phase, ratio = ev.state, ev.phase, ev.ratio
        if state == "cleared":
            if self._shown.pop((rank, phase), None) is None:
                return None  # an episode that was never shown ends quietly
            self._sync_stragglers()
            return Alert(when, "info", "straggler", f"rank {rank} is no longer slow ({phase})")
        if state == "suspect" and not self.show_suspects:
            return None
        since = ev.since_step
        self._shown[rank, phase] = Straggler(rank, phase, state, ratio, since, ev.hint)
        self._sync_stragglers()
        compared = ratio_text(ratio, ev.peer_s)
        if ratio is None and ev.excess_s is not None:  # the detector nulls a useless ratio
            compared = f"+{ev.excess_s * 1e3:.1f} ms/step ({compared})"
        since_txt = "" if since is None else f" since step {since}"
        hint_txt = f" — {ev.hint}" if ev.hint else ""
        return Alert(when, "warn", "straggler",
                     f"rank {rank} {state} straggler in {phase}: {compared}"
                     f"{since_txt}{hint_txt}")

    def _sync_stragglers(self) -> None:
        ordered = sorted(self._shown.values(), key=lambda s: (s.rank, s.state == "confirmed"))
        self.stragglers = {s.rank: s for s in ordered}  # the last one per rank wins

    def _on_mitigation(self, ev: MitigationRecord, when: float | None) -> Alert | None:
        if ev.action == "alert":
            return None  # report-only policy: the straggler alert already says it
        return Alert(when, "warn", "mitigation",
                     f"{_q(ev.action)} rank {_q(ev.rank)}: {ev.reason}")

    def _on_fault(self, ev: FaultRecord, when: float | None) -> Alert:
        host = f" on {ev.host}" if ev.host else ""
        detect = f", detected in {ev.detect_s:.1f} s" if ev.detect_s is not None else ""
        cause = f": {ev.cause}" if ev.cause else ""
        if ev.generation is not None:
            what = "a fault" if ev.what is None else ev.what
            self.ended_by[ev.generation] = (
                "restart", f"restart after {what} on rank {_q(ev.rank)}{cause}")
        return Alert(when, "error", "fault",
                     f"fault: {_q(ev.what)} rank {_q(ev.rank)}{host} at step "
                     f"{_q(ev.step)}{detect}{cause}")

    def _on_preemption(self, ev: PreemptionRecord, when: float | None) -> Alert:
        why = str(ev.reason or ev.cause or "preempted")
        if ev.generation is not None:
            self.ended_by[ev.generation] = ("resume", f"resumed after a preemption ({why})")
        forced = " (forced: grace ran out)" if ev.forced else ""
        return Alert(when, "warn", "preemption",
                     f"preempted at step {_q(ev.step)}: {why}{forced}")

    def _on_uncommitted(self, ev: UncommittedRecord, when: float | None) -> Alert:
        return Alert(when, "warn", "checkpoint", ev.reason or "checkpoint lost")

    def _on_slow(self, ev: SlowRecord, when: float | None) -> Alert:
        return Alert(when, "warn", "slow", ev.note or "slow steps")

    def _on_tracker(self, ev: TrackerRecord, when: float | None) -> Alert:
        return Alert(when, "warn", "tracker", f"tracker: {_q(ev.error)}")

    def _on_nonfinite(self, ev: NonFiniteRecord, when: float | None) -> Alert:
        then = "; halting the job" if ev.halting else ""
        return Alert(when, "error", "nonfinite",
                     f"rank {_q(ev.rank)} reported {_q(ev.metric)} = "
                     f"{_q(ev.value)} at step {_q(ev.step)}{then}")

    def _on_fault_injected(self, ev: FaultInjectedRecord, when: float | None) -> Alert:
        kind = _q(ev.fault_kind)
        slow = f" x{ev.factor:g}" if kind == "slow" and ev.factor is not None else ""
        return Alert(when, "warn", "fault_injected",
                     f"injected {kind}{slow} into rank {_q(ev.target_rank)}"
                     f" at step {_q(ev.step)}")

    def _on_recovery(self, ev: RecoveryRecord, when: float | None) -> Alert:
        self.restarts += 1
        rec_txt = f" in {ev.recovery_s:.1f} s" if ev.recovery_s is not None else ""
        lost_txt = f", {ev.lost_steps} steps redone" if ev.lost_steps is not None else ""
        return Alert(when, "info", "recovery",
                     f"recovered: generation {_q(ev.generation)}{rec_txt}{lost_txt}")

    def _on_resize(self, ev: ResizeRecord, when: float | None) -> Alert | None:
        old, new = _q(ev.old), _q(ev.new)
        reason = f" ({ev.reason})" if ev.reason else ""
        if ev.phase == "started":
            if ev.generation is not None:
                self.resized_generations[ev.generation] = (old, new)
            return None  # "requested" and "done" say it
        if ev.phase == "requested":
            return Alert(when, "info", "resize", f"resizing {old} -> {new} ranks at the next "
                                                 f"step boundary{reason}")
        if ev.phase == "waiting":
            return Alert(when, "info", "resize", ev.reason or f"waiting to grow to {new} ranks")
        self.resizes += 1
        took = f" in {ev.duration_s:.1f} s" if ev.duration_s is not None else ""
        return Alert(when, "info", "resize", f"resized {old} -> {new} ranks{took}")

    def _on_memory(self, ev: MemoryRecord, when: float | None) -> None:
        """A rank's state bytes after its generation's first step (no alert: a panel line)."""
        rank, gen = ev.rank, ev.generation
        if rank is None or gen is None or gen < self.memory_generation:
            return None
        if gen > self.memory_generation:
            self.memory, self.memory_generation = {}, gen
        self.memory[rank] = dict(ev.raw)
        return None

    def describe_memory(self) -> str:
        """Per-rank parameter and optimizer-state bytes, e.g. ``state per rank (fsdp):
        r0 params 1.2 MB + optimizer 2.4 MB; r1 ...`` ("" before the first report)."""
        if not self.memory:
            return ""
        records = {r: MemoryRecord.from_event(m) for r, m in self.memory.items()}
        how = sorted({f"{m.strategy or '?'}, {m.precision or '?'}" for m in records.values()})
        parts = [f"r{r} params {format_bytes(m.params_bytes)} + optimizer "
                 f"{format_bytes(m.optimizer_bytes)}" for r, m in sorted(records.items())]
        if len(parts) > 8:
            parts = [*parts[:4], f"... {len(parts) - 6} more ...", *parts[-2:]]
        return f"state per rank ({'; '.join(how)}): " + "; ".join(parts)

    def _on_data(self, ev: DataRecord, when: float | None) -> Alert:
        """Where a generation's data starts: the global position, split over its ranks."""
        ranks = _q(ev.world_size)
        parts = [f"step {_q(ev.step)}: {ranks} rank{'' if ranks == 1 else 's'}"]
        if ev.global_batch_size is not None:
            parts.append(f"global batch {ev.global_batch_size}, continuing at sample "
                         f"{_q(ev.cursor)} of epoch {_q(ev.epoch)}")
        if ev.lr_rule:
            parts.append(f"LR x{ev.lr_factor or 1.0:.3g} ({ev.lr_rule} rule, "
                         f"base {ev.lr_base_world_size} ranks)")
        return Alert(when, "info", "data", "; ".join(parts))

    def _on_knobs(self, ev: KnobsRecord, when: float | None) -> Alert | None:
        """Rank 0's declarations: shown once per generation only when it has knobs of its
        own (the optimizer's built-ins are always there)."""
        own = [s.get("name") for s in ev.specs if not s.get("builtin")]
        if not own:
            return None
        return Alert(when, "info", "knobs", "knobs: " + ", ".join(
            f"{n}={_num(ev.values.get(str(n)))}" for n in own))

    def _on_knob_set(self, ev: KnobSetRecord, when: float | None) -> Alert:
        change = ev.change
        return Alert(when, "info", "knobs", f"knob change by {change.get('who') or '?'}: "
                     f"{_values(change)} (pending: every rank applies it at its next "
                     "agreement)")

    def _on_knob_applied(self, ev: KnobAppliedRecord, when: float | None) -> Alert:
        parts = [f"{_values(c)} by {c.get('who') or '?'}" for c in ev.changes]
        return Alert(when, "info", "knobs", f"knobs applied at step {_q(ev.step)} on every "
                     "rank: " + "; ".join(parts))

    def describe_generation(self, gen: int) -> tuple[str, str]:
        """What started generation ``gen`` (for the plots' marks): ("resize", "2→1 ranks"),
        ("restart", "restart after ...: <cause>") or ("resume", "resumed after ...")."""
        sizes = self.resized_generations.get(gen)
        if sizes is not None:
            return "resize", f"{sizes[0]}\u2192{sizes[1]} ranks"
        return self.ended_by.get(gen - 1, ("restart", f"generation {gen}"))

    def _on_goodput(self, ev: GoodputRecord, when: float | None) -> None:
        if ev.fraction is not None:
            self.goodput = ev.fraction
        self.goodput_parts = ev.parts
        return None

    def _generic(self, ev: EventRecord, when: float | None) -> Alert:
        skip = {"kind", "time", "rank", "generation", "gen"}
        detail = ", ".join(f"{k}={v}" for k, v in ev.raw.items() if k not in skip)
        rank = f"rank {ev.raw['rank']}: " if "rank" in ev.raw else ""
        return Alert(when, "info", ev.kind, f"{ev.kind}: {rank}{detail}")


def _q(value: object) -> object:
    """A field as shown: "?" when the event did not say."""
    return "?" if value is None else value


def _or(value: float | None, default: float | None) -> float | None:
    return default if value is None else value


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
