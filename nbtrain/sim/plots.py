"""Bokeh figures of simulated runs and placements, for the CLI's ``--plot`` and the notebooks.

Bokeh is imported inside the functions so the simulator itself needs only numpy.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nbtrain.core.topology import Topology
from nbtrain.sim.ledger import SimResult

__all__ = ["placement_figure", "report_layout", "save_report", "utilization_figure",
           "wait_cdf_figure"]

_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
)


def _color(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]


def utilization_figure(results: Mapping[str, SimResult], capacity: int) -> Any:
    """Slots in running gangs over time per policy (dashed: slots held by incomplete gangs)."""
    from bokeh.plotting import figure

    fig = figure(title="Slots doing work (complete gangs only)", height=300, width=760,
                 x_axis_label="hours", y_axis_label="fraction of slots")
    for i, (name, res) in enumerate(results.items()):
        if not res.timeline:
            continue
        tl = np.asarray(res.timeline, dtype=float)
        t = tl[:, 0] / 3600
        fig.step(t, tl[:, 1] / capacity, mode="after", color=_color(i), legend_label=name)
        if tl[:, 2].any():
            fig.step(t, tl[:, 2] / capacity, mode="after", color=_color(i), line_dash="dashed",
                     legend_label=f"{name}: held by incomplete gangs")
    fig.legend.location = "bottom_right"
    fig.legend.click_policy = "hide"
    return fig


def wait_cdf_figure(results: Mapping[str, SimResult]) -> Any:
    """Cumulative distribution of queueing delay per policy."""
    from bokeh.plotting import figure

    fig = figure(title="Queueing delay", height=300, width=760, x_axis_type="log",
                 x_axis_label="wait (hours, log)", y_axis_label="fraction of jobs")
    for i, (name, res) in enumerate(results.items()):
        waits = np.sort([j["wait"] for j in res.jobs.values() if "wait" in j])
        if waits.size == 0:
            continue
        x = np.maximum(waits / 3600, 1e-3)
        y = np.arange(1, waits.size + 1) / waits.size
        fig.step(x, y, mode="after", color=_color(i), legend_label=name)
    fig.legend.location = "bottom_right"
    return fig


def placement_figure(
    topology: Topology,
    owners: Sequence[Hashable | None],
    *,
    title: str = "Placement",
    width: int = 420,
) -> Any:
    """Hosts as rows, slots as cells, coloured by the job holding them; leaf switches drawn as
    bands. ``owners[i]`` is the job on slot index ``i`` (``Scheduler.owners()``)."""
    from bokeh.models import ColumnDataSource, HoverTool, Range1d
    from bokeh.plotting import figure

    hb = topology.bounds["host"]
    host = topology.dom["host"]
    col = np.arange(topology.n_slots) - hb[host]
    jobs = sorted({o for o in owners if o is not None}, key=str)
    color_of = {j: _color(i) for i, j in enumerate(jobs)}
    src = ColumnDataSource({
        "x": col.tolist(),
        "y": host.tolist(),
        "color": [color_of[o] if o is not None else "#eeeeee" for o in owners],
        "job": ["free" if o is None else str(o) for o in owners],
        "slot": [str(s) for s in topology.slot_ids],
        "leaf": topology.dom["leaf"].tolist(),
        "nvlink": topology.dom["nvlink"].tolist(),
    })
    n_hosts = len(hb) - 1
    fig = figure(title=title, width=width, height=max(160, 18 * n_hosts + 60),
                 y_range=Range1d(start=n_hosts - 0.5, end=-0.5), x_axis_label="slot in host",
                 y_axis_label="host", tools="", toolbar_location=None)
    leaf_of_host = topology.dom["leaf"][hb[:-1]]
    for leaf in range(topology.n_domains["leaf"]):
        rows = np.flatnonzero(leaf_of_host == leaf)
        fig.quad(left=-0.6, right=float(col.max()) + 0.6, top=rows[0] - 0.5,
                 bottom=rows[-1] + 0.5, fill_alpha=0.0, line_color="#555555",
                 line_dash="dotted")
    cells = fig.rect("x", "y", 0.9, 0.8, source=src, color="color", line_color="#999999")
    fig.add_tools(HoverTool(renderers=[cells], tooltips=[
        ("slot", "@slot"), ("job", "@job"), ("leaf", "@leaf"), ("NVLink domain", "@nvlink"),
    ]))
    fig.grid.visible = False
    return fig


def report_layout(results: Mapping[str, SimResult], capacity: int) -> Any:
    from bokeh.layouts import column

    return column(utilization_figure(results, capacity), wait_cdf_figure(results))


def save_report(results: Mapping[str, SimResult], capacity: int, path: str | Path) -> Path:
    """Write the figures to one self-contained HTML file (Bokeh JS inlined, works offline)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    html = file_html(report_layout(results, capacity), INLINE, "nbtrain simulate")
    out = Path(path)
    out.write_text(html, encoding="utf-8")
    return out
