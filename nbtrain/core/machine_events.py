"""The job machine's typed events for users' requests and ranks' messages (pure).

Requests arrive from clients as ``(what, arg)`` and rank messages as dicts dispatched on their
``kind``; the shell turns each into one of the frozen events below **once, at the boundary**
(:func:`request_from_wire`, :func:`rank_from_wire`), and the machine dispatches on their type
(dask's ``StateMachineEvent`` habit): no string switches inside it.

A wire form that is no machine event raises: :class:`UnknownKind` (a ``ValueError``) for a
request or rank message kind nobody defined, ``TypeError`` or ``ValueError`` naming the field
for a field the machine could not read. What the values mean (a knob's bounds, a fault's rank,
detector settings) is still judged by their owners inside the machine, which refuses with a
``Rejected`` command.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nbtrain.core.faults import Fault
from nbtrain.core.jobevents import generation_of

__all__ = [
    "REQUEST_KINDS",
    "CheckpointRequested",
    "FaultInjectionRequested",
    "KnobChangeRequested",
    "PreemptRequested",
    "RankCheckpoint",
    "RankData",
    "RankDevice",
    "RankEvent",
    "RankFailed",
    "RankFaultInjected",
    "RankFinished",
    "RankGradNoise",
    "RankKnobApplied",
    "RankKnobs",
    "RankMemory",
    "RankPhase",
    "RankStarted",
    "RankSteps",
    "ResumeRequested",
    "SizeRequested",
    "StopRequested",
    "StragglerTuningRequested",
    "UnknownKind",
    "UserRequest",
    "rank_from_wire",
    "request_from_wire",
]


class UnknownKind(ValueError):
    """A request or rank message of a kind no machine event stands for."""


# ==================================================================================== requests
@dataclass(frozen=True)
class UserRequest:
    """A user's request on one job (its ownership was checked by the shell)."""

    #: The request's name on the wire (``job.request(what)``).
    what: ClassVar[str] = ""
    now: float
    wall: float
    job_id: str


@dataclass(frozen=True)
class StopRequested(UserRequest):
    """End the job: at the next step boundary, without a final checkpoint's wait."""

    what: ClassVar[str] = "stop"


@dataclass(frozen=True)
class PreemptRequested(UserRequest):
    """Checkpoint, release the slots, stay PREEMPTED until ``resume``."""

    what: ClassVar[str] = "preempt"


@dataclass(frozen=True)
class ResumeRequested(UserRequest):
    """Queue a job its user preempted again."""

    what: ClassVar[str] = "resume"


@dataclass(frozen=True)
class CheckpointRequested(UserRequest):
    """Checkpoint at the ranks' next agreement."""

    what: ClassVar[str] = "checkpoint"


@dataclass(frozen=True)
class FaultInjectionRequested(UserRequest):
    """Plan ``fault`` (delivered now when a generation runs); its rank is judged by the
    machine."""

    what: ClassVar[str] = "inject"
    fault: Fault


@dataclass(frozen=True)
class StragglerTuningRequested(UserRequest):
    """Change these straggler detector settings (names and values judged by the machine)."""

    what: ClassVar[str] = "stragglers"
    changes: Mapping[str, Any]


@dataclass(frozen=True)
class SizeRequested(UserRequest):
    """Run an elastic job with ``size`` ranks; ``wait_for_workers``: also above the slots the
    cluster has now."""

    what: ClassVar[str] = "resize"
    size: int
    wait_for_workers: bool = False


@dataclass(frozen=True)
class KnobChangeRequested(UserRequest):
    """``job.set(...)``: new values for live knobs, reached over ``ramp`` steps along
    ``shape``; ``who`` asked (set by the controller). Judged by the job's ``KnobBook``."""

    what: ClassVar[str] = "set"
    values: Mapping[str, Any]
    ramp: int = 0
    shape: str = "linear"
    who: str = ""


