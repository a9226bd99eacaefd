"""The Bokeh plots of a job: per-rank step time, phase split, loss and throughput.

Each plot owns its ``ColumnDataSource`` and takes step rows in batches (``add(rows)``): one
``stream`` (or one data replacement) per plot per call, with ``rollover`` so the plot's memory
and the browser's work stay bounded however long the job runs. The live dashboard feeds them
a few times a second; the HTML report feeds them the whole history once. Same code, same
pictures.

A step row is the JobHandle's tuple ``nbtrain.core.records.JOB_ROW_COLUMNS`` followed by the
metrics dict.

Generations: a line never joins the last step of one generation to the first of the next (a
restart resumes from its checkpoint, a resize changes the ranks): a NaN point breaks it there,
and :class:`GenerationMarks` draws a dashed line at each new generation with what it was.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from bokeh.models import AdaptiveTicker, ColumnDataSource, HoverTool, LinearColorMapper
from bokeh.models.annotations import ColorBar, Label, Span
from bokeh.palettes import Category10, Viridis256
from bokeh.plotting import figure
from bokeh.transform import transform

from nbtrain.core.records import (
    COMM_S,
    COMPUTE_S,
    DATA_S,
    GEN,
    METRICS,
    OPT_S,
    RANK,
    STEP,
    STEP_S,
    TIME,
)

Row = Sequence[Any]


#: Phase columns and their labels in the phase selector. "total" is the whole step.
PHASES: dict[str, str] = {"step_s": "total", "data_s": "data", "compute_s": "compute",
                          "comm_s": "comm", "opt_s": "opt"}
_PHASE_INDEX = {"step_s": STEP_S, "data_s": DATA_S, "compute_s": COMPUTE_S, "comm_s": COMM_S,
                "opt_s": OPT_S}
#: Stacked parts of the phase-split bars (what is not data/compute/comm/opt is "other").
SPLIT_PARTS = ("data_s", "compute_s", "comm_s", "opt_s", "other_s")
SPLIT_COLOURS = ("#8c6bb1", "#1f77b4", "#ff7f0e", "#2ca02c", "#bbbbbb")

_TOOLS = "pan,box_zoom,wheel_zoom,reset,save"


def _figure(title: str, width: int, height: int, **kwargs: Any) -> Any:
    fig: Any = figure(title=title, width=width, height=height, tools=_TOOLS,
                 toolbar_location="above", **kwargs)
    fig.toolbar.autohide = True
    fig.title.text_font_size = "11pt"
    return fig


def _legend_below(fig: Any) -> None:
    """A compact horizontal legend under the plot, where it never hides data."""
    legend = fig.legend[0]
    legend.orientation = "horizontal"
    legend.label_text_font_size = "8pt"
    legend.spacing = 4
    legend.padding = 2
    legend.margin = 2
    legend.glyph_width = 14
    legend.label_standoff = 3
    fig.center = [r for r in fig.center if r is not legend]
    fig.add_layout(legend, "below")


def _break_lines(cols: dict[str, list[Any]], last_gen: dict[int, int], key: int, gen: int,
                 step: int) -> None:
    """Before the first point of a new generation of line ``key``, a NaN point at its step:
    Bokeh breaks the line there."""
    if last_gen.get(key, gen) != gen:
        fixed = {"step": step, "generation": gen, "rank": key}
        for name, values in cols.items():
            values.append(fixed.get(name, math.nan))
    last_gen[key] = gen


def rank_colour(rank: int) -> str:
    return str(Category10[10][rank % 10])


class StepTimePlot:
    """Per-rank step time: one line per rank for few ranks, a rank x step heatmap for many.

    ``phase`` selects which column is drawn ("step_s" for the whole step, or one phase).
    ``window_steps`` recent steps per rank are kept (heatmap: at most ``max_points`` cells).
    """

    def __init__(self, world_size: int, *, lines_max_ranks: int = 8, window_steps: int = 600,
                 max_points: int = 20_000, width: int = 520, height: int = 260) -> None:
        self.world_size = world_size
        self.mode = "lines" if world_size <= lines_max_ranks else "heatmap"
        self.phase = "step_s"
        self.window_steps = window_steps
        self.max_points = max_points
        self.points_streamed = 0
        self.figure = _figure("step time per rank (total)", width, height,
                              x_axis_label="step", y_axis_label="seconds")
        self.sources: dict[int, ColumnDataSource] = {}
        self._renderers: dict[int, Any] = {}
        self._slow: set[int] = set()
        self._last_gen: dict[int, int] = {}
        if self.mode == "heatmap":
            self.figure.yaxis.axis_label = "rank"
            self.mapper = LinearColorMapper(palette=Viridis256, low=0.0, high=1.0)
            self.heat = ColumnDataSource(self._empty(), name="steptime-heatmap")
            self._heat_renderer = self.figure.rect(
                x="step", y="rank", width=1, height=1, source=self.heat, line_color=None,
                fill_color=transform("step_s", self.mapper))
            self.figure.add_layout(ColorBar(color_mapper=self.mapper, width=8,
                                            title="s"), "right")
            self.figure.add_tools(HoverTool(tooltips=[("rank", "@rank"), ("step", "@step"),
                                                      ("seconds", "@step_s{0.0000}")]))
            self._recent: deque[float] = deque(maxlen=max(1000, 50 * world_size))
        else:
            self.figure.add_tools(HoverTool(tooltips=[("rank", "$name"), ("step", "@step"),
                                                      ("seconds", "$y{0.0000}")]))
            for rank in range(world_size):
                self._line_for(rank)
            _legend_below(self.figure)
            self.figure.legend.click_policy = "hide"

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {"step": [], "rank": [], "generation": [], **{p: [] for p in PHASES}}

    def _line_for(self, rank: int) -> ColumnDataSource:
        src = self.sources.get(rank)
        if src is None:
            src = ColumnDataSource(self._empty(), name=f"steptime-r{rank}")
            self.sources[rank] = src
            self._renderers[rank] = self.figure.line(
                x="step", y=self.phase, source=src, color=rank_colour(rank), line_width=1.5,
                legend_label=f"rank {rank}", name=f"rank {rank}")
        return src

    def add(self, rows: Iterable[Row]) -> int:
        """Stream ``rows`` in (one batch per source); return how many points were added."""
        by_rank: dict[int, dict[str, Any]] = {}
        for row in rows:
            rank = int(row[RANK])
            cols = by_rank.get(rank)
            if cols is None:
                cols = by_rank[rank] = self._empty()
            if self.mode == "lines":
                _break_lines(cols, self._last_gen, rank, int(row[GEN]), int(row[STEP]))
            cols["step"].append(int(row[STEP]))
            cols["rank"].append(rank)
            cols["generation"].append(int(row[GEN]))
            for name, index in _PHASE_INDEX.items():
                cols[name].append(float(row[index]))
        added = sum(len(c["step"]) for c in by_rank.values())
        if not added:
            return 0
        if self.mode == "heatmap":
            merged = self._empty()
            for cols in by_rank.values():
                for key, values in cols.items():
                    merged[key].extend(values)
            self.heat.stream(merged, rollover=min(self.max_points,
                                                  self.window_steps * self.world_size))
            self._recent.extend(merged[self.phase])
            self._rescale()
        else:
            for rank, cols in sorted(by_rank.items()):
                self._line_for(rank).stream(cols, rollover=self.window_steps)
        self.points_streamed += added
        return added

    def _rescale(self) -> None:
        """Robust colour range (2nd-98th percentile) so one slow warm-up step does not wash
        out the rest; moved only when it changed by more than 10%."""
        if not self._recent:
            return
        low, high = (float(v) for v in np.percentile(np.fromiter(self._recent, float), [2, 98]))
        if high <= low:
            high = low + 1e-6
        old_low, old_high = float(self.mapper.low or 0.0), float(self.mapper.high or 0.0)
        span = max(old_high - old_low, 1e-9)
        if abs(low - old_low) > 0.1 * span or abs(high - old_high) > 0.1 * span:
            self.mapper.update(low=low, high=high)

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
        if phase == self.phase:
            return
        self.phase = phase
        self.figure.title.text = f"step time per rank ({PHASES[phase]})"
        if self.mode == "heatmap":
            self._heat_renderer.glyph.fill_color = transform(phase, self.mapper)
            self._recent.clear()
            values: Any = self.heat.data[phase]
            self._recent.extend(float(v) for v in values)
            self.mapper.update(low=0.0, high=1.0)
            self._rescale()
        else:
            for renderer in self._renderers.values():
                renderer.glyph.y = phase

    def mark_slow(self, ranks: set[int]) -> None:
        """Draw the lines of suspected/confirmed stragglers thicker (line mode)."""
        if ranks == self._slow or self.mode != "lines":
            self._slow = set(ranks)
            return
        for rank, renderer in self._renderers.items():
            width = 4.0 if rank in ranks else 1.5
            if renderer.glyph.line_width != width:
                renderer.glyph.line_width = width
        self._slow = set(ranks)

    def point_count(self) -> int:
        """Points currently held (after rollover)."""
        if self.mode == "heatmap":
            return len(self.heat.data["step"])
        return sum(len(s.data["step"]) for s in self.sources.values())


class PhaseSplitPlot:
    """Mean time per phase for each rank over its last ``window`` steps, as stacked bars:
    a slow rank's bar is taller, and its colours say where the time goes."""

    def __init__(self, *, window: int = 50, width: int = 300, height: int = 260) -> None:
        self.window = window
        self._recent: dict[int, deque[tuple[float, ...]]] = {}
        self.source = ColumnDataSource({"rank": [], **{p: [] for p in SPLIT_PARTS}},
                                       name="phase-split")
        self.figure = _figure(f"phase split (mean of last {window} steps)", width, height,
                              x_axis_label="rank", y_axis_label="seconds")
        self.figure.vbar_stack(list(SPLIT_PARTS), x="rank", width=0.8, source=self.source,
                               color=list(SPLIT_COLOURS),
                               legend_label=[p[:-2] for p in SPLIT_PARTS])
        _legend_below(self.figure)
        self.figure.xaxis.ticker = AdaptiveTicker(min_interval=1, desired_num_ticks=8)
        self.figure.xgrid.grid_line_color = None

    def add(self, rows: Iterable[Row]) -> bool:
        changed = False
        for row in rows:
            rank = int(row[RANK])
            buf = self._recent.get(rank)
            if buf is None:
                buf = self._recent[rank] = deque(maxlen=self.window)
            buf.append((float(row[STEP_S]), float(row[DATA_S]), float(row[COMPUTE_S]),
                        float(row[COMM_S]), float(row[OPT_S])))
            changed = True
        if changed:
            ranks = sorted(self._recent)
            means = np.array([np.mean(np.array(self._recent[r]), axis=0) for r in ranks])
            other = np.maximum(means[:, 0] - means[:, 1:].sum(axis=1), 0.0)
            self.source.data = {
                "rank": ranks, "data_s": means[:, 1].tolist(), "compute_s": means[:, 2].tolist(),
                "comm_s": means[:, 3].tolist(), "opt_s": means[:, 4].tolist(),
                "other_s": other.tolist(),
            }
        return changed


