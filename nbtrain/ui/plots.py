"""The Bokeh plots of a job: per-rank step time, phase split, loss and throughput.

Each plot owns its ``ColumnDataSource`` and takes step rows in batches (``add(rows)``), so
the plot's memory and the browser's work stay bounded however long the job runs:

- step times show a recent window per rank (``stream`` with ``rollover``);
- loss and throughput cover the whole run: every point until ``max_points``, then every
  second one, then every fourth... (:class:`WholeRun`), so the start of a long run stays;
- times are in milliseconds.

The live views feed them a few times a second; the HTML report feeds them the whole history
once. Same code, same pictures.

A step row is the JobHandle's tuple ``nbtrain.core.records.JOB_ROW_COLUMNS`` followed by the
metrics dict.

Generations: a line never joins the last step of one generation to the first of the next (a
restart resumes from its checkpoint, a resize changes the ranks): a NaN point breaks it there,
and :class:`GenerationMarks` draws a dashed line at each new generation, with what started it
on hover.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from bokeh.layouts import column
from bokeh.models import (
    AdaptiveTicker,
    ColumnDataSource,
    CustomJS,
    HoverTool,
    LinearColorMapper,
)
from bokeh.models.annotations import ColorBar
from bokeh.models.widgets.groups import RadioButtonGroup
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


#: Phases and their labels in the phase selector; each is a column of milliseconds
#: ``<phase>_ms`` in the step-time plot. "step" is the whole step.
PHASES: dict[str, str] = {"step": "total", "data": "data", "compute": "compute",
                          "comm": "comm", "opt": "opt"}
_PHASE_INDEX = {"step": STEP_S, "data": DATA_S, "compute": COMPUTE_S, "comm": COMM_S,
                "opt": OPT_S}
#: Stacked parts of the phase-split bars (what is not data/compute/comm/opt is "other").
SPLIT_PARTS = ("data_ms", "compute_ms", "comm_ms", "opt_ms", "other_ms")
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
    palette = Category10[10]
    return palette[rank % len(palette)]


def _ms(row: Row, phase: str) -> float:
    return 1e3 * float(row[_PHASE_INDEX[phase]])


class StepTimePlot:
    """Per-rank step time in ms: one line per rank for few ranks, a rank x step heatmap for
    many. ``phase`` selects which column is drawn ("step" for the whole step, or one phase).
    ``window_steps`` recent steps per rank are kept (heatmap: at most ``max_points`` cells).
    """

    def __init__(self, world_size: int, *, lines_max_ranks: int = 8, window_steps: int = 600,
                 max_points: int = 20_000, width: int = 520, height: int = 260) -> None:
        self.world_size = world_size
        self.mode = "lines" if world_size <= lines_max_ranks else "heatmap"
        self.phase = "step"
        self.window_steps = window_steps
        self.max_points = max_points
        self.points_streamed = 0
        self.figure = _figure("step time per rank (total)", width, height,
                              x_axis_label="step", y_axis_label="ms")
        self.sources: dict[int, ColumnDataSource] = {}
        self._renderers: dict[int, Any] = {}
        self._slow: set[int] = set()
        self._last_gen: dict[int, int] = {}
        tips = [("rank", "@rank"), ("step", "@step"), ("generation", "@generation"),
                *((label, f"@{{{p}_ms}}{{0.00}} ms") for p, label in PHASES.items())]
        if self.mode == "heatmap":
            self.figure.yaxis.axis_label = "rank"
            self.mapper = LinearColorMapper(palette=Viridis256, low=0.0, high=1.0)
            self.heat = ColumnDataSource(self._empty(), name="steptime-heatmap")
            self._heat_renderer = self.figure.rect(
                x="step", y="rank", width=1, height=1, source=self.heat, line_color=None,
                fill_color=transform("step_ms", self.mapper))
            self.figure.add_layout(ColorBar(color_mapper=self.mapper, width=8,
                                            title="ms"), "right")
            self.figure.add_tools(HoverTool(tooltips=tips))
            self.figure.x_range.renderers = [self._heat_renderer]
            self._recent: deque[float] = deque(maxlen=max(1000, 50 * world_size))
        else:
            for rank in range(world_size):
                self._line_for(rank)
            self.figure.add_tools(HoverTool(tooltips=tips,
                                            renderers=list(self._renderers.values())))
            _legend_below(self.figure)
            self.figure.legend.click_policy = "hide"

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {"step": [], "rank": [], "generation": [], **{f"{p}_ms": [] for p in PHASES}}

    def _line_for(self, rank: int) -> ColumnDataSource:
        src = self.sources.get(rank)
        if src is None:
            src = ColumnDataSource(self._empty(), name=f"steptime-r{rank}")
            self.sources[rank] = src
            self._renderers[rank] = self.figure.line(
                x="step", y=f"{self.phase}_ms", source=src, color=rank_colour(rank),
                line_width=1.5, legend_label=f"rank {rank}", name=f"rank {rank}")
            # the x axis spans the recent steps only (not the generation marks of old ones)
            self.figure.x_range.renderers = list(self._renderers.values())
            hover = [t for t in self.figure.tools if isinstance(t, HoverTool)]
            if hover and isinstance(hover[0].renderers, list):
                hover[0].renderers = [*hover[0].renderers, self._renderers[rank]]
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
            for phase in PHASES:
                cols[f"{phase}_ms"].append(_ms(row, phase))
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
            self._recent.extend(merged[f"{self.phase}_ms"])
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
            high = low + 1e-3
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
        column = f"{phase}_ms"
        if self.mode == "heatmap":
            self._heat_renderer.glyph.fill_color = transform(column, self.mapper)
            self._recent.clear()
            values: Any = self.heat.data[column]
            self._recent.extend(float(v) for v in values)
            self.mapper.update(low=0.0, high=1.0)
            self._rescale()
        else:
            for renderer in self._renderers.values():
                renderer.glyph.y = column

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
    """Mean time per phase (ms) for each rank over its last ``window`` steps, as stacked
    bars: a slow rank's bar is taller, and its colours say where the time goes."""

    def __init__(self, *, window: int = 50, width: int = 300, height: int = 260) -> None:
        self.window = window
        self._recent: dict[int, deque[tuple[float, ...]]] = {}
        self.source = ColumnDataSource({"rank": [], **{p: [] for p in SPLIT_PARTS}},
                                       name="phase-split")
        self.figure = _figure(f"phase split (mean of last {window} steps)", width, height,
                              x_axis_label="rank", y_axis_label="ms")
        bars = self.figure.vbar_stack(list(SPLIT_PARTS), x="rank", width=0.8,
                                      source=self.source, color=list(SPLIT_COLOURS),
                                      legend_label=[p[:-3] for p in SPLIT_PARTS])
        self.figure.add_tools(HoverTool(renderers=bars, tooltips=[
            ("rank", "@rank"), *((p[:-3], f"@{{{p}}}{{0.00}} ms") for p in SPLIT_PARTS)]))
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
            buf.append(tuple(1e3 * float(row[i]) for i in (STEP_S, DATA_S, COMPUTE_S, COMM_S,
                                                            OPT_S)))
            changed = True
        if changed:
            ranks = sorted(self._recent)
            means = np.array([np.mean(np.array(self._recent[r]), axis=0) for r in ranks])
            other = np.maximum(means[:, 0] - means[:, 1:].sum(axis=1), 0.0)
            self.source.data = {
                "rank": ranks, "data_ms": means[:, 1].tolist(),
                "compute_ms": means[:, 2].tolist(), "comm_ms": means[:, 3].tolist(),
                "opt_ms": means[:, 4].tolist(), "other_ms": other.tolist(),
            }
        return changed


