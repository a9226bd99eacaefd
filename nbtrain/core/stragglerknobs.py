"""The straggler detector's settings as live knobs, judged by the controller (pure).

The ranks do not judge stragglers, the controller does (:mod:`nbtrain.core.stragglerwatch`),
so these knobs are the controller's own (``KnobSpec.by == "controller"``): declared by the
job machine for every job, with the job's detector settings as defaults. A change goes the
way of every knob change (pending, agreed by the ranks at one step ``s``, recorded at ``s``
in the history that checkpoints, restarts and ``submit(replay=...)`` carry), and the
controller judges every step after ``s`` with it: the detector's settings in force for step
``t`` are the job's base settings with every change applied at a step ``< t`` on top
(:meth:`StragglerKnobs.settings_at`). The base settings are those the job started with,
changed by ``job.tune_stragglers`` (immediate and unrecorded); a knob a change has named
wins over them.

A change is checked whole: the settings it leads to must be valid together (``window`` vs
``suspect_votes``), with the values in force and the changes still pending.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from nbtrain.core.knobs import KnobChange, KnobSpec
from nbtrain.core.straggler import HISTORY_STEPS_MAX, StragglerSettings

__all__ = ["FIELDS", "PREFIX", "StragglerKnobs", "fields_of", "straggler_specs"]

PREFIX = "straggler_"
#: The detector settings offered as knobs: field -> (min, max, whole numbers).
FIELDS: dict[str, tuple[float | None, float | None, bool]] = {
    "ratio": (1.0, None, False),
    "window": (1, HISTORY_STEPS_MAX, True),
    "suspect_votes": (1, HISTORY_STEPS_MAX, True),
    "confirm_share": (0.0, 1.0, False),
    "confirm_z": (0.0, None, False),
    "confirm_s": (0.0, None, False),
}


def straggler_specs(settings: StragglerSettings) -> list[KnobSpec]:
    """The controller's knobs for a job whose detector starts with ``settings``."""
    return [KnobSpec(name=PREFIX + f, default=float(getattr(settings, f)), min=lo, max=hi,
                     builtin=True, integer=whole, by="controller")
            for f, (lo, hi, whole) in FIELDS.items()]


def fields_of(values: Mapping[str, float]) -> dict[str, Any]:
    """The detector settings a change's values name (ints where the setting counts)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        f = name[len(PREFIX):] if name.startswith(PREFIX) else ""
        if f in FIELDS:
            out[f] = int(value) if FIELDS[f][2] else float(value)
    return out


class StragglerKnobs:
    """One job's straggler knob history as the controller judges with it."""

    def __init__(self, base: StragglerSettings) -> None:
        self.base = base
        self._changes: dict[int, tuple[int, dict[str, Any]]] = {}  # seq -> (step, fields)

    def follow(self, changes: Iterable[KnobChange]) -> list[int]:
        """Applied changes (any knobs; those naming none of these are skipped, a change
        known already too); the steps of the new ones."""
        steps = []
        for c in changes:
            fields = fields_of(c.values)
            if c.step is not None and fields and c.seq not in self._changes:
                self._changes[c.seq] = (c.step, fields)
                steps.append(c.step)
        return steps

    def steps(self) -> list[int]:
        """The steps changes were applied at, in order."""
        return sorted({s for s, _ in self._changes.values()})

    def settings_at(self, step: int) -> StragglerSettings:
        """The settings to judge step ``step + 1`` with: every change applied at ``<= step``."""
        named: dict[str, Any] = {}
        for _, (s, fields) in sorted(self._changes.items(), key=lambda kv: (kv[1][0], kv[0])):
            if s <= step:
                named.update(fields)
        return dataclasses.replace(self.base, **named) if named else self.base

    def problem(self, in_force: StragglerSettings, pending: Iterable[KnobChange],
                values: Mapping[str, float]) -> str:
        """Why a change of ``values`` cannot be taken ("" when it can): the settings it
        leads to, after the pending changes, must be valid together. Values that are no
        numbers or out of a knob's bounds are left to ``core.knobs.check_change``."""
        try:
            fields = fields_of(values)
        except (TypeError, ValueError, OverflowError):
            return ""
        if not fields:
            return ""
        named: dict[str, Any] = {}
        for c in pending:
            named.update(fields_of(c.values))
        named.update(fields)
        try:
            dataclasses.replace(in_force, **named)
        except (TypeError, ValueError) as exc:
            return f"these straggler settings do not go together: {exc}"
        return ""