class MetricPlot:
    """One scalar from rank 0's metrics (e.g. the loss) against the step."""

    def __init__(self, key: str, *, window: int = 2000, width: int = 420,
                 height: int = 220) -> None:
        self.key = key
        self.window = window
        self._last_gen: dict[int, int] = {}
        self.source = ColumnDataSource({"step": [], "value": [], "generation": []},
                                       name=f"metric-{key}")
        self.figure = _figure(key, width, height, x_axis_label="step")
        self.figure.line(x="step", y="value", source=self.source, color="#d62728",
                         line_width=1.5)
        self.figure.add_tools(HoverTool(tooltips=[("step", "@step"), (key, "@value{0.0000}")]))

    def add(self, rows: Iterable[Row]) -> int:
        cols: dict[str, Any] = {"step": [], "value": [], "generation": []}
        for row in rows:
            if int(row[RANK]) != 0 or len(row) <= METRICS or not isinstance(row[METRICS], dict):
                continue
            value = row[METRICS].get(self.key)
            if value is None:
                continue
            _break_lines(cols, self._last_gen, 0, int(row[GEN]), int(row[STEP]))
            cols["step"].append(int(row[STEP]))
            cols["value"].append(float(value))
            cols["generation"].append(int(row[GEN]))
        if cols["step"]:
            self.source.stream(cols, rollover=self.window)
        return len(cols["step"])