_REQUESTS: tuple[type[UserRequest], ...] = (
    StopRequested, PreemptRequested, ResumeRequested, CheckpointRequested,
    FaultInjectionRequested, StragglerTuningRequested, SizeRequested, KnobChangeRequested)
_REQUEST_TYPES = {t.what: t for t in _REQUESTS}
#: The requests a job's owner (or the operator) may make, by their wire names.
REQUEST_KINDS = tuple(_REQUEST_TYPES)


def request_from_wire(now: float, wall: float, job_id: str, what: str,
                      arg: Any = None) -> UserRequest:
    """The typed request for ``what`` with its argument as a client sent it; ``UnknownKind``
    for a request nobody defined, ``TypeError``/``ValueError`` naming a field it cannot read."""
    kind = _REQUEST_TYPES.get(what) if isinstance(what, str) else None
    if kind is None:
        raise UnknownKind(f"unknown request {what!r}; one of {', '.join(REQUEST_KINDS)}")
    if kind is FaultInjectionRequested:
        if isinstance(arg, Fault):
            return FaultInjectionRequested(now, wall, job_id, arg)
        if not isinstance(arg, Mapping):
            raise TypeError(f"inject needs a fault as a mapping (Fault.to_dict()), got "
                            f"{type(arg).__name__}")
        return FaultInjectionRequested(now, wall, job_id, Fault.from_dict(dict(arg)))
    if kind is StragglerTuningRequested:
        if not isinstance(arg, Mapping):
            raise ValueError("straggler settings must be a mapping of setting names to "
                             f"values, e.g. {{'window': 16}}; got {type(arg).__name__}")
        return StragglerTuningRequested(now, wall, job_id, dict(arg))
    if kind is SizeRequested:
        return _size(now, wall, job_id, arg)
    if kind is KnobChangeRequested:
        return _knob_change(now, wall, job_id, arg)
    return kind(now, wall, job_id)


def _size(now: float, wall: float, job_id: str, arg: Any) -> SizeRequested:
    size = arg.get("size") if isinstance(arg, Mapping) else None
    if not isinstance(size, int) or isinstance(size, bool):
        raise TypeError(f"resize(n): n must be an integer number of ranks, got {size!r}")
    return SizeRequested(now, wall, job_id, size, bool(arg.get("wait_for_workers")))


def _knob_change(now: float, wall: float, job_id: str, arg: Any) -> KnobChangeRequested:
    if not isinstance(arg, Mapping):
        raise ValueError(f"a knob change is a mapping with 'values', got {type(arg).__name__}")
    ramp, shape = arg.get("ramp", 0), arg.get("shape", "linear")
    if isinstance(ramp, bool) or not isinstance(ramp, int):
        raise TypeError(f"ramp must be a whole number of steps, got {ramp!r}")
    if not isinstance(shape, str):
        raise TypeError(f"shape must be the name of a ramp's shape, got {shape!r}")
    values = arg.get("values")
    # Values that are no mapping name no knob: the job's KnobBook refuses the change, naming
    # the knobs the job declares (as it does for an empty one).
    return KnobChangeRequested(now, wall, job_id, dict(values) if isinstance(values, Mapping)
                               else {}, ramp, shape, str(arg.get("who", "")))


# =============================================================================== rank messages
@dataclass(frozen=True)
class RankEvent:
    """A message from rank ``rank`` of ``generation`` of a job. ``record``: the message as
    the rank sent it, what the job's log keeps of those it keeps (``generation`` so named)."""

    kind: ClassVar[str] = ""
    now: float
    wall: float
    job_id: str
    generation: int
    rank: int
    record: Mapping[str, Any] = field(default_factory=dict, kw_only=True, repr=False)

    def logged(self) -> dict[str, Any]:
        """The event for the job's log."""
        return dict(self.record) or {"kind": self.kind, "job": self.job_id, "rank": self.rank,
                                     "generation": self.generation, "time": self.wall}


