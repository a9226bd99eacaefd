"""The live knobs on an owner's job page: a number input per declared knob (and a slider
when the knob has both bounds), the values in force, and one button that sends the changed
ones as ``job.set(...)`` does (checked by the controller against the bounds; refusals are
shown on the page). Built from the job's ``knobs`` declaration when its ranks start, so a
page opened before the job trains gets its inputs then.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from bokeh.layouts import column, row
from bokeh.models.widgets.buttons import Button
from bokeh.models.widgets.inputs import NumericInput
from bokeh.models.widgets.markups import Div
from bokeh.models.widgets.sliders import Slider

__all__ = ["KnobPanel"]


def _follow(field: NumericInput) -> Callable[[str, Any, Any], None]:
    """A slider's callback that keeps its number input at the slider's value."""
    def moved(_attr: str, _old: Any, new: Any) -> None:
        field.value = new
    return moved


class KnobPanel:
    """``layout`` goes on the page; :meth:`update` takes the job's new events;
    ``act(what, arg)`` makes a request (the page's own, which shows errors)."""

    def __init__(self, act: Callable[[str, Any], None]) -> None:
        self._act = act
        self.specs: list[dict[str, Any]] = []
        self.values: dict[str, float] = {}
        self.inputs: dict[str, NumericInput] = {}
        self.sliders: dict[str, Slider] = {}
        self.apply = Button(label="Set knobs", name="nbtrain-knobs-apply", width=120,
                            tags=["every rank applies the change at its next agreed step"])
        self.apply.on_click(lambda _e=None: self.send())
        self.note = Div(text="", name="nbtrain-knobs-note")
        self.layout = column(self.note, name="nbtrain-knobs")

    def update(self, events: Iterable[Mapping[str, Any]]) -> None:
        for ev in events:
            kind = ev.get("kind")
            if kind == "knobs" and isinstance(ev.get("specs"), list | tuple):
                specs = [dict(s) for s in ev["specs"]]
                self.values.update({str(k): float(v) for k, v in
                                    dict(ev.get("values") or {}).items()
                                    if isinstance(v, int | float)})
                if specs != self.specs:
                    self.specs = specs
                    self._build()
            elif kind == "knob_applied":
                self.values.update({str(k): float(v) for k, v in
                                    dict(ev.get("values") or {}).items()
                                    if isinstance(v, int | float)})
        self._show_values()

    def _build(self) -> None:
        self.inputs, self.sliders = {}, {}
        rows: list[Any] = []
        for spec in self.specs:
            name = str(spec.get("name"))
            lo, hi = spec.get("min"), spec.get("max")
            value = self.values.get(name, float(spec.get("default") or 0.0))
            whole = bool(spec.get("integer"))  # a count of steps: whole numbers only
            field = NumericInput(title=name, value=int(value) if whole else value,
                                 mode="int" if whole else "float", low=lo, high=hi,
                                 width=130, name=f"nbtrain-knob-{name}")
            self.inputs[name] = field
            widgets: list[Any] = [field]
            if lo is not None and hi is not None and hi > lo:
                slider = Slider(start=lo, end=hi, value=min(max(value, lo), hi),
                                step=1 if whole else (hi - lo) / 100, title=name, width=200,
                                name=f"nbtrain-knob-slider-{name}")
                slider.on_change("value", _follow(field))
                self.sliders[name] = slider
                widgets.append(slider)
            rows.append(row(*widgets))
        self.layout.children = [*rows, row(self.apply), self.note]

    def _changed(self) -> dict[str, float]:
        out = {}
        for name, field in self.inputs.items():
            value = field.value
            if isinstance(value, int | float) and math.isfinite(float(value)) \
                    and float(value) != self.values.get(name):
                out[name] = float(value)
        return out

    def send(self) -> None:
        """Send the knobs whose input differs from the value in force (the button)."""
        values = self._changed()
        if not values:
            self.note.text = "<i>no knob changed</i>"
            return
        self._act("set", {"values": values, "who": "job page"})

    def _show_values(self) -> None:
        if not self.specs:
            text = "<i>knobs: listed when the job's ranks start training</i>"
        else:
            text = "knobs in force: " + ", ".join(
                f"{s.get('name')}={self.values.get(str(s.get('name')), math.nan):.4g}"
                for s in self.specs)
        if self.note.text != text:
            self.note.text = text
