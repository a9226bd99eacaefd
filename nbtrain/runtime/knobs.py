"""Live knobs on a rank: ``ctx.knobs.declare(...)``, ``ctx.knob(name)``, the built-ins.

The values are a pure function of the declarations, the job's applied history and the step
(:func:`nbtrain.core.knobs.values_at`), so every rank holds the same float64 values at every
step: a live change joins the history at the step all ranks agreed on
(:class:`~nbtrain.runtime.control.ControlChannel`), and a restart, a resize or a replay
applies the same history at the same steps. Built-ins act on the tracked optimizers' param
groups: ``lr`` (absolute, every group), ``lr_factor`` (relative to each group's own LR,
applied like :mod:`nbtrain.runtime.lr_rules` so a restore lands on the same LR),
``weight_decay`` (every group that has one) and ``grad_clip`` (the gradients' global total
norm, across FSDP and TP shards, is clipped to it before each optimizer step; 0 = off:
:mod:`nbtrain.runtime.gradclip`). The loop provides ``checkpoint_every`` (the step interval
of checkpoints, 0 = none by steps) for a job with a checkpoint directory. A built-in no
change ever named is left alone, so an LR scheduler keeps the optimizer to itself until the
LR is steered. The controller's own knobs (the straggler settings) are known here too, so
their changes join the same history, but nothing on a rank acts on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nbtrain.core.knobs import BUILTIN, KNOBS_MAX, KnobChange, KnobError, KnobSpec, values_at
from nbtrain.runtime.gradclip import clip_grad_norm

__all__ = ["RankKnobs"]

_FACTOR_KEY = "nbtrain_knob_lr_factor"  # the lr_factor applied, kept in each param group


class RankKnobs:
    """This rank's knobs (``ctx.knobs``). Declare before the training loop starts; read with
    ``ctx.knob(name)`` (or ``ctx.knobs[name]``) at any step."""

    def __init__(self) -> None:
        self._declared: dict[str, tuple[float | None, float | None, float | None]] = {}
        self.specs: dict[str, KnobSpec] = {}
        self.history: list[KnobChange] = []
        self.values: dict[str, float] = {}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._applied: dict[str, float] = {}  # built-ins as set on the param groups
        self._started = False
        self._watch_from = 0  # the first step a change (or a ramp) may touch
        self._given: list[KnobChange] = []  # the controller's history, from the launch
        self.recovered: list[KnobChange] = []  # see start()
        self._judged: list[KnobSpec] = []  # the controller's own knobs, from the launch
        #: Built-ins the loop provides (checkpoint_every): spec and what applies a value.
        self._provided: dict[str, tuple[KnobSpec, Callable[[float], None]]] = {}

    # -- the user's side ----------------------------------------------------------------------
    def declare(self, name: str, default: float | None = None, *, min: float | None = None,
                max: float | None = None) -> float:
        """Declare a knob the job's owner may change live (``job.set(name=value)``) within
        ``[min, max]``; returns its default. A built-in (``lr``, ``lr_factor``,
        ``weight_decay``, ``grad_clip``) may be declared to bound it: its default then comes
        from the tracked optimizer when the loop starts (NaN until then). Declare before the
        training loop starts, the same on every rank."""
        if self._started:
            raise RuntimeError(f"ctx.knobs.declare({name!r}, ...) after the training loop "
                               "started: declare knobs in setup() or before ctx.batches()")
        if any(spec.name == name for spec in self._judged):
            raise KnobError(f"{name!r} is a knob of the controller's (it sets the straggler "
                            "detector): change it with job.set, read it with ctx.knob("
                            f"{name!r}); give your own knob another name")
        if name not in BUILTIN and default is None:
            raise KnobError(f"ctx.knobs.declare({name!r}, default, min=..., max=...) needs a "
                            "default value")
        if len(self._declared) >= KNOBS_MAX and name not in self._declared:
            raise KnobError(f"a job may declare at most {KNOBS_MAX} knobs")
        if default is not None:  # checked now, with the bounds, so the error is here
            KnobSpec(name=name, default=float(default), min=min, max=max)
        self._declared[name] = (None if default is None else float(default), min, max)
        self.values[name] = float(default) if default is not None else math.nan
        return self.values[name]

    def __getitem__(self, name: str) -> float:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"no knob {name!r}: declare it with ctx.knobs.declare({name!r}, "
                           f"default, min=..., max=...); declared: "
                           f"{', '.join(sorted(self.values)) or 'none'}") from None

    # -- the loop's side ----------------------------------------------------------------------
    def load(self, wire: Mapping[str, Any]) -> None:
        """The job's knobs as the controller holds them (its applied history)."""
        self._given = [KnobChange.from_dict(c) for c in wire.get("history", ())]
        self._judged = [KnobSpec.from_dict(d) for d in wire.get("judged", ())]

    def provide(self, name: str, default: float, apply: Callable[[float], None], *,
                min: float | None = None, max: float | None = None,
                integer: bool = False) -> None:
        """A built-in of the loop's own (``checkpoint_every``): ``apply`` is called with
        its value whenever a change makes it move (and at the start when one has)."""
        self._provided[name] = (KnobSpec(name=name, default=default, min=min, max=max,
                                         builtin=True, integer=integer), apply)

    def bind(self, state: Mapping[str, Any]) -> None:
        """The tracked optimizers, before the restore (their LR is the built-ins' default)."""
        self._optimizers = [o for o in state.values() if isinstance(o, torch.optim.Optimizer)]
        specs: dict[str, KnobSpec] = {}
        if self._optimizers:
            group = self._optimizers[0].param_groups[0]
            builtin = {"lr": (float(group["lr"]), 0.0, None), "lr_factor": (1.0, 0.0, None),
                       "weight_decay": (float(group.get("weight_decay", 0.0)), 0.0, None),
                       "grad_clip": (0.0, 0.0, None)}
            for name, (default, lo, hi) in builtin.items():
                d, mn, mx = self._declared.get(name, (None, None, None))
                specs[name] = KnobSpec(name=name, default=default if d is None else d,
                                       min=lo if mn is None else mn,
                                       max=hi if mx is None else mx, builtin=True)
            for opt in self._optimizers:
                opt.register_step_pre_hook(self._clip)
        for name, (spec, _) in self._provided.items():
            d, mn, mx = self._declared.get(name, (None, None, None))
            specs[name] = KnobSpec(name=name, default=spec.default if d is None else d,
                                   min=spec.min if mn is None else mn,
                                   max=spec.max if mx is None else mx, builtin=True,
                                   integer=spec.integer)
        for name, (d, mn, mx) in self._declared.items():
            if name in BUILTIN:
                if name == "checkpoint_every" and name not in specs:
                    raise KnobError("knob 'checkpoint_every' sets the step interval of the "
                                    "job's checkpoints, and this job has none: submit it with "
                                    "a checkpoint directory (checkpoint=N or 'auto')")
                if name not in specs:
                    raise KnobError(f"knob {name!r} acts on a tracked optimizer, and this job "
                                    "tracks none: ctx.track(optimizer=...) (or return it from "
                                    "Recipe.setup)")
                continue
            assert d is not None
            specs[name] = KnobSpec(name=name, default=d, min=mn, max=mx)
        for spec in self._judged:  # the controller's: the same history, applied there
            specs[spec.name] = spec
        self.specs = specs

    def start(self, step: int, restored: Mapping[str, Any] | None,
              own: bool = False) -> dict[str, Any]:
        """The loop starts at ``step``: the values in force there (the controller's history;
        a ``resume=`` checkpoint's own when the controller has none), applied. Returns the
        ``knobs`` event's fields.

        ``own``: the checkpoint is this job's. Changes its history holds at steps up to
        ``step`` that the controller's does not are ones the ranks applied while the
        controller did not record it (it died before it journaled their ``knob_applied``):
        the state restored was trained with them, so they are in force here too, at their
        own steps, and listed in :attr:`recovered` for rank 0 to report again."""
        history = list(self._given)
        saved = [KnobChange.from_dict(c) for c in (restored or {}).get("history", ())
                 if c.get("step") is not None and int(c["step"]) <= step]
        known = {c.seq for c in history}
        #: Applied changes the controller's history lacked (see above).
        self.recovered = [c for c in saved if c.seq not in known] if own else []
        if own:
            history += self.recovered
        elif not history:  # a checkpoint from another run (resume=)
            history = saved
        self.history = sorted(history, key=lambda c: (c.step or 0, c.seq))
        self._started = True
        self._update(step, force=True)
        return {"specs": [s.to_dict() for s in self.specs.values()],
                "values": dict(self.values), "step": step,
                "history": [c.to_dict() for c in self.history]}

    @property
    def seq(self) -> int:
        """The newest change this rank knows of."""
        return max((c.seq for c in self.history), default=0)

    def apply(self, changes: Sequence[Mapping[str, Any]], step: int) -> list[dict[str, Any]]:
        """Live changes every rank agreed on at ``step``: into the history, in force from the
        next step. Returns them as applied (with their step)."""
        known = {c.seq for c in self.history}
        new = [KnobChange.from_dict({**c, "step": step}) for c in changes
               if int(c["seq"]) not in known]
        self.history.extend(new)
        self._watch_from = min(self._watch_from, step)
        self._update(step)
        return [c.to_dict() for c in new]

    def at_step(self, step: int) -> None:
        """The boundary after ``step``: changes recorded at it take effect, ramps move."""
        if step >= self._watch_from:
            self._update(step)

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint carries (plain data, weights-only loadable)."""
        return {"history": [c.to_dict() for c in self.history], "values": dict(self.values)}

    # -- internals ----------------------------------------------------------------------------
    def _update(self, step: int, force: bool = False) -> None:
        defaults = {name: spec.default for name, spec in self.specs.items()}
        self.values = values_at(defaults, self.history, step)
        touched = {n for c in self.history if c.step is not None and c.step <= step
                   for n in c.values}
        for name in BUILTIN:
            if name in touched and name in self.values and (
                    force or self._applied.get(name) != self.values[name]):
                self._set_builtin(name, self.values[name])
        self._watch_from = self._next_watch(step)

    def _next_watch(self, step: int) -> int:
        """The first step after ``step`` at which the values may change."""
        nxt = math.inf
        for c in self.history:
            assert c.step is not None
            if c.step > step:
                nxt = min(nxt, c.step)
            elif c.ramp and c.step + c.ramp > step + 1:
                return step + 1  # a ramp moves every step
        return int(nxt) if nxt != math.inf else 1 << 62

    def _set_builtin(self, name: str, value: float) -> None:
        self._applied[name] = value
        provided = self._provided.get(name)
        if provided is not None:
            provided[1](value)
            return
        for opt in self._optimizers:
            for group in opt.param_groups:
                if name == "lr":
                    group["lr"] = value * float(group.get(_FACTOR_KEY, 1.0))
                elif name == "lr_factor":
                    group["lr"] = group["lr"] * (value / float(group.get(_FACTOR_KEY, 1.0)))
                    group[_FACTOR_KEY] = value
                elif name == "weight_decay" and "weight_decay" in group:
                    group["weight_decay"] = value

    def _clip(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        limit = self._applied.get("grad_clip", 0.0)
        if limit > 0:
            clip_grad_norm([p for g in optimizer.param_groups for p in g["params"]], limit)