class ThroughputPlot:
    """Rank 0's steps per second over a sliding window of ``span`` steps (rank 0 reports
    every step, and all ranks of a gang step together)."""

    def __init__(self, *, span: int = 20, window: int = 2000, width: int = 420,
                 height: int = 220) -> None:
        self.window = window
        self._times: deque[float] = deque(maxlen=span)
        self._gen: int | None = None
        self.source = ColumnDataSource({"step": [], "steps_per_s": []}, name="throughput")
        self.figure = _figure("throughput", width, height, x_axis_label="step",
                              y_axis_label="steps/s")
        self.figure.line(x="step", y="steps_per_s", source=self.source, color="#17becf",
                         line_width=1.5)
        self.figure.add_tools(HoverTool(tooltips=[("step", "@step"),
                                                  ("steps/s", "@steps_per_s{0.0}")]))
        self.latest: float | None = None

    def add(self, rows: Iterable[Row]) -> int:
        cols: dict[str, Any] = {"step": [], "steps_per_s": []}
        for row in rows:
            if int(row[RANK]) != 0:
                continue
            if self._gen != int(row[GEN]):  # a restart: do not count the gap as slowness
                if self._gen is not None:
                    cols["step"].append(int(row[STEP]))
                    cols["steps_per_s"].append(math.nan)  # and do not join the lines
                self._gen = int(row[GEN])
                self._times.clear()
            self._times.append(float(row[TIME]))
            if len(self._times) >= 2:
                span = self._times[-1] - self._times[0]
                if span > 0:
                    rate = (len(self._times) - 1) / span
                    cols["step"].append(int(row[STEP]))
                    cols["steps_per_s"].append(rate)
                    self.latest = rate
        if cols["step"]:
            self.source.stream(cols, rollover=self.window)
        return len(cols["step"])


