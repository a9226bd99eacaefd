"""The class view's "cluster goodput over time": the controller's bounded goodput series
(:mod:`nbtrain.core.clustergoodput`) as a Bokeh time series.

Two lines over wall-clock time: the share of the cluster's online slot-time that trained
productively in each period (solid), and the share of online slots some job held (dashed):
the gap between them is slot-time held while starting, recovering, blocked on checkpoints
or computing steps later lost. The hover adds the online slots and the summed speedup of the
goodput-sized jobs at their sizes. :meth:`GoodputPlot.update` redraws only when the series
took a new sample (one per period: 30 s by default), so the page's fast refresh costs
nothing here.
"""

from __future__ import annotations

from typing import Any

from bokeh.models import ColumnDataSource, HoverTool, NumeralTickFormatter, Range1d
from bokeh.plotting import figure

from nbtrain.core.clustergoodput import ClusterGoodputSeries
from nbtrain.core.teamshare import duration

__all__ = ["GoodputPlot"]

_TOOLS = "pan,box_zoom,wheel_zoom,reset,save"  # the pages' other plots' tools


class GoodputPlot:
    """The figure ``nbtrain-cluster-goodput`` over the source ``cluster-goodput`` (columns
    ``time`` in ms since the epoch, ``share``, ``held``, ``online``, ``speedup``)."""

    def __init__(self, series: ClusterGoodputSeries, *, width: int = 900,
                 height: int = 200) -> None:
        self.series = series
        every = series.settings
        span = duration(every.period_s * every.max_points)
        self.source = ColumnDataSource({k: [] for k in ("time", "share", "held", "online",
                                                        "speedup")}, name="cluster-goodput")
        fig: Any = figure(
            title=(f"cluster goodput: productive share of the online slot-time (a point every "
                   f"{duration(every.period_s)}, the last {span})"),
            width=width, height=height, tools=_TOOLS, toolbar_location="above",
            x_axis_type="datetime", y_range=Range1d(start=0.0, end=1.05),
            name="nbtrain-cluster-goodput")
        fig.toolbar.autohide = True
        fig.title.text_font_size = "10pt"
        fig.yaxis.formatter = NumeralTickFormatter(format="0%")
        share = fig.line("time", "share", source=self.source, color="#2ca02c", line_width=2,
                         legend_label="productive")
        fig.line("time", "held", source=self.source, color="#777777", line_dash="dashed",
                 legend_label="slots held")
        fig.legend.location = "bottom_left"
        fig.legend.orientation = "horizontal"
        fig.legend.label_text_font_size = "8pt"
        fig.legend.padding = 2
        fig.add_tools(HoverTool(renderers=[share], mode="vline", tooltips=[
            ("at", "@time{%H:%M:%S}"), ("productive", "@share{0%}"), ("held", "@held{0%}"),
            ("online slots", "@online"), ("speedup of goodput-sized jobs", "@speedup{0.00}")],
            formatters={"@time": "datetime"}))
        self.figure = fig
        self._drawn: int | None = None

    def update(self) -> bool:
        """Redraw from the series if it took a sample since the last draw."""
        if self.series.taken == self._drawn:
            return False
        self._drawn = self.series.taken
        cols = self.series.columns()
        cols["time"] = [1e3 * t for t in cols["time"]]  # Bokeh's datetime axis: ms
        self.source.data = dict(cols)
        return True
