"""``cluster.dashboard()``: the cluster's slots by host, coloured by job and state, and the
job queue with the reason each job waits.

Same refresh model as the job dashboard (:mod:`nbtrain.ui.poller`): pulled on the kernel's
event loop at a bounded rate (one snapshot call to the cluster's controller), redrawn only
when something changed. Slots are grouped by host and, where workers declared one, by NVLink
domain.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from nbtrain.core.job import format_progress
from nbtrain.ui.display import dashboard_hz, resolve_display
from nbtrain.ui.poller import Poller

FREE_COLOUR = "#e8e8e8"
RESTARTING_COLOUR = "#777777"
_JOB_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                "#17becf", "#bcbd22", "#7f7f7f")
#: How strongly a slot is filled by its job's state: solid while training, pale otherwise.
_STATE_ALPHA = {"RUNNING": 0.95, "STARTING": 0.5, "STOPPING": 0.5}


def cluster_dashboard(cluster: Any, display: str | None = None, **options: Any) -> Any:
    """A live :class:`ClusterDashboard` widget, or a :class:`ClusterText` snapshot when the
    display mode (see :func:`~nbtrain.ui.display.resolve_display`) is text."""
    mode = resolve_display(display)
    if mode == "text":
        return ClusterText(cluster)
    if mode == "page":
        try:
            return cluster.page()
        except RuntimeError:  # no pages on this cluster: the kernel-side widget instead
            pass
    from nbtrain.ui.dashboard import ensure_bokehjs

    ensure_bokehjs()
    return ClusterDashboard(cluster, **options)


def slot_rows(cluster: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Plot columns for every slot, and the jobs (status dicts), from one consistent
    snapshot of the cluster's controller."""
    return slot_columns(cluster.snapshot())


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
        fig.height = _height(len(groups))
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


def jobs_html(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "<i>no jobs submitted</i>"
    head = ("<tr><th style='text-align:left'>job</th><th>state</th><th>step</th>"
            "<th>ranks</th><th>priority</th><th>team</th><th>owner</th>"
            "<th style='text-align:left'>reason</th></tr>")
    body = "".join(
        f"<tr><td>{html.escape(j['name'])}</td><td>{j['state']}</td>"
        f"<td>{format_progress(j['step'], j['steps'])}</td><td>{j['world_size']}</td>"
        f"<td>{j['priority']}</td><td>{html.escape(str(j['team']))}</td>"
        f"<td>{html.escape(str(j['owner']))}</td>"
        f"<td style='text-align:left'>{html.escape(j['reason'])}</td></tr>"
        for j in jobs)
    return f"<table class='nbtrain-jobs' style='font-size:90%'>{head}{body}</table>"


class ClusterDashboard(widgets.VBox):
    """Slots by host (and NVLink domain), coloured by the job holding them; the jobs below."""

    def __init__(self, cluster: Any, *, rate_hz: float | None = None,
                 start: bool = True) -> None:
        from bokeh.models import ColumnDataSource
        from jupyter_bokeh.widgets import BokehModel

        self.cluster = cluster
        cols, jobs = slot_rows(cluster)
        self.source = ColumnDataSource(cols, name="cluster-slots")
        groups = sorted(set(cols["group"]))
        width = max([4, *(x + 1 for x in cols["x"])])
        self.figure = slot_figure(self.source, title="slots by host", groups=groups,
                                  height=_height(len(groups)),
                                  width=min(900, 140 + 90 * width), x_end=width - 0.5)
        self.plot = BokehModel(self.figure)
        self.header = widgets.HTML()
        self.jobs = widgets.HTML()
        self._last: tuple[Any, ...] = ()
        super().__init__([self.header, self.plot, self.jobs])
        self.add_class("nbtrain-cluster")
        self.poller = Poller(self.refresh, dashboard_hz(rate_hz), name="cluster view")
        self._draw(cols, jobs)
        if start:
            self.poller.start()

    def refresh(self) -> bool:
        """Redraw when slots, owners or jobs changed; False once the cluster is closed."""
        cols, jobs = slot_rows(self.cluster)
        self._draw(cols, jobs)
        return not getattr(self.cluster, "_closed", False)

    def _draw(self, cols: dict[str, Any], jobs: list[dict[str, Any]]) -> None:
        key = (tuple(map(tuple, cols.values())),
               tuple((j["job_id"], j["state"], j["step"], j["reason"]) for j in jobs))
        if key == self._last:
            return
        self._last = key
        fit_slot_figure(self.figure, cols)
        if dict(self.source.data) != cols:
            self.source.data = cols
        n_free = sum(1 for s in cols["state"] if s == "free")
        hosts = len(set(cols["host"]))
        self.header.value = (f"<b>nbtrain cluster</b>: {_count(len(cols['x']), 'slot')} on "
                             f"{_count(hosts, 'host')}, {n_free} free, "
                             f"{_count(len(jobs), 'job')}")
        self.jobs.value = jobs_html(jobs)

    def close(self) -> None:
        poller = getattr(self, "poller", None)
        if poller is not None:
            poller.stop()
        super().close()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _height(groups: int) -> int:
    return 70 + 34 * max(groups, 1)


class ClusterText:
    """A plain-text snapshot of the cluster for headless runs (printed by its repr)."""

    def __init__(self, cluster: Any) -> None:
        self.cols, self.jobs = slot_rows(cluster)

    def __repr__(self) -> str:
        lines = []
        groups: dict[str, list[str]] = {}
        for group, job in zip(self.cols["group"], self.cols["job"], strict=True):
            groups.setdefault(group, []).append(job)
        for group, owners in groups.items():
            lines.append(f"{group}: " + " | ".join(owners))
        for j in self.jobs:
            step = format_progress(j["step"], j["steps"])
            lines.append(f"job {j['name']}: {j['state']} step {step} "
                         f"({j['world_size']} ranks, owner {j['owner']}): {j['reason']}")
        return "\n".join(lines) or "no slots"
