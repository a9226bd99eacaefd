"""The one schema of job events: what ranks and the controller say about a job (pure).

Events travel as plain dicts (msgpack on Dask's wire, JSON in reports), so they are typed here
as ``TypedDict``s, one per ``kind``, and built only through the constructors below. Every
event has ``kind`` and ``time`` (wall-clock seconds, for people; durations use monotonic
clocks). Rank events also carry ``job``, ``rank`` and ``generation``; records written before
that name was used everywhere say ``gen``, and readers take either (:func:`generation_of`).

Producers: the rank runtime (``rank_started``, ``checkpoint``, ``fault_injected``,
``rank_failed``, ``rank_finished``, the ``steps`` batches and the ``log`` batches of its
output) and the job machine
(:mod:`nbtrain.core.lifecycle`: ``state``, ``fault``, ``recovery``, ``preemption``,
``straggler``, ``mitigation``, ``nonfinite``, ``resize``, ``slow``). Consumers: the job
handle, the views, the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

__all__ = [
    "CONTROLLER_KINDS",
    "RANK_KINDS",
    "SHELL_KINDS",
    "FaultEvent",
    "KnobAppliedEvent",
    "KnobSetEvent",
    "KnobsEvent",
    "NonFiniteEvent",
    "PreemptionEvent",
    "RecoveryEvent",
    "ResizeEvent",
    "SlowEvent",
    "StateEvent",
    "TrackerEvent",
    "UncommittedEvent",
    "fault_event",
    "generation_of",
    "knob_applied_event",
    "knob_set_event",
    "knobs_event",
    "nonfinite_event",
    "preemption_event",
    "recovery_event",
    "renamed_fields",
    "resize_event",
    "slow_event",
    "state_event",
    "tracker_event",
    "uncommitted_event",
]

#: Kinds the rank runtime emits (``steps`` carries step rows, see ``core.records``; ``device``
#: a GPU's NVML readings, kept for straggler verdicts and not logged; ``memory`` a rank's
#: parameter, gradient and optimizer-state bytes after a generation's first step;
#: ``gradnoise`` rank 0's gradient noise scale estimate, for goodput sizing, not logged).
RANK_KINDS = ("steps", "device", "rank_started", "checkpoint", "fault_injected", "rank_failed",
              "rank_finished", "log", "data", "phase", "memory", "knobs", "knob_applied",
              "gradnoise")
#: Kinds the job machine emits.
CONTROLLER_KINDS = ("state", "fault", "recovery", "preemption", "straggler", "mitigation",
                    "nonfinite", "resize", "slow", "uncommitted", "knob_set")
#: Kinds the controller's shell adds to a job's log (a tracker that cannot write).
SHELL_KINDS = ("tracker",)


class StateEvent(TypedDict):
    kind: Literal["state"]
    time: float
    state: str  # a JobState value
    reason: str


class FaultEvent(TypedDict):
    """One fault that ended a generation. ``detect_s``: from the fault (its injection, the
    rank's own raise, the last progress of a hang) to its detection; ``recovery_s`` (set by a
    later ``recovery`` event): from detection to the next generation's first step."""

    kind: Literal["fault"]
    time: float
    what: str  # "worker died" | "exception" | "hang" | "lost slot"
    cause: str  # one line a person reads: what happened, with the evidence
    rank: int | None
    host: str | None
    step: int
    error: str
    generation: int
    detect_s: float | None
    lost_steps: int | None
    resume_step: int | None


class RecoveryEvent(TypedDict):
    kind: Literal["recovery"]
    time: float
    generation: int
    recovery_s: float | None
    resumed_step: int | None
    lost_steps: int | None
    fault: str | None


