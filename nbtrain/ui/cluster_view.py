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

from nbtrain.core.job import status_progress
from nbtrain.core.teamshare import duration
from nbtrain.ui.display import dashboard_hz, resolve_display
from nbtrain.ui.poller import Poller
from nbtrain.ui.slots import fit_slot_figure, slot_columns, slot_figure, slot_figure_height


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


def team_lines(teams: list[dict[str, Any]], window_s: float) -> list[str]:
    """Each team's share of slot-time over the recent window against its weight's share
    (``snapshot()["teams"]``), one line each."""
    if not teams:
        return []
    out = [f"fair share over the last {duration(window_s)}:" if window_s else "fair share:"]
    for t in teams:
        ratio = "" if t.get("ratio") is None else f" (got / fair {float(t['ratio']):.2f})"
        out.append(f"  team {t['team']} (weight {float(t['weight']):g}): fair share "
                   f"{float(t['fair_share']):.0%}, got {float(t['share']):.0%}{ratio}; "
                   f"{t['running']} running, {t['waiting']} waiting")
    return out


def jobs_html(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "<i>no jobs submitted</i>"
    head = ("<tr><th style='text-align:left'>job</th><th>state</th><th>step</th>"
            "<th>ranks</th><th>priority</th><th>team</th><th>owner</th>"
            "<th style='text-align:left'>reason</th></tr>")
    body = "".join(
        f"<tr><td>{html.escape(j['name'])}</td><td>{j['state']}</td>"
        f"<td>{status_progress(j)}</td><td>{j['world_size']}</td>"
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
                                  height=slot_figure_height(len(groups)),
                                  width=min(900, 140 + 90 * width), x_end=width - 0.5)
        self.plot = BokehModel(self.figure)
        self.header = widgets.HTML()
        self.jobs = widgets.HTML()
        self.teams = widgets.HTML()
        self._last: tuple[Any, ...] = ()
        super().__init__([self.header, self.plot, self.jobs, self.teams])
        self.add_class("nbtrain-cluster")
        self.poller = Poller(self.refresh, dashboard_hz(rate_hz), name="cluster view")
        self._draw(cols, jobs)
        if start:
            self.poller.start()

    def refresh(self) -> bool:
        """Redraw when slots, owners or jobs changed; False once the cluster is closed."""
        snap = self.cluster.snapshot()
        cols, jobs = slot_columns(snap)
        self._draw(cols, jobs)
        lines = team_lines(list(snap.get("teams") or ()), float(snap.get("share_window_s") or 0))
        text = "<br>".join(html.escape(line).replace("  ", "&nbsp;&nbsp;") for line in lines)
        if self.teams.value != text:
            self.teams.value = text
        return not getattr(self.cluster, "_closed", False)

    def _draw(self, cols: dict[str, Any], jobs: list[dict[str, Any]]) -> None:
        key = (tuple(map(tuple, cols.values())),
               tuple((j["job_id"], j["state"], j.get("step"), j["reason"]) for j in jobs))
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


class ClusterText:
    """A plain-text snapshot of the cluster for headless runs (printed by its repr)."""

    def __init__(self, cluster: Any) -> None:
        snap = cluster.snapshot()
        self.cols, self.jobs = slot_columns(snap)
        self.teams = team_lines(list(snap.get("teams") or ()),
                                float(snap.get("share_window_s") or 0))

    def __repr__(self) -> str:
        lines = []
        groups: dict[str, list[str]] = {}
        for group, job in zip(self.cols["group"], self.cols["job"], strict=True):
            groups.setdefault(group, []).append(job)
        for group, owners in groups.items():
            lines.append(f"{group}: " + " | ".join(owners))
        for j in self.jobs:
            step = status_progress(j)
            lines.append(f"job {j['name']}: {j['state']} step {step} "
                         f"({j['world_size']} ranks, owner {j['owner']}): {j['reason']}")
        lines += self.teams
        return "\n".join(lines) or "no slots"