@dataclass(frozen=True, kw_only=True)
class RankSteps(RankEvent):
    """Step rows (``core.records.ROW_COLUMNS``, then the metrics dict), oldest first."""

    kind: ClassVar[str] = "steps"
    rows: Sequence[Sequence[Any]]


@dataclass(frozen=True, kw_only=True)
class RankPhase(RankEvent):
    """The rank entered a startup phase (``setup``, ``restore``; for the startup watchdog)."""

    kind: ClassVar[str] = "phase"
    phase: str


@dataclass(frozen=True, kw_only=True)
class RankDevice(RankEvent):
    """The rank's GPU readings (NVML), kept for straggler verdicts."""

    kind: ClassVar[str] = "device"
    readings: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class RankStarted(RankEvent):
    """The rank restored and starts its first step, ``start_step``."""

    kind: ClassVar[str] = "rank_started"
    start_step: int


@dataclass(frozen=True, kw_only=True)
class RankCheckpoint(RankEvent):
    """A checkpoint's ``phase`` (``snapshot``: the loop was blocked ``blocking_ms`` +
    ``wait_ms``; ``committed``: ``step`` is durable; others are only logged)."""

    kind: ClassVar[str] = "checkpoint"
    phase: str = ""
    step: int | None = None
    blocking_ms: float = 0.0
    wait_ms: float = 0.0


@dataclass(frozen=True, kw_only=True)
class RankFaultInjected(RankEvent):
    """A planned fault (``fault_id``) fired on the rank."""

    kind: ClassVar[str] = "fault_injected"
    fault_id: str


@dataclass(frozen=True, kw_only=True)
class RankKnobs(RankEvent):
    """Rank 0's declared knobs (``KnobSpec.to_dict()``; None: it sent none readable)."""

    kind: ClassVar[str] = "knobs"
    specs: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True, kw_only=True)
class RankKnobApplied(RankEvent):
    """Every rank applied these pending knob changes at ``step`` (None: not readable)."""

    kind: ClassVar[str] = "knob_applied"
    step: int | None = None
    changes: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True)
class RankFailed(RankEvent):
    """The rank's own report of its failure (its task's exit decides; logged)."""

    kind: ClassVar[str] = "rank_failed"


@dataclass(frozen=True, kw_only=True)
class RankFinished(RankEvent):
    """The rank's loop ended (its task's exit decides; logged)."""

    kind: ClassVar[str] = "rank_finished"


@dataclass(frozen=True, kw_only=True)
class RankData(RankEvent):
    """Rank 0's data position, batch and LR factor at a generation's start (logged)."""

    kind: ClassVar[str] = "data"


@dataclass(frozen=True, kw_only=True)
class RankMemory(RankEvent):
    """A rank's parameter, gradient and optimizer-state bytes after its first step
    (logged)."""

    kind: ClassVar[str] = "memory"


@dataclass(frozen=True, kw_only=True)
class RankGradNoise(RankEvent):
    """Rank 0's smoothed gradient noise scale (samples; None: no estimate yet), for goodput
    sizing (``core.gradnoise``; not logged)."""

    kind: ClassVar[str] = "gradnoise"
    noise_scale: float | None = None


_RANK_TYPES: dict[str, type[RankEvent]] = {t.kind: t for t in (
    RankSteps, RankPhase, RankDevice, RankStarted, RankCheckpoint, RankFaultInjected,
    RankKnobs, RankKnobApplied, RankFailed, RankFinished, RankData, RankMemory,
    RankGradNoise)}