class WholeRun:
    """A line's points over the whole run in bounded memory: every point until
    ``max_points``, then every second one kept (and only every second new one taken), then
    every fourth... NaN points (generation breaks) are always kept."""

    def __init__(self, source: ColumnDataSource, y: str, max_points: int) -> None:
        self.source = source
        self.y = y
        self.max_points = max(8, max_points)
        self.stride = 1
        self._seen = 0
        self.data: dict[str, list[Any]] = {str(k): [] for k in source.data}

    def add(self, cols: dict[str, list[Any]]) -> None:
        n = len(cols[self.y])
        if not n:
            return
        keep = []
        for i in range(n):
            nan = isinstance(cols[self.y][i], float) and math.isnan(cols[self.y][i])
            if nan or self._seen % self.stride == 0:
                keep.append(i)
            if not nan:
                self._seen += 1
        new = {k: [v[i] for i in keep] for k, v in cols.items()}
        for k, v in new.items():
            self.data[k].extend(v)
        if len(self.data[self.y]) <= self.max_points:
            self.source.stream(dict(new))
            return
        while len(self.data[self.y]) > self.max_points // 2 and self.stride < 1 << 30:
            self.stride *= 2
            ys = self.data[self.y]
            kept = [i for i, v in enumerate(ys)
                    if (isinstance(v, float) and math.isnan(v)) or i % 2 == 0]
            self.data = {k: [v[i] for i in kept] for k, v in self.data.items()}
        self.source.data = {k: list(v) for k, v in self.data.items()}


#: The y-axis scales a metric plot offers, in the order of its toggle's buttons.
SCALES = ("linear", "log")

#: Runs in the browser (served page, widget and the standalone report alike): show the
#: figure of the chosen scale, hide the other.
_SCALE_JS = "linear.visible = cb_obj.active == 0; log.visible = cb_obj.active == 1;"


