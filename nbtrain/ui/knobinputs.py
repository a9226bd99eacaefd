"""The live knobs in the notebook widget: a number input per declared knob (whole numbers
for a whole-number knob), a slider beside it for a knob with both bounds, and an Apply
button that sends the knobs whose input differs from the value in force as one
``job.set(...)`` (checked against the bounds by the handle and again by the controller; a
refusal is shown in red with its reason). The change is then shown pending until the job's
events say the step every rank applied it at. Built from the job's ``knobs`` declaration
when its ranks start; the same folding of events as ``job.knobs``
(:func:`nbtrain.core.knobs.knob_state`), and the same inputs as the served page's
(:mod:`nbtrain.ui.knobpanel`).

The inputs are not bounded widgets on purpose: a bounded ipywidgets input clamps what is
typed without a word, where the handle's check says which bound it broke.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ipywidgets as widgets

__all__ = ["KnobInputs"]


class KnobInputs(widgets.VBox):
    """``set_knobs(values)`` is ``lambda v: job.set(wait=False, **v)``; :meth:`update`
    takes the job's new events."""

    def __init__(self, set_knobs: Callable[[dict[str, float]], Any]) -> None:
        self._set = set_knobs
        self.specs: list[dict[str, Any]] = []
        self.values: dict[str, float] = {}  # in force, as the ranks reported
        self.fields: dict[str, widgets.FloatText | widgets.IntText] = {}
        self.sliders: dict[str, widgets.FloatSlider | widgets.IntSlider] = {}
        self.apply = widgets.Button(description="Apply", button_style="primary",
                                    tooltip="every rank applies the changed knobs at its next "
                                            "agreed step")
        self.apply.add_class("nbtrain-knobs-apply")
        self.apply.on_click(lambda _b: self.send())
        self.status = widgets.HTML("<i>knobs: listed when the job's ranks start training</i>")
        self.status.add_class("nbtrain-knobs-status")
        self._asked: dict[str, float] | None = None  # the change sent, until it is applied
        self._seq: int | None = None  # its number, once its knob_set event is in
        super().__init__(children=[self.status])
        self.add_class("nbtrain-knobs")

    # -- events -----------------------------------------------------------------------------
    def update(self, events: Iterable[Mapping[str, Any]]) -> None:
        for ev in events:
            kind = ev.get("kind")
            if kind == "knobs" and isinstance(ev.get("specs"), list | tuple):
                self._in_force(ev.get("values"))
                specs = [dict(s) for s in ev["specs"]]
                if specs != self.specs:
                    self.specs = specs
                    self._build()
            elif kind == "knob_set" and self._asked is not None and self._seq is None:
                change = dict(ev.get("change") or {})
                if dict(change.get("values") or {}) == self._asked:
                    self._seq = int(change.get("seq", 0))
            elif kind == "knob_applied":
                self._in_force(ev.get("values"))
                seqs = {int(c.get("seq", -1)) for c in ev.get("changes") or ()}
                if self._seq is not None and self._seq in seqs:
                    self._say(f"applied at step {int(ev['step'])} on every rank (in force "
                              f"from step {int(ev['step']) + 1}): " + _values(self._asked))
                    self._asked = self._seq = None

    def _in_force(self, values: Any) -> None:
        """New values in force: inputs nobody edited follow them."""
        for name, value in dict(values or {}).items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            old = self.values.get(str(name))
            self.values[str(name)] = float(value)
            field = self.fields.get(str(name))
            if field is not None and (old is None or float(field.value) == old):
                field.value = _shown(value, isinstance(field, widgets.IntText))

    # -- widgets ----------------------------------------------------------------------------
    def _build(self) -> None:
        self.fields, self.sliders = {}, {}
        rows: list[widgets.Widget] = []
        for spec in self.specs:
            name = str(spec.get("name"))
            whole = bool(spec.get("integer"))
            lo, hi = spec.get("min"), spec.get("max")
            value = self.values.get(name, float(spec.get("default") or 0.0))
            if not math.isfinite(value):
                value = float(spec.get("default") or 0.0)
            tip = f"bounds [{_bound(lo)}, {_bound(hi)}]" + (
                "; applied by the controller" if spec.get("by") == "controller" else "")
            field: widgets.FloatText | widgets.IntText = (
                widgets.IntText(value=int(value), description=name, tooltip=tip) if whole
                else widgets.FloatText(value=value, description=name, tooltip=tip))
            field.style = {"description_width": "140px"}
            field.add_class(f"nbtrain-knob-{name}")
            self.fields[name] = field
            row: list[widgets.Widget] = [field]
            if lo is not None and hi is not None and hi > lo:
                slider: widgets.FloatSlider | widgets.IntSlider = (
                    widgets.IntSlider(min=int(lo), max=int(hi), step=1, readout=False)
                    if whole else widgets.FloatSlider(min=lo, max=hi, step=(hi - lo) / 100,
                                                      readout=False))
                slider.value = min(max(value, lo), hi)
                slider.continuous_update = False
                slider.add_class(f"nbtrain-knob-slider-{name}")
                _link(field, slider, lo, hi)
                self.sliders[name] = slider
                row.append(slider)
            rows.append(widgets.HBox(row))
        self.children = [*rows, widgets.HBox([self.apply, self.status])]
        if self._asked is None:
            self._say("in force: " + _values(self.values, [str(s["name"]) for s in self.specs]))

    def changed(self) -> dict[str, float]:
        """The knobs whose input differs from the value in force."""
        out = {}
        for name, field in self.fields.items():
            value = float(field.value)
            if math.isfinite(value) and value != self.values.get(name):
                out[name] = value
        return out

    def send(self) -> None:
        """The Apply button: one ``job.set`` of the changed knobs."""
        values = self.changed()
        if not values:
            self._say("no knob changed: edit a value, then Apply")
            return
        try:
            self._set(values)
        except Exception as exc:  # shown, never raised into the comm handler
            self._say(f"not applied: {exc}", error=True)
            return
        self._asked, self._seq = values, None
        self._say("sent; pending until the ranks' next agreed step: " + _values(values))

    def disable(self, why: str) -> None:
        """The job ended: nothing can change any more."""
        if not self.apply.disabled:
            self.apply.disabled = True
            for w in [*self.fields.values(), *self.sliders.values()]:
                w.disabled = True
            self._say(why)

    def _say(self, text: str, *, error: bool = False) -> None:
        colour = "#c33" if error else "#555"
        self.status.value = f"<span style='color:{colour}'>{html.escape(text)}</span>"


def _link(field: widgets.Widget, slider: widgets.Widget, lo: float, hi: float) -> None:
    """The slider sets the input; the input moves the slider where it is inside the bounds
    (outside them the input keeps what was typed, for the check to name the bound)."""
    def moved(change: Mapping[str, Any]) -> None:
        if float(field.value) != float(change["new"]):
            field.value = change["new"]

    def typed(change: Mapping[str, Any]) -> None:
        new = float(change["new"])
        if lo <= new <= hi and float(slider.value) != new:
            slider.value = change["new"]

    slider.observe(moved, "value")
    field.observe(typed, "value")


def _shown(value: float, whole: bool) -> float | int:
    return int(value) if whole and math.isfinite(value) else float(value)


def _bound(v: Any) -> str:
    return "none" if v is None else f"{float(v):g}"


def _values(values: Mapping[str, float] | None, order: list[str] | None = None) -> str:
    values = values or {}
    names = order if order is not None else list(values)
    return ", ".join(f"{n}={values[n]:.6g}" for n in names if n in values) or "none"