class GenerationMarks:
    """A dashed vertical line on each figure at the first step of every new generation,
    labelled with what started it: a resize (``"2→1 ranks"``, purple) or a restart (orange).
    At most ``keep`` marks (the oldest go)."""

    COLOURS = {"resize": "#9467bd", "restart": "#ff7f0e"}

    def __init__(self, figures: Sequence[Any], *, keep: int = 40) -> None:
        self.figures = list(figures)
        self.keep = keep
        self._gen: int | None = None
        self.marks: deque[tuple[int, int, str]] = deque()  # (generation, step, label)
        self._drawn: deque[list[Any]] = deque()

    def add(self, rows: Iterable[Row], describe: Any) -> int:
        """Mark the new generations among rank 0's ``rows``; ``describe(generation)`` gives
        ``(kind, label)``. Returns how many marks were added."""
        added = 0
        for row in rows:
            if int(row[RANK]) != 0:
                continue
            gen = int(row[GEN])
            if self._gen is not None and gen != self._gen:
                kind, label = describe(gen)
                self._mark(gen, int(row[STEP]), kind, label)
                added += 1
            self._gen = gen
        return added

    def _mark(self, gen: int, step: int, kind: str, label: str) -> None:
        colour = self.COLOURS.get(kind, "#7f7f7f")
        models = []
        for fig in self.figures:
            span = Span(location=step - 0.5, dimension="height", line_color=colour,
                        line_dash="dashed", line_width=1.5)
            text = Label(x=step - 0.5, y=4, y_units="screen", text=label, text_color=colour,
                         text_font_size="8pt", x_offset=3)
            fig.add_layout(span)
            fig.add_layout(text)
            models.append((fig, span, text))
        self.marks.append((gen, step, label))
        self._drawn.append(models)
        while len(self.marks) > self.keep:
            self.marks.popleft()
            for fig, span, text in self._drawn.popleft():
                fig.center = [m for m in fig.center if m is not span and m is not text]