class MetricPlot:
    """One scalar from rank 0's metrics (e.g. the loss) against the step, over the whole
    run (:class:`WholeRun`, ``window`` points at most), on a linear or a log y axis.

    A loss falls by orders of magnitude, so on a linear axis it is a flat line at the
    bottom after the first few dozen steps: ``scale="log"`` (the default) draws it on a log
    axis. Both figures share one source and one x range; the toggle (``scale_toggle``, in
    ``view``) shows one of them, in the browser, so it works in a static report too. A
    value <= 0 cannot sit on a log axis: the first one switches the plot to linear, unless
    the viewer has chosen the scale on the toggle."""

    def __init__(self, key: str, *, window: int = 2000, width: int = 420,
                 height: int = 220, scale: str = "log") -> None:
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
        self.key = key
        self.window = window
        self._last_gen: dict[int, int] = {}
        self.source = ColumnDataSource({"step": [], "value": [], "generation": []},
                                       name=f"metric-{key}")
        self.run = WholeRun(self.source, "value", window)
        self.figure = _figure(key, width, height, x_axis_label="step",
                              name=f"metric-{key}-linear")
        self.log_figure = _figure(f"{key} (log scale)", width, height, x_axis_label="step",
                                  y_axis_type="log", x_range=self.figure.x_range,
                                  name=f"metric-{key}-log")
        for fig in self.figures:
            line = fig.line(x="step", y="value", source=self.source, color="#d62728",
                            line_width=1.5)
            fig.add_tools(HoverTool(renderers=[line], tooltips=[
                ("step", "@step"), ("generation", "@generation"), (key, "@value{0.0000}")]))
        self.scale_toggle = RadioButtonGroup(labels=list(SCALES), active=SCALES.index(scale),
                                             name=f"metric-{key}-scale", width=140)
        self.scale_toggle.js_on_change("active", CustomJS(
            args={"linear": self.figure, "log": self.log_figure}, code=_SCALE_JS))
        self._shown = scale  # what this plot last chose (the viewer may have chosen since)
        self._show(scale)
        self.view = column(self.scale_toggle, self.figure, self.log_figure,
                           name=f"metric-{key}-view")

    @property
    def figures(self) -> tuple[Any, Any]:
        """The linear and the log figure (marks go on both)."""
        return (self.figure, self.log_figure)

    @property
    def scale(self) -> str:
        """The scale shown now (the toggle's, so also the viewer's choice on a served page)."""
        return SCALES[int(self.scale_toggle.active or 0)]

    def set_scale(self, scale: str) -> None:
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
        self._shown = scale
        self._show(scale)

    def _show(self, scale: str) -> None:
        index = SCALES.index(scale)
        if self.scale_toggle.active != index:
            self.scale_toggle.active = index
        for fig, visible in ((self.figure, index == 0), (self.log_figure, index == 1)):
            if fig.visible != visible:
                fig.visible = visible

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
        # the viewer's own choice (the toggle moved since this plot last set it) is kept
        if (self._shown == "log" and self.scale == "log"
                and any(v <= 0 for v in cols["value"])):
            self.set_scale("linear")
        self.run.add(cols)
        return len(cols["step"])


class ThroughputPlot:
    """Rank 0's steps per second over a sliding window of ``span`` steps (rank 0 reports
    every step, and all ranks of a gang step together), over the whole run."""

    def __init__(self, *, span: int = 20, window: int = 2000, width: int = 420,
                 height: int = 220) -> None:
        self.window = window
        self._times: deque[float] = deque(maxlen=span)
        self._gen: int | None = None
        self.source = ColumnDataSource({"step": [], "steps_per_s": [], "generation": []},
                                       name="throughput")
        self.run = WholeRun(self.source, "steps_per_s", window)
        self.figure = _figure("throughput", width, height, x_axis_label="step",
                              y_axis_label="steps/s")
        line = self.figure.line(x="step", y="steps_per_s", source=self.source,
                                color="#17becf", line_width=1.5)
        self.figure.add_tools(HoverTool(renderers=[line], tooltips=[
            ("step", "@step"), ("generation", "@generation"),
            ("steps/s", "@steps_per_s{0.0}")]))
        self.latest: float | None = None

    def add(self, rows: Iterable[Row]) -> int:
        cols: dict[str, Any] = {"step": [], "steps_per_s": [], "generation": []}
        for row in rows:
            if int(row[RANK]) != 0:
                continue
            gen = int(row[GEN])
            if self._gen != gen:  # a restart: do not count the gap as slowness
                if self._gen is not None:  # and do not join the lines
                    cols["step"].append(int(row[STEP]))
                    cols["steps_per_s"].append(math.nan)
                    cols["generation"].append(gen)
                self._gen = gen
                self._times.clear()
            self._times.append(float(row[TIME]))
            if len(self._times) >= 2:
                span = self._times[-1] - self._times[0]
                if span > 0:
                    rate = (len(self._times) - 1) / span
                    cols["step"].append(int(row[STEP]))
                    cols["steps_per_s"].append(rate)
                    cols["generation"].append(gen)
                    self.latest = rate
        self.run.add(cols)
        return len(cols["step"])


