"""Job events as their readers see them: each dict parsed once into a typed record (pure).

:mod:`nbtrain.core.jobevents` says what producers write; the views, the report and the job
handle read events that crossed a wire, may come from an older or newer nbtrain, or be
malformed. :func:`parse_event` turns one into the record of its kind, read by attribute:
a field that is missing, ``None`` or of the wrong type reads as its default (``None`` for the
optional ones), so a reader never raises on someone else's event. An unknown kind parses
into the base :class:`EventRecord`, which keeps the dict (``raw``) for a generic line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

__all__ = [
    "CheckpointRecord",
    "DataRecord",
    "EventRecord",
    "FaultInjectedRecord",
    "FaultRecord",
    "GoodputRecord",
    "KnobAppliedRecord",
    "KnobSetRecord",
    "KnobsRecord",
    "MemoryRecord",
    "MitigationRecord",
    "NonFiniteRecord",
    "PreemptionRecord",
    "RankFailedRecord",
    "RecoveryRecord",
    "ResizeRecord",
    "SlowRecord",
    "StateRecord",
    "StragglerRecord",
    "TrackerRecord",
    "UncommittedRecord",
    "parse_event",
]


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return int(value)
    try:
        return None if value is None else int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return None


def _float(value: object) -> float | None:
    try:
        return None if value is None else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _str(value: object) -> str | None:
    return None if value is None else str(value)


def _dict(value: object) -> dict[str, Any] | None:
    return dict(value) if isinstance(value, Mapping) else None


def _dicts(value: object) -> tuple[dict[str, Any], ...] | None:
    if not isinstance(value, list | tuple):
        return None
    return tuple(dict(v) for v in value if isinstance(v, Mapping))


#: How a field of each annotation is read from an event's value (None: unreadable).
_READERS: dict[str, Callable[[object], Any]] = {
    "int": _int, "int | None": _int, "float": _float, "float | None": _float,
    "str": _str, "str | None": _str, "bool": bool,
    "dict[str, Any]": _dict, "dict[str, Any] | None": _dict,
    "tuple[dict[str, Any], ...]": _dicts,
}


@dataclass(frozen=True)
class EventRecord:
    """What every event has: ``kind``; ``time`` as sent (wall-clock seconds); a rank
    event's ``rank`` and ``generation`` (``gen`` in older records); and the dict itself
    (``raw``: for kinds without a record, and the few readers that list every field)."""

    kind: str = "?"
    time: float | None = None
    rank: int | None = None
    generation: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    KIND: ClassVar[str] = ""

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Self:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "raw":
                continue
            read = _READERS[str(f.type)]
            value = event.get(f.name)
            if value is None and f.name == "generation":
                value = event.get("gen")  # records written before the rename
            parsed = None if value is None else read(value)
            if parsed is not None:
                values[f.name] = parsed
        return cls(raw=event, **values)


@dataclass(frozen=True)
class StateRecord(EventRecord):
    KIND: ClassVar[str] = "state"
    state: str = "?"
    reason: str = ""


@dataclass(frozen=True)
class RankFailedRecord(EventRecord):
    KIND: ClassVar[str] = "rank_failed"
    step: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class CheckpointRecord(EventRecord):
    KIND: ClassVar[str] = "checkpoint"
    phase: str = "?"  # "snapshot" | "persisted" | "committed" | "failed" | "skipped"
    step: int | None = None
    bytes: int | None = None
    blocking_ms: float | None = None
    persist_ms: float | None = None
    error: str | None = None
    stage: str | None = None


@dataclass(frozen=True)
class StragglerRecord(EventRecord):
    KIND: ClassVar[str] = "straggler"
    rank: int | None = -1
    state: str = "suspect"  # "suspect" | "confirmed" | "cleared"
    phase: str = "step"
    ratio: float | None = None
    peer_s: float | None = None
    excess_s: float | None = None
    since_step: int | None = None
    hint: str = ""


@dataclass(frozen=True)
class MitigationRecord(EventRecord):
    KIND: ClassVar[str] = "mitigation"
    action: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class FaultRecord(EventRecord):
    KIND: ClassVar[str] = "fault"
    what: str | None = None
    cause: str | None = None
    host: str | None = None
    step: int | None = None
    detect_s: float | None = None


@dataclass(frozen=True)
class PreemptionRecord(EventRecord):
    KIND: ClassVar[str] = "preemption"
    cause: str | None = None
    reason: str | None = None
    generation: int | None = None
    step: int | None = None
    forced: bool = False


@dataclass(frozen=True)
class UncommittedRecord(EventRecord):
    KIND: ClassVar[str] = "uncommitted"
    reason: str | None = None


@dataclass(frozen=True)
class SlowRecord(EventRecord):
    KIND: ClassVar[str] = "slow"
    note: str | None = None


@dataclass(frozen=True)
class TrackerRecord(EventRecord):
    KIND: ClassVar[str] = "tracker"
    error: str | None = None


@dataclass(frozen=True)
class NonFiniteRecord(EventRecord):
    KIND: ClassVar[str] = "nonfinite"
    step: int | None = None
    metric: str | None = None
    value: str | None = None
    halting: bool = False


@dataclass(frozen=True)
class FaultInjectedRecord(EventRecord):
    KIND: ClassVar[str] = "fault_injected"
    step: int | None = None
    fault: dict[str, Any] | None = None

    @property
    def fault_kind(self) -> str | None:
        return None if self.fault is None else _str(self.fault.get("kind"))

    @property
    def factor(self) -> float | None:
        return None if self.fault is None else _float(self.fault.get("factor"))

    @property
    def target_rank(self) -> int | None:
        """The rank the fault names (the sending rank's own when it names none)."""
        named = None if self.fault is None else _int(self.fault.get("rank"))
        return self.rank if named is None else named


@dataclass(frozen=True)
class RecoveryRecord(EventRecord):
    KIND: ClassVar[str] = "recovery"
    generation: int | None = None
    recovery_s: float | None = None
    lost_steps: int | None = None


@dataclass(frozen=True)
class ResizeRecord(EventRecord):
    KIND: ClassVar[str] = "resize"
    phase: str = "done"  # "requested" | "waiting" | "started" | "done"
    old: int | None = None
    new: int | None = None
    reason: str | None = None
    generation: int | None = None
    duration_s: float | None = None


@dataclass(frozen=True)
class MemoryRecord(EventRecord):
    KIND: ClassVar[str] = "memory"
    params_bytes: int = 0
    optimizer_bytes: int = 0
    strategy: str | None = None
    precision: str | None = None


@dataclass(frozen=True)
class DataRecord(EventRecord):
    KIND: ClassVar[str] = "data"
    step: int | None = None
    world_size: int | None = None
    global_batch_size: int | None = None
    cursor: int | None = None
    epoch: int | None = None
    lr_rule: str | None = None
    lr_factor: float | None = None
    lr_base_world_size: int | None = None


@dataclass(frozen=True)
class KnobsRecord(EventRecord):
    KIND: ClassVar[str] = "knobs"
    specs: tuple[dict[str, Any], ...] = ()
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KnobSetRecord(EventRecord):
    KIND: ClassVar[str] = "knob_set"
    change: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KnobAppliedRecord(EventRecord):
    KIND: ClassVar[str] = "knob_applied"
    step: int | None = None
    changes: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class GoodputRecord(EventRecord):
    KIND: ClassVar[str] = "goodput"
    fraction: float | None = None

    @property
    def parts(self) -> dict[str, float]:
        """The ``*_s`` figures (seconds per part)."""
        return {k: float(v) for k, v in self.raw.items()
                if k.endswith("_s") and isinstance(v, int | float)}


_RECORDS: dict[str, type[EventRecord]] = {
    cls.KIND: cls for cls in (
        StateRecord, RankFailedRecord, CheckpointRecord, StragglerRecord, MitigationRecord,
        FaultRecord, PreemptionRecord, UncommittedRecord, SlowRecord, TrackerRecord,
        NonFiniteRecord, FaultInjectedRecord, RecoveryRecord, ResizeRecord, MemoryRecord,
        DataRecord, KnobsRecord, KnobSetRecord, KnobAppliedRecord, GoodputRecord)}


def parse_event(event: Mapping[str, Any]) -> EventRecord:
    """``event`` as the record of its kind (:class:`EventRecord` for an unknown kind);
    never raises on a bad value."""
    kind = event.get("kind", "?")
    record = _RECORDS.get(str(kind), EventRecord).from_event(event)
    return record if record.kind == str(kind) else dataclasses.replace(record, kind=str(kind))