class PreemptionEvent(TypedDict):
    """A generation ended to free slots: for another job, by the user, for a straggler's
    replacement. ``forced``: the ranks did not release within the grace period and were
    stopped, losing the steps after the last committed checkpoint (``lost_steps``)."""

    kind: Literal["preemption"]
    time: float
    cause: str  # "user" | "scheduler" | "replace"
    reason: str
    for_job: str | None
    generation: int  # the generation that ended
    step: int  # the step it resumes from
    forced: bool
    lost_steps: int


class UncommittedEvent(TypedDict):
    """A preemption's or resize's final checkpoint did not commit: the job goes on from its
    last committed checkpoint (``step``), losing ``lost_steps``; no restart is charged."""

    kind: Literal["uncommitted"]
    time: float
    cause: str  # the preemption's cause: "user" | "scheduler" | "replace" | "resize"
    generation: int  # the generation that ended
    step: int  # the step it resumes from
    lost_steps: int
    error: str  # why the checkpoint did not commit, as the committing rank saw it
    reason: str


class NonFiniteEvent(TypedDict):
    """A rank reported a NaN or infinite metric (the first time in this generation)."""

    kind: Literal["nonfinite"]
    time: float
    rank: int
    step: int
    metric: str
    value: str  # "nan", "inf" or "-inf" (JSON has no such numbers)
    generation: int
    halting: bool


def nonfinite_event(time: float, *, rank: int, step: int, metric: str, value: float,
                    generation: int, halting: bool) -> NonFiniteEvent:
    return {"kind": "nonfinite", "time": time, "rank": rank, "step": step, "metric": metric,
            "value": str(value), "generation": generation, "halting": halting}


class ResizeEvent(TypedDict):
    """An elastic job changing size. ``phase``: "requested" (decided, the generation ends at
    the next step boundary), "waiting" (a bigger size asked for, waiting for enough free slots
    at once), "started" (the next generation launched at the new size), "done" (its first
    step; ``duration_s`` since "requested")."""

    kind: Literal["resize"]
    time: float
    phase: str
    old: int
    new: int
    reason: str
    generation: int
    duration_s: float | None


def resize_event(time: float, *, phase: str, old: int, new: int, reason: str, generation: int,
                 duration_s: float | None = None) -> ResizeEvent:
    return {"kind": "resize", "time": time, "phase": phase, "old": old, "new": new,
            "reason": reason, "generation": generation, "duration_s": duration_s}


class SlowEvent(TypedDict):
    """A silent generation whose ranks' call stacks moved: slow, not hung (said once per look
    of the hang watchdog)."""

    kind: Literal["slow"]
    time: float
    generation: int
    silent_s: float  # seconds without a step row, rounded to ms
    limit_s: float  # the watchdog's limit
    note: str


def slow_event(time: float, *, generation: int, silent_s: float, limit_s: float) -> SlowEvent:
    return {"kind": "slow", "time": time, "generation": generation,
            "silent_s": round(silent_s, 3), "limit_s": limit_s,
            "note": f"no step for {silent_s:.1f} s (limit {limit_s:.1f} s), but the ranks are "
                    "moving: slow, not hung"}


def state_event(time: float, state: str, reason: str) -> StateEvent:
    return {"kind": "state", "time": time, "state": state, "reason": reason}


class TrackerEvent(TypedDict):
    """A tracker (TensorBoard, MLflow) could not write; the job goes on. Sent from the
    tracker's thread, without a time (the log keeps it in order)."""

    kind: Literal["tracker"]
    error: str


def tracker_event(error: str) -> TrackerEvent:
    return {"kind": "tracker", "error": error}


def fault_event(time: float, *, what: str, cause: str, rank: int | None, host: str | None,
                step: int, error: str, generation: int, detect_s: float | None
                ) -> FaultEvent:
    return {"kind": "fault", "time": time, "what": what, "cause": cause, "rank": rank,
            "host": host, "step": step, "error": error, "generation": generation,
            "detect_s": detect_s, "lost_steps": None, "resume_step": None}


