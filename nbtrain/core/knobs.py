"""Live knobs: declared hyperparameters a job's owner changes while it trains (pure).

A job declares what may change and its bounds (:class:`KnobSpec`): the built-ins a rank
declares for its tracked optimizers (``lr`` absolute on every param group, ``lr_factor``
relative to each group's own LR, ``weight_decay``, ``grad_clip``) and for its checkpoints
(``checkpoint_every``, whole steps), the straggler detector's settings that the controller
declares and judges with itself (``straggler_ratio``, ...: :mod:`nbtrain.core.stragglerknobs`),
and the user's own (``ctx.knobs.declare("aux_weight", 0.1, min=0, max=1)``). A change
(:class:`KnobChange`) sets new values, at once or as a ramp over ``ramp`` steps (linear or
cosine); it is *pending* until every rank applies it at one agreed step boundary, then it
is *applied* at that ``step`` and belongs to the job's history.

The values in force are a pure function of the declarations, the applied history and the
step (:func:`values_at`): the ranks, the controller, a restart and a replay all compute the
same float64 values from the same history, so a steered run is reproduced exactly by
re-applying its history at the recorded steps.

Step convention: a change applied at step ``s`` (the boundary after ``s`` steps are done)
is in force from step ``s + 1``; a checkpoint at step ``c`` restores the values of every
change applied at ``s <= c``, and the later ones are applied again at their steps.

:class:`KnobBook` is the controller's record of one job's knobs (inside the job machine):
the declarations its rank 0 reported, the pending changes and the history, every input
checked and bounded (a client can never make it grow without bound).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "BUILTIN",
    "BY",
    "HISTORY_MAX",
    "KNOBS_MAX",
    "PENDING_MAX",
    "RAMP_MAX_STEPS",
    "RESERVED",
    "SHAPES",
    "KnobBook",
    "KnobChange",
    "KnobError",
    "KnobSpec",
    "KnobState",
    "check_change",
    "knob_state",
    "ramp_weight",
    "values_at",
]

#: Knobs the rank runtime declares itself: for the tracked optimizers, and (a job with a
#: checkpoint directory) the step interval of its checkpoints.
BUILTIN = ("lr", "lr_factor", "weight_decay", "grad_clip", "checkpoint_every")
#: Who applies a knob: every rank at the agreed step, or the controller (which judges the
#: job's step rows with it from the step after the agreed one).
BY = ("ranks", "controller")
#: Ramp shapes: the fraction of the way to the new value after ``k`` of ``n`` steps.
SHAPES = ("linear", "cosine")
#: Bounds on what one job may hold: declared knobs, pending changes, applied history.
KNOBS_MAX = 64
PENDING_MAX = 16
HISTORY_MAX = 10_000
RAMP_MAX_STEPS = 10_000_000
NAME_MAX = 64
WHO_MAX = 200
#: Names ``job.set(...)`` takes for itself (no knob may have them).
RESERVED = ("ramp", "shape", "wait", "timeout")


class KnobError(ValueError):
    """A knob declaration or change that cannot be taken, with the values and the fix."""


@dataclass(frozen=True, kw_only=True)
class KnobSpec:
    """A declared knob: its value before any change and its bounds (inclusive)."""

    name: str
    default: float
    min: float | None = None
    max: float | None = None
    builtin: bool = False
    #: Whole numbers only (a step count); such a knob jumps, it takes no ramp.
    integer: bool = False
    #: Who applies it (``BY``); the controller's knobs jump too (no ramp).
    by: str = "ranks"

    @property
    def ramps(self) -> bool:
        """Whether a change may ramp this knob (a number the ranks apply every step)."""
        return not self.integer and self.by == "ranks"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() \
                or len(self.name) > NAME_MAX:
            raise KnobError(f"a knob's name must be a Python identifier of at most {NAME_MAX} "
                            f"characters, got {self.name!r}")
        if self.name in RESERVED:
            raise KnobError(f"{self.name!r} cannot be a knob's name: job.set() takes "
                            f"{', '.join(RESERVED)} for itself")
        for what in ("default", "min", "max"):
            v = getattr(self, what)
            if v is not None and (not _is_number(v) or not math.isfinite(float(v))):
                raise KnobError(f"knob {self.name}: {what} must be a finite number, got {v!r}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise KnobError(f"knob {self.name}: min {self.min:g} is above max {self.max:g}")
        if self.by not in BY:
            raise KnobError(f"knob {self.name}: by must be one of {', '.join(BY)}, got "
                            f"{self.by!r}")
        problem = self.out_of_bounds(float(self.default))
        if problem:
            raise KnobError(f"knob {self.name}: its default {problem}")

    def out_of_bounds(self, value: float) -> str:
        """Why ``value`` is outside the bounds ("" when it is inside)."""
        if self.min is not None and value < self.min:
            return f"{value:g} is below its min {self.min:g}"
        if self.max is not None and value > self.max:
            return f"{value:g} is above its max {self.max:g}"
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "default": float(self.default), "min": self.min,
                "max": self.max, "builtin": self.builtin, "integer": self.integer,
                "by": self.by}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KnobSpec:
        lo, hi = d.get("min"), d.get("max")
        return cls(name=str(d["name"]), default=_number(d["default"]),
                   min=None if lo is None else _number(lo),
                   max=None if hi is None else _number(hi), builtin=bool(d.get("builtin")),
                   integer=bool(d.get("integer")), by=str(d.get("by", "ranks")))


@dataclass(frozen=True, kw_only=True)
class KnobChange:
    """New values for some knobs: a jump (``ramp`` 0) or a ramp over ``ramp`` steps.
    ``seq`` orders the changes of one job; ``step`` is None while pending."""

    seq: int
    values: Mapping[str, float]
    who: str = ""
    ramp: int = 0
    shape: str = "linear"
    step: int | None = None
    time: float = 0.0  # wall clock of the request, for people

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "values": {k: float(v) for k, v in self.values.items()},
                "who": self.who, "ramp": self.ramp, "shape": self.shape, "step": self.step,
                "time": self.time}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KnobChange:
        values = d.get("values")
        if not isinstance(values, Mapping):
            raise KnobError(f"a knob change's values must map knob names to numbers, got "
                            f"{values!r}")
        step = d.get("step")
        return cls(seq=int(d["seq"]), values={str(k): _number(v) for k, v in values.items()},
                   who=str(d.get("who", ""))[:WHO_MAX], ramp=int(d.get("ramp", 0)),
                   shape=str(d.get("shape", "linear")),
                   step=None if step is None else int(step), time=float(d.get("time", 0.0)))


def ramp_weight(shape: str, k: int, n: int) -> float:
    """How far a ramp of ``n`` steps is after ``k`` of them (0..1; ``n`` 0: a jump)."""
    if n <= 0 or k >= n:
        return 1.0
    x = max(0, k) / n
    return x if shape == "linear" else 0.5 * (1.0 - math.cos(math.pi * x))


def values_at(defaults: Mapping[str, float], history: Iterable[KnobChange],
              step: int) -> dict[str, float]:
    """The values in force for the step after ``step``: every applied change at a step
    ``<= step`` in order of (step, seq); a ramp started at ``s`` is ``k = step - s + 1``
    steps along (its first step already moves; it reaches the value after ``ramp`` steps).
    A ramp that a later change interrupts starts that change from where it was."""
    # name -> (start step, start value, target, ramp steps, shape)
    segments: dict[str, tuple[int, float, float, int, str]] = {}

    def at(name: str, s: int) -> float:
        seg = segments.get(name)
        if seg is None:
            return float(defaults[name])
        a, start, target, n, shape = seg
        w = ramp_weight(shape, s - a + 1, n)
        return target if w >= 1.0 else start + (target - start) * w

    for change in sorted((c for c in history if c.step is not None and c.step <= step),
                         key=lambda c: (c.step, c.seq)):
        assert change.step is not None
        for name, target in change.values.items():
            if name not in defaults:
                continue  # a knob this run does not declare (a replay of another recipe)
            # The value the change starts from: the one in force for its own step.
            start = at(name, change.step) if change.ramp else float(target)
            segments[name] = (change.step, start, float(target), change.ramp, change.shape)
    return {name: at(name, step) for name in defaults}


def check_change(specs: Mapping[str, KnobSpec], values: Mapping[str, Any], *, ramp: int = 0,
                 shape: str = "linear", job: str = "the job") -> dict[str, float]:
    """The change's values as floats, or :class:`KnobError` naming every problem and the
    fix (run by the client first and by the controller again)."""
    problems: list[str] = []
    if not isinstance(values, Mapping) or not values:
        raise KnobError(f"job.set(...) needs at least one knob=value; {job} declares "
                        f"{_names(specs)}")
    if len(values) > KNOBS_MAX:
        raise KnobError(f"one change may set at most {KNOBS_MAX} knobs, got {len(values)}")
    if isinstance(ramp, bool) or not isinstance(ramp, int) or not 0 <= ramp <= RAMP_MAX_STEPS:
        problems.append(f"ramp must be a whole number of steps from 0 (a jump) to "
                        f"{RAMP_MAX_STEPS:,}, got {ramp!r}")
    if shape not in SHAPES:
        problems.append(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    out: dict[str, float] = {}
    for name, value in values.items():
        problem = _value_problem(specs, str(name), value, ramp, job)
        if problem:
            problems.append(problem)
        else:
            out[str(name)] = float(value)
    if problems:
        raise KnobError(f"cannot set the knobs of {job}: " + "; ".join(problems))
    return out


def _value_problem(specs: Mapping[str, KnobSpec], name: str, value: Any, ramp: int,
                   job: str) -> str:
    """What is wrong with setting knob ``name`` to ``value`` ("" when nothing is)."""
    spec = specs.get(name)
    if spec is None:
        return (f"{name!r} is not a knob of {job} (it declares {_names(specs)}; declare it in "
                f"the training function with ctx.knobs.declare({name!r}, default, min=..., "
                "max=...))")
    if not _is_number(value) or not math.isfinite(float(value)):
        return f"{name} must be a finite number, got {value!r}"
    if spec.integer and not float(value).is_integer():
        return f"{name} takes whole numbers (a count of steps), got {value!r}"
    if ramp and not spec.ramps:
        why = "it counts whole steps" if spec.integer else "the controller applies it"
        return f"{name} cannot ramp ({why}): set it with ramp=0, in a change of its own"
    why = spec.out_of_bounds(float(value))
    if why:
        return (f"{name}={value:g}: {why} (declared bounds [{_bound(spec.min)}, "
                f"{_bound(spec.max)}])")
    return ""


@dataclass
class KnobBook:
    """The controller's record of one job's knobs (see the module docstring)."""

    specs: dict[str, KnobSpec] = field(default_factory=dict)
    pending: list[KnobChange] = field(default_factory=list)
    history: list[KnobChange] = field(default_factory=list)
    seq: int = 0
    #: Rank 0 has reported its declarations (possibly none).
    declared: bool = False
    #: The knobs the controller declares itself (``by="controller"``): known before any
    #: rank reports, and they win over a rank's copy.
    judged: dict[str, KnobSpec] = field(default_factory=dict)

    @classmethod
    def replaying(cls, history: Iterable[Mapping[str, Any]]) -> KnobBook:
        """A book whose history is another run's applied changes (``submit(replay=...)``):
        its ranks apply them at their recorded steps."""
        changes = [KnobChange.from_dict(d) for d in history]
        if len(changes) > HISTORY_MAX:
            raise KnobError(f"a replay carries at most {HISTORY_MAX:,} knob changes, got "
                            f"{len(changes):,}")
        if any(c.step is None or c.step < 0 for c in changes):
            raise KnobError("a replay's knob changes must all have been applied (a step >= 0)")
        changes.sort(key=lambda c: (c.step or 0, c.seq))
        return cls(history=changes, seq=max((c.seq for c in changes), default=0))

    def offer(self, specs: Iterable[KnobSpec]) -> None:
        """The controller's own knobs (its straggler settings), declared for the job."""
        self.judged = {s.name: s for s in specs}
        self.specs = {**self.specs, **self.judged}

    def declare(self, specs: Iterable[Mapping[str, Any]]) -> None:
        """What rank 0 declared when its loop started (bounded; malformed ones dropped)."""
        out: dict[str, KnobSpec] = {}
        for d in list(specs)[:KNOBS_MAX]:
            try:
                spec = KnobSpec.from_dict(d)
            except (KnobError, KeyError, TypeError, ValueError):
                continue
            out[spec.name] = spec
        self.specs = {**out, **self.judged}
        self.declared = True

    def request(self, values: Mapping[str, Any], *, ramp: int = 0, shape: str = "linear",
                who: str = "", wall: float = 0.0, job: str = "the job") -> KnobChange:
        """A new pending change, or :class:`KnobError` with the values and the fix."""
        ranks = {n for n in self.specs if n not in self.judged}
        asks_ranks = isinstance(values, Mapping) and any(n not in self.judged for n in values)
        if asks_ranks and not ranks and self.declared:
            raise KnobError(f"{job} has no knobs{' of its ranks' if self.judged else ''}: "
                            "declare them in the training function "
                            "(ctx.knobs.declare('name', default, min=..., max=...)), "
                            "or track an optimizer (ctx.track(optimizer=...)) for lr, "
                            "lr_factor, weight_decay and grad_clip"
                            + (f"; the controller's own are {_names(self.judged)}"
                               if self.judged else ""))
        if asks_ranks and not ranks:
            raise KnobError(f"{job} has not declared its knobs yet: a job declares them when "
                            "its ranks start training; wait until job.knobs lists them")
        if len(self.pending) >= PENDING_MAX:
            raise KnobError(f"{job} already has {len(self.pending)} knob changes waiting for "
                            f"its ranks (at most {PENDING_MAX}): wait for them to apply")
        if len(self.history) + len(self.pending) >= HISTORY_MAX:
            raise KnobError(f"{job} has {HISTORY_MAX:,} knob changes, the most one job keeps")
        checked = check_change(self.specs, values, ramp=ramp, shape=shape, job=job)
        self.seq += 1
        change = KnobChange(seq=self.seq, values=checked, who=str(who)[:WHO_MAX], ramp=ramp,
                            shape=shape, time=wall)
        self.pending.append(change)
        return change

    def applied(self, changes: Iterable[Mapping[str, Any]], step: int) -> list[KnobChange]:
        """Rank 0 says these pending changes were applied by every rank at ``step``; the
        ones newly moved to the history (a change applied twice is recorded once)."""
        seqs = set()
        for d in changes:
            try:
                seqs.add(int(d["seq"]))
            except (KeyError, TypeError, ValueError):
                continue
        moved = [replace(c, step=int(step)) for c in self.pending if c.seq in seqs]
        self.pending = [c for c in self.pending if c.seq not in seqs]
        self.history.extend(moved)
        return moved

    def defaults(self) -> dict[str, float]:
        return {name: spec.default for name, spec in self.specs.items()}

    def values(self, step: int) -> dict[str, float]:
        """The values in force after ``step``."""
        return values_at(self.defaults(), self.history, step)

    def wire(self) -> dict[str, Any]:
        """What ranks of a new generation (and a restarted controller) get."""
        return {"specs": [s.to_dict() for s in self.specs.values()],
                "pending": [c.to_dict() for c in self.pending],
                "history": [c.to_dict() for c in self.history], "seq": self.seq,
                "declared": self.declared,
                "judged": [s.to_dict() for s in self.judged.values()]}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> KnobBook:
        book = cls(pending=[KnobChange.from_dict(c) for c in d.get("pending", ())],
                   history=[KnobChange.from_dict(c) for c in d.get("history", ())],
                   seq=int(d.get("seq", 0)))
        book.offer(KnobSpec.from_dict(s) for s in d.get("judged", ()))
        book.declare(s for s in d.get("specs", ()) if s.get("name") not in book.judged)
        book.declared = bool(d.get("declared", book.specs))
        return book


