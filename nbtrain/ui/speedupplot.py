"""A goodput-sized job's fitted speedup curve and its current size on it, as a Bokeh figure.

The curve is the job status's ``speedup`` (:meth:`nbtrain.core.goodputmodel.GoodputModel.points`):
per size the job may run at, its goodput relative to the size it asked for, how far to trust
that (``confidence`` in [0, 1]) and, for sizes it ran at, the mean measured step time. Drawn:

- the fitted curve as a thin dashed line over every size, and on top of it a solid line
  whose opacity is the confidence of its two ends: where the fit is trusted the line is
  solid, where it is extrapolated (or fitted on one size only) it fades to the dashes;
- a circle per size, filled by its confidence; a diamond where the job was measured;
- the current size as a vertical line and a ringed marker (none while it holds no slots).

The hover on any point says its size, speedup, confidence and, where measured, the mean step
time and how many steps it averages. :meth:`SpeedupPlot.update` changes the sources only when
the curve or the size changed, so a page refreshing four times a second sends nothing most
of the time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bokeh.models import ColumnDataSource, HoverTool
from bokeh.models.annotations import Span
from bokeh.plotting import figure

__all__ = ["SpeedupPlot", "curve_key"]

#: Opacity of a point or segment at confidence 0 (it stays visible, faintly).
MIN_ALPHA = 0.15
_COLOUR = "#1f77b4"
_CURRENT_COLOUR = "#d62728"
_TOOLS = "pan,box_zoom,wheel_zoom,reset,save"  # the job page's other plots' tools


def _alpha(confidence: float) -> float:
    return MIN_ALPHA + (1.0 - MIN_ALPHA) * min(1.0, max(0.0, confidence))


def curve_key(points: Sequence[Mapping[str, Any]], size: int) -> tuple[Any, ...]:
    """What the figure shows of a status: equal keys draw the same picture."""
    return (tuple((float(p["size"]), float(p["speedup"]), float(p.get("confidence", 0.0)),
                   p.get("step_s"), p.get("steps")) for p in points), int(size))


class SpeedupPlot:
    """The figure "speedup by size" over the sources ``speedup-curve`` (every size),
    ``speedup-segments`` (between neighbouring sizes), ``speedup-measured`` (sizes the job
    ran at) and ``speedup-current`` (the current size, empty while it holds no slots)."""

    def __init__(self, *, width: int = 340, height: int = 260) -> None:
        self.curve = ColumnDataSource({k: [] for k in (
            "size", "speedup", "confidence", "alpha", "step_ms", "steps")}, name="speedup-curve")
        self.segments = ColumnDataSource({k: [] for k in ("x0", "y0", "x1", "y1", "alpha")},
                                         name="speedup-segments")
        self.measured = ColumnDataSource({k: [] for k in (
            "size", "speedup", "confidence", "alpha", "step_ms", "steps")},
            name="speedup-measured")
        self.current = ColumnDataSource({"size": [], "speedup": []}, name="speedup-current")
        fig: Any = figure(title="speedup by size", width=width, height=height, tools=_TOOLS,
                          toolbar_location="above", x_axis_label="ranks",
                          y_axis_label="speedup (vs. the size asked for)",
                          name="nbtrain-speedup")
        fig.toolbar.autohide = True
        fig.title.text_font_size = "11pt"
        fig.line("size", "speedup", source=self.curve, color=_COLOUR, line_dash="dashed",
                 line_alpha=0.5)
        fig.segment("x0", "y0", "x1", "y1", source=self.segments, color=_COLOUR,
                    line_width=3, line_alpha="alpha")
        fitted = fig.scatter("size", "speedup", source=self.curve, size=7, color=_COLOUR,
                             fill_alpha="alpha", line_alpha="alpha",
                             legend_label="fitted")
        measured = fig.scatter("size", "speedup", source=self.measured, marker="diamond",
                               size=13, color="#2ca02c", legend_label="measured")
        fig.scatter("size", "speedup", source=self.current, size=18, fill_alpha=0.0,
                    line_color=_CURRENT_COLOUR, line_width=2, legend_label="now")
        self.span = Span(dimension="height", line_color=_CURRENT_COLOUR, line_dash="dotted",
                         line_width=1.5, location=None, visible=False)
        fig.add_layout(self.span)
        fig.legend.location = "top_left"
        fig.legend.label_text_font_size = "8pt"
        fig.legend.padding = 2
        fig.legend.spacing = 0
        fig.add_tools(HoverTool(renderers=[fitted, measured], tooltips=[
            ("ranks", "@size"), ("speedup", "@speedup{0.00}"),
            ("confidence", "@confidence{0%}"), ("measured step", "@step_ms{0.0} ms"),
            ("steps averaged", "@steps")]))
        self.figure = fig
        self._drawn: tuple[Any, ...] | None = None

    def update(self, points: Sequence[Mapping[str, Any]], size: int) -> bool:
        """Draw ``points`` (a status's ``speedup``) with the current ``size`` marked (0: it
        holds no slots). Returns whether anything changed."""
        key = curve_key(points, size)
        if key == self._drawn:
            return False
        self._drawn = key
        pts = sorted(points, key=lambda p: float(p["size"]))
        curve = self._columns(pts)
        self.curve.data = curve
        self.measured.data = self._columns([p for p in pts if p.get("step_s") is not None])
        self.segments.data = {
            "x0": curve["size"][:-1], "y0": curve["speedup"][:-1],
            "x1": curve["size"][1:], "y1": curve["speedup"][1:],
            "alpha": [min(a, b) for a, b in zip(curve["alpha"][:-1], curve["alpha"][1:],
                                                strict=True)]}
        here = [i for i, n in enumerate(curve["size"]) if size > 0 and n == size]
        self.current.data = {"size": [curve["size"][i] for i in here],
                             "speedup": [curve["speedup"][i] for i in here]}
        self.span.location = float(size) if size > 0 else None
        self.span.visible = size > 0
        return True

    @staticmethod
    def _columns(points: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        nan = float("nan")
        confidence = [float(p.get("confidence", 0.0)) for p in points]
        return {"size": [int(p["size"]) for p in points],
                "speedup": [float(p["speedup"]) for p in points],
                "confidence": confidence, "alpha": [_alpha(c) for c in confidence],
                "step_ms": [nan if p.get("step_s") is None else 1e3 * float(p["step_s"])
                            for p in points],
                "steps": [int(p.get("steps") or 0) for p in points]}