def rank_from_wire(now: float, wall: float, job_id: str, msg: Mapping[str, Any]) -> RankEvent:
    """The typed event for a rank's message (``core.jobevents.RANK_KINDS``, but ``log``, the
    rank's output, which is no machine event). ``UnknownKind`` for another kind;
    ``TypeError``/``ValueError`` naming a field it cannot read. A message of an older rank
    runtime, which said ``gen``, reads too."""
    kind = _RANK_TYPES.get(str(msg.get("kind")))
    if kind is None:
        raise UnknownKind(f"unknown rank message kind {msg.get('kind')!r}; one of "
                          f"{', '.join(_RANK_TYPES)}")
    generation: Any = generation_of(msg)
    rank: Any = msg.get("rank")
    if not _is_int(generation) or not _is_int(rank):
        raise TypeError(f"a rank's {kind.kind} message needs an integer generation and rank, "
                        f"got {generation!r} and {rank!r}")
    record = msg if "gen" not in msg else {
        **{k: v for k, v in msg.items() if k != "gen"}, "generation": generation}
    return kind(now, wall, job_id, generation, rank, record=record,
                **_FIELDS.get(kind, _none)(msg))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _none(msg: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _field(msg: Mapping[str, Any], name: str, types: type | tuple[type, ...],
           default: Any = ...) -> Any:
    value = msg.get(name, default)
    if value is ... or not isinstance(value, types) or isinstance(value, bool):
        raise TypeError(f"a rank's {msg.get('kind')} message needs {name} as "
                        f"{getattr(types, '__name__', types)}, got {value!r}")
    return value


def _steps(msg: Mapping[str, Any]) -> dict[str, Any]:
    return {"rows": _field(msg, "rows", (list, tuple))}


def _phase(msg: Mapping[str, Any]) -> dict[str, Any]:
    return {"phase": _field(msg, "phase", str)}


def _device(msg: Mapping[str, Any]) -> dict[str, Any]:
    readings = msg.get("readings") or {}
    if not isinstance(readings, Mapping):
        raise TypeError(f"a rank's device message needs readings as a mapping, got "
                        f"{readings!r}")
    return {"readings": dict(readings)}


def _started(msg: Mapping[str, Any]) -> dict[str, Any]:
    return {"start_step": _field(msg, "start_step", int)}


def _checkpoint(msg: Mapping[str, Any]) -> dict[str, Any]:
    phase = msg.get("phase") if isinstance(msg.get("phase"), str) else ""
    step = _field(msg, "step", int) if phase == "committed" else msg.get("step")
    return {"phase": phase, "step": step if isinstance(step, int) else None,
            "blocking_ms": float(msg.get("blocking_ms", 0)),
            "wait_ms": float(msg.get("wait_ms", 0))}


def _fault_injected(msg: Mapping[str, Any]) -> dict[str, Any]:
    fault = _field(msg, "fault", Mapping)
    if "id" not in fault:
        raise TypeError(f"a rank's fault_injected message needs the fault's id, got {fault!r}")
    return {"fault_id": str(fault["id"])}


def _knobs(msg: Mapping[str, Any]) -> dict[str, Any]:
    specs = msg.get("specs")
    return {"specs": tuple(specs) if isinstance(specs, list | tuple) else None}


def _knob_applied(msg: Mapping[str, Any]) -> dict[str, Any]:
    step, changes = msg.get("step"), msg.get("changes")
    return {"step": step if isinstance(step, int) else None,
            "changes": tuple(changes) if isinstance(changes, list | tuple) else ()}


def _gradnoise(msg: Mapping[str, Any]) -> dict[str, Any]:
    value = msg.get("noise_scale")
    if value is None:
        return {"noise_scale": None}
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"a rank's gradnoise message needs noise_scale as a finite number "
                         f">= 0 (or None), got {value!r}")
    return {"noise_scale": float(value)}


_FIELDS = {RankSteps: _steps, RankPhase: _phase, RankDevice: _device, RankStarted: _started,
           RankCheckpoint: _checkpoint, RankFaultInjected: _fault_injected, RankKnobs: _knobs,
           RankKnobApplied: _knob_applied, RankGradNoise: _gradnoise}