@dataclass(frozen=True)
class KnobState:
    """What ``job.knobs`` shows: the declared knobs, the values in force after ``step``,
    the applied history (step, values, who) and the changes still pending."""

    declared: Mapping[str, KnobSpec]
    values: Mapping[str, float]
    history: tuple[KnobChange, ...]
    pending: tuple[KnobChange, ...]
    step: int

    def changes(self) -> list[dict[str, Any]]:
        """The applied history as plain data: what ``submit(..., replay=...)`` takes."""
        return [c.to_dict() for c in self.history]

    def __repr__(self) -> str:
        lines = [f"knobs at step {self.step}: " + (", ".join(
            f"{k}={v:.6g}" for k, v in self.values.items()) or "none declared yet")]
        for c in self.history:
            how = f" over {c.ramp} steps ({c.shape})" if c.ramp else ""
            lines.append(f"  step {c.step}: " + ", ".join(
                f"{k}={v:.6g}" for k, v in c.values.items()) + f"{how} by {c.who or '?'}")
        for c in self.pending:
            lines.append("  pending: " + ", ".join(f"{k}={v:.6g}" for k, v in c.values.items())
                         + f" by {c.who or '?'}")
        return "\n".join(lines)


def knob_state(events: Iterable[Mapping[str, Any]], step: int) -> KnobState:
    """``job.knobs`` from a job's events: rank 0's newest ``knobs`` declaration (with the
    history its generation started with), every ``knob_applied``, ``knob_set`` not applied."""
    specs: dict[str, KnobSpec] = {}
    history: dict[int, KnobChange] = {}
    asked: dict[int, KnobChange] = {}
    for e in events:
        kind = e.get("kind")
        try:
            if kind == "knobs":
                specs = {d["name"]: KnobSpec.from_dict(d) for d in e.get("specs", ())}
                for d in e.get("history", ()):
                    history.setdefault(int(d["seq"]), KnobChange.from_dict(d))
            elif kind == "knob_applied":
                for d in e.get("changes", ()):
                    history[int(d["seq"])] = KnobChange.from_dict(d)
            elif kind == "knob_set":
                c = KnobChange.from_dict(e["change"])
                asked[c.seq] = c
        except (KnobError, KeyError, TypeError, ValueError):
            continue  # an event of another version: shown without it
    applied = tuple(sorted(history.values(), key=lambda c: (c.step or 0, c.seq)))
    pending = tuple(c for s, c in sorted(asked.items()) if s not in history)
    values = values_at({n: s.default for n, s in specs.items()}, applied, step)
    return KnobState(declared=specs, values=values, history=applied, pending=pending,
                     step=step)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number(v: object) -> float:
    if not _is_number(v):
        raise KnobError(f"a knob value must be a number, got {v!r}")
    return float(v)  # type: ignore[arg-type]


def _bound(v: float | None) -> str:
    return "none" if v is None else f"{v:g}"


def _names(specs: Mapping[str, KnobSpec]) -> str:
    return ", ".join(sorted(specs)) or "no knobs"