def recovery_event(time: float, *, generation: int, recovery_s: float | None,
                   resumed_step: int | None, lost_steps: int | None,
                   fault: str | None) -> RecoveryEvent:
    return {"kind": "recovery", "time": time, "generation": generation,
            "recovery_s": recovery_s, "resumed_step": resumed_step, "lost_steps": lost_steps,
            "fault": fault}


def preemption_event(time: float, *, cause: str, reason: str, for_job: str | None,
                     generation: int, step: int, forced: bool, lost_steps: int
                     ) -> PreemptionEvent:
    return {"kind": "preemption", "time": time, "cause": cause, "reason": reason,
            "for_job": for_job, "generation": generation, "step": step, "forced": forced,
            "lost_steps": lost_steps}


def uncommitted_event(time: float, *, cause: str, generation: int, step: int,
                      lost_steps: int, error: str) -> UncommittedEvent:
    reason = (f"the {cause} checkpoint did not commit ({error}); resuming from step {step}, "
              f"{lost_steps} uncommitted steps lost, no restart charged")
    return {"kind": "uncommitted", "time": time, "cause": cause, "generation": generation,
            "step": step, "lost_steps": lost_steps, "error": error, "reason": reason}


class KnobsEvent(TypedDict):
    """Rank 0's declared knobs (``core.knobs.KnobSpec.to_dict()``) and the values in force
    when its loop started at ``step``."""

    kind: Literal["knobs"]
    time: float
    specs: list[dict[str, Any]]
    values: dict[str, float]
    step: int
    history: list[dict[str, Any]]  # the applied changes the generation started with


class KnobSetEvent(TypedDict):
    """A change the controller accepted (``core.knobs.KnobChange.to_dict()``, pending)."""

    kind: Literal["knob_set"]
    time: float
    change: dict[str, Any]


class KnobAppliedEvent(TypedDict):
    """Every rank applied these pending changes at ``step`` (in force from ``step + 1``);
    ``values``: what is in force then."""

    kind: Literal["knob_applied"]
    time: float
    step: int
    changes: list[dict[str, Any]]
    values: dict[str, float]


def knobs_event(time: float, *, specs: list[dict[str, Any]], values: dict[str, float],
                step: int, history: list[dict[str, Any]]) -> KnobsEvent:
    return {"kind": "knobs", "time": time, "specs": specs, "values": values, "step": step,
            "history": history}


def knob_set_event(time: float, change: dict[str, Any]) -> KnobSetEvent:
    return {"kind": "knob_set", "time": time, "change": change}


def knob_applied_event(time: float, *, step: int, changes: list[dict[str, Any]],
                       values: dict[str, float]) -> KnobAppliedEvent:
    return {"kind": "knob_applied", "time": time, "step": step, "changes": changes,
            "values": values}


def rank_event(kind: str, *, job: str, rank: int, generation: int, time: float,
               **info: Any) -> dict[str, Any]:
    """A rank runtime event (one of ``RANK_KINDS``), as sent over Dask's event plane."""
    if kind not in RANK_KINDS:
        raise ValueError(f"unknown rank event kind {kind!r}; one of {', '.join(RANK_KINDS)}")
    return {"kind": kind, "job": job, "rank": rank, "generation": generation, "time": time,
            **info}


def generation_of(record: Mapping[str, Any], default: Any = None) -> Any:
    """The generation a rank event or output line names: ``generation``, or ``gen`` in a
    record written before (a journal, a run record on disk, a rank of an older version)."""
    value = record.get("generation", default)
    return record.get("gen", default) if value is default else value


def renamed_fields(record: Any) -> Any:
    """A record as written before ``gen`` was renamed ``generation`` (a rank event or an
    output line in a journal or run record on disk), in today's names; anything else as
    it is."""
    if not isinstance(record, dict) or "gen" not in record or "generation" in record:
        return record
    return {("generation" if k == "gen" else k): v for k, v in record.items()}
