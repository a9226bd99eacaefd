"""The cluster's slots as plot columns and a Bokeh figure: boxes by host (and NVLink
domain), coloured by job and state. Pure pieces (Bokeh only, imported when a figure is made;
no ipywidgets), shared by the widget (:mod:`nbtrain.ui.cluster_view`) and the class page
(:mod:`nbtrain.ui.clusterpage`) that the scheduler serves.
"""

from __future__ import annotations

from typing import Any

__all__ = ["fit_slot_figure", "slot_columns", "slot_figure", "slot_figure_height"]

FREE_COLOUR = "#e8e8e8"
RESTARTING_COLOUR = "#777777"
_JOB_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                "#17becf", "#bcbd22", "#7f7f7f")
#: How strongly a slot is filled by its job's state: solid while training, pale otherwise.
_STATE_ALPHA = {"RUNNING": 0.95, "STARTING": 0.5, "STOPPING": 0.5}


def slot_columns(snap: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Plot columns for every slot of a cluster snapshot (``Cluster.snapshot()``), and its
    jobs."""
    jobs: list[dict[str, Any]] = list(snap["jobs"])
    by_id = {j["job_id"]: j for j in jobs}
    colours = {j["job_id"]: _JOB_PALETTE[i % len(_JOB_PALETTE)] for i, j in enumerate(jobs)}
    cols: dict[str, Any] = {k: [] for k in ("x", "group", "address", "host", "domain",
                                                  "job", "state", "colour", "alpha", "label",
                                                  "text_colour")}
    groups: dict[tuple[str, str], int] = {}
    slots = sorted(snap["slots"], key=lambda s: (s["host"], _domain(s), s["slot"]))
    for slot in slots:
        if slot["state"] == "offline":
            continue
        domain = _domain(slot)
        key = (str(slot["host"]), domain)
        index = groups.get(key, 0)
        groups[key] = index + 1
        job = by_id.get(slot["job"]) if slot["job"] else None
        if job is not None:
            state = job["state"]
            name, colour, alpha = job["name"], colours[job["job_id"]], _STATE_ALPHA.get(state,
                                                                                         0.3)
        elif slot["state"] == "restarting":
            state, name, colour, alpha = "RESTARTING", "(restarting)", RESTARTING_COLOUR, 0.8
        else:
            state, name, colour, alpha = "free", "free", FREE_COLOUR, 1.0
        cols["x"].append(index)
        cols["group"].append(_group_label(key))
        cols["address"].append(slot["address"] or slot["slot"])
        cols["host"].append(key[0])
        cols["domain"].append(domain)
        cols["job"].append(name)
        cols["state"].append(state)
        cols["colour"].append(colour)
        cols["alpha"].append(alpha)
        cols["label"].append(name if len(name) <= 12 else name[:11] + "…")
        cols["text_colour"].append("white" if job is not None and alpha > 0.9 else "#222")
    return cols, jobs


def slot_figure(source: Any, *, title: str, groups: Any = (), height: int, width: int,
                x_end: float) -> Any:
    """Slots as boxes, one row per host (NVLink domain), coloured and labelled by job; hover
    names the slot, host, domain, job and state. ``source`` holds :func:`slot_columns`."""
    from bokeh.models import FactorRange, HoverTool, Range1d
    from bokeh.plotting import figure

    fig = figure(title=title, y_range=FactorRange(*groups), height=height, width=width,
                 tools="", toolbar_location=None, x_range=Range1d(start=-0.5, end=x_end))
    fig.rect(x="x", y="group", width=0.92, height=0.8, source=source,
             fill_color="colour", fill_alpha="alpha", line_color="#555")
    fig.text(x="x", y="group", text="label", source=source, text_align="center",
             text_baseline="middle", text_font_size="8pt", text_color="text_colour")
    fig.add_tools(HoverTool(tooltips=[("slot", "@address"), ("host", "@host"),
                                      ("domain", "@domain"), ("job", "@job"),
                                      ("state", "@state")]))
    fig.xaxis.visible = False
    fig.xgrid.grid_line_color = None
    fig.ygrid.grid_line_color = None
    return fig


def fit_slot_figure(fig: Any, cols: dict[str, Any]) -> None:
    """One row per host (domain) of ``cols`` and room for its widest row; a figure that
    already fits is left alone (nothing is sent to the browser)."""
    groups = sorted(set(cols["group"]))
    if list(fig.y_range.factors) != groups:
        fig.y_range.factors = groups
        fig.height = slot_figure_height(len(groups))
    width = max([4, *(x + 1 for x in cols["x"])])
    if fig.x_range.end != width - 0.5:
        fig.x_range.end = width - 0.5


def _domain(slot: dict[str, Any]) -> str:
    """The slot's NVLink domain label when it is not simply its host."""
    nvlink = str(slot.get("nvlink") or "")
    return "" if nvlink in ("", str(slot.get("host"))) else nvlink


def _group_label(key: tuple[str, str]) -> str:
    host, domain = key
    return f"{host} / {domain}" if domain else host


def slot_figure_height(groups: int) -> int:
    """The figure's height in pixels for ``groups`` rows of slots."""
    return 70 + 34 * max(groups, 1)