class GenerationMarks:
    """A dashed vertical line on each figure at the first step of every new generation,
    coloured and described by what started it: a resize ("2→1 ranks", purple), a restart
    after a fault (orange, with its cause), a resume after a preemption (grey). Hover shows
    the description. At most ``keep`` marks (the oldest go)."""

    COLOURS = {"resize": "#9467bd", "restart": "#ff7f0e", "resume": "#7f7f7f"}

    def __init__(self, figures: Sequence[Any], *, keep: int = 200) -> None:
        self.keep = keep
        self._gen: int | None = None
        self.source = ColumnDataSource({"x": [], "step": [], "generation": [], "kind": [],
                                        "label": [], "colour": []}, name="generation-marks")
        for fig in figures:
            spans = fig.vspan(x="x", source=self.source, line_color="colour",
                              line_dash="dashed", line_width=1.5)
            fig.add_tools(HoverTool(renderers=[spans], tooltips=[
                ("generation", "@generation"), ("from step", "@step"), ("", "@label")]))

    @property
    def marks(self) -> list[tuple[int, int, str]]:
        data = self.source.data
        return list(zip(data["generation"], data["step"], data["label"], strict=True))

    def add(self, rows: Iterable[Row], describe: Callable[[int], tuple[str, str]]) -> int:
        """Mark the new generations among rank 0's ``rows``; ``describe(generation)`` gives
        ``(kind, label)``. Returns how many marks were added."""
        new: dict[str, list[Any]] = {str(k): [] for k in self.source.data}
        for row in rows:
            if int(row[RANK]) != 0:
                continue
            gen = int(row[GEN])
            if self._gen is not None and gen != self._gen:
                kind, label = describe(gen)
                step = int(row[STEP])
                for key, value in (("x", step - 0.5), ("step", step), ("generation", gen),
                                   ("kind", kind), ("label", label),
                                   ("colour", self.COLOURS.get(kind, "#7f7f7f"))):
                    new[key].append(value)
            self._gen = gen
        if new["x"]:
            self.source.stream(dict(new), rollover=self.keep)
        return len(new["x"])


class KnobMarks:
    """A dotted green vertical line on each figure where live knob changes took effect (the
    step after the one every rank applied them at), with what changed and who changed it on
    hover. Fed with the job's ``knob_applied`` events; at most ``keep`` marks."""

    COLOUR = "#2ca02c"

    def __init__(self, figures: Sequence[Any], *, keep: int = 200) -> None:
        self.keep = keep
        self.source = ColumnDataSource({"x": [], "step": [], "label": []}, name="knob-marks")
        for fig in figures:
            spans = fig.vspan(x="x", source=self.source, line_color=self.COLOUR,
                              line_dash="dotted", line_width=1.5)
            fig.add_tools(HoverTool(renderers=[spans], tooltips=[
                ("knobs from step", "@step"), ("", "@label")]))

    @property
    def marks(self) -> list[tuple[int, str]]:
        return list(zip(self.source.data["step"], self.source.data["label"], strict=True))

    def add(self, events: Iterable[Mapping[str, Any]]) -> int:
        """Mark the ``knob_applied`` events among ``events``; returns how many."""
        new: dict[str, list[Any]] = {"x": [], "step": [], "label": []}
        for ev in events:
            if ev.get("kind") != "knob_applied" or not isinstance(ev.get("step"), int):
                continue
            parts = []
            for change in ev.get("changes") or ():
                values = ", ".join(f"{k}={v:.4g}" for k, v in
                                   (change.get("values") or {}).items()
                                   if isinstance(v, int | float))
                ramp = f" over {change['ramp']} steps" if change.get("ramp") else ""
                parts.append(f"{values}{ramp} by {change.get('who') or '?'}")
            step = int(ev["step"]) + 1
            new["x"].append(step - 0.5)
            new["step"].append(step)
            new["label"].append("; ".join(parts))
        if new["x"]:
            self.source.stream(dict(new), rollover=self.keep)
        return len(new["x"])


def feed_plots(rows: Sequence[Row], plots: Sequence[Any], marks: GenerationMarks,
               describe: Callable[[int], tuple[str, str]]) -> int:
    """Stream ``rows`` into each of a job view's plots and its generation marks (the widget
    and the served page draw the same way); returns how many rows were drawn."""
    for plot in plots:
        plot.add(rows)
    marks.add(rows, describe)
    return len(rows)
