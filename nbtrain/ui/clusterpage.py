"""The class view: the whole cluster as a Bokeh document the cluster serves
(``nbtrain.engine.pages``), for an instructor watching every student's job, or anyone who
wants to see why their job waits.

- slots by host and NVLink domain, coloured by the job holding them;
- every client's jobs: state, step, ranks, owner, team, priority, goodput, with a link to
  each job's page;
- the queue in the scheduler's order, with the reason each job waits;
- the cluster's log as it happens: preemptions, scheduler decisions, workers joining and
  leaving.

Read-only: steering happens on a job's own page, with the owner's ticket.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Mapping
from typing import Any

from bokeh.layouts import column
from bokeh.models import ColumnDataSource
from bokeh.models.widgets.markups import Div
from bokeh.models.widgets.tables import DataTable, HTMLTemplateFormatter, TableColumn

from nbtrain.core.clusterevents import parse_cluster_event
from nbtrain.core.job import status_progress
from nbtrain.ui.slots import fit_slot_figure, slot_columns, slot_figure

__all__ = ["ClusterPage"]

_JOB_COLUMNS = ("link", "state", "progress", "ranks", "owner", "team", "priority", "goodput",
                "restarts", "reason")


class ClusterPage:
    """Models of the class view; :meth:`refresh` redraws from a new snapshot.
    ``snapshot()`` returns what ``Cluster.snapshot()`` returns; ``job_link(job_id)`` the
    URL of a job's page (relative to this one)."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]],
                 job_link: Callable[[str], str], *, log_shown: int = 15) -> None:
        self.snapshot = snapshot
        self.job_link = job_link
        self.log_shown = log_shown
        self.header = Div(text="", name="nbtrain-cluster-header", sizing_mode="stretch_width")
        self.slots = ColumnDataSource({k: [] for k in (
            "x", "group", "address", "host", "domain", "job", "state", "colour", "alpha",
            "label", "text_colour")}, name="cluster-slots")
        self.figure = slot_figure(self.slots, title="slots by host / NVLink domain",
                                  height=120, width=900, x_end=3.5)
        self.jobs = ColumnDataSource({k: [] for k in _JOB_COLUMNS}, name="cluster-jobs")
        link = HTMLTemplateFormatter(template="<%= value %>")
        self.jobs_table = DataTable(source=self.jobs, width=900, height=200, index_position=None,
                                    name="nbtrain-jobs-table", columns=[
            TableColumn(field="link", title="job", formatter=link, width=140),
            TableColumn(field="state", title="state", width=80),
            TableColumn(field="progress", title="step", width=80),
            TableColumn(field="ranks", title="ranks", width=45),
            TableColumn(field="owner", title="owner", width=90),
            TableColumn(field="team", title="team", width=70),
            TableColumn(field="priority", title="priority", width=50),
            TableColumn(field="goodput", title="goodput", width=55),
            TableColumn(field="restarts", title="restarts", width=55),
            TableColumn(field="reason", title="reason", width=300)])
        self.queue = Div(text="", width=900, name="nbtrain-queue")
        self.log = Div(text="", width=900, name="nbtrain-cluster-log")
        self.layout = column(self.header, self.figure, Div(text="<b>Jobs</b>"),
                             self.jobs_table, self.queue, self.log, name="nbtrain-class-view")
        self._last: tuple[Any, ...] = ()
        self.refresh()

    def refresh(self) -> None:
        snap = dict(self.snapshot())
        cols, jobs = slot_columns(snap)
        key = (tuple(map(tuple, cols.values())),
               tuple((j["job_id"], j["state"], j.get("step"), j["reason"], j.get("size"))
                     for j in jobs), len(snap.get("log") or ()), tuple(snap.get("queue") or ()))
        if key == self._last:
            return
        self._last = key
        fit_slot_figure(self.figure, cols)
        self.slots.data = cols
        self.jobs.data = dict(self._job_columns(jobs))
        n_free = sum(1 for s in cols["state"] if s == "free")
        running = sum(1 for j in jobs if j["state"] == "RUNNING")
        self.header.text = (f"<b>nbtrain cluster</b>: {len(cols['x'])} slots on "
                            f"{len(set(cols['host']))} host(s), {n_free} free; {len(jobs)} "
                            f"jobs, {running} running <span style='color:#888'>(updated "
                            f"{time.strftime('%H:%M:%S')})</span>")
        self.queue.text = self._queue_html(snap, jobs)
        self.log.text = self._log_html(snap)

    def _job_columns(self, jobs: list[dict[str, Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in _JOB_COLUMNS}
        for j in jobs:
            fraction = (j.get("goodput") or {}).get("fraction")
            out["link"].append(f"<a href='{html.escape(self.job_link(j['job_id']))}' "
                               f"target='_blank'>{html.escape(j['name'])}</a>")
            out["state"].append(j["state"])
            out["progress"].append(status_progress(j))
            out["ranks"].append(int(j.get("size") or 0) or int(j["world_size"]))
            out["owner"].append(str(j.get("owner") or ""))
            out["team"].append(str(j.get("team") or ""))
            out["priority"].append(int(j.get("priority") or 0))
            out["goodput"].append("" if fraction is None else f"{float(fraction):.0%}")
            out["restarts"].append(int(j.get("restarts") or 0))
            out["reason"].append(str(j.get("reason") or ""))
        return out

    @staticmethod
    def _queue_html(snap: Mapping[str, Any], jobs: list[dict[str, Any]]) -> str:
        by_id = {j["job_id"]: j for j in jobs}
        queue = [by_id[q] for q in snap.get("queue") or () if q in by_id]
        if not queue:
            return "<b>Queue</b>: empty"
        items = "".join(
            f"<li><b>{html.escape(j['name'])}</b> ({j['world_size']} ranks, priority "
            f"{j['priority']}, team {html.escape(str(j['team']))}, "
            f"{html.escape(str(j['owner']))}): {html.escape(j['reason'])}</li>" for j in queue)
        return f"<b>Queue</b> (in the order the scheduler serves it)<ol>{items}</ol>"

    def _log_html(self, snap: Mapping[str, Any]) -> str:
        entries = list(snap.get("log") or ())[-self.log_shown:]
        if not entries:
            return "<b>Cluster log</b>: nothing yet"
        lines = []
        for e in map(parse_cluster_event, reversed(entries)):
            stamp = time.strftime("%H:%M:%S", time.localtime(e.time)) if e.time else ""
            lines.append(f"<div>{stamp} <b>{html.escape(e.kind)}</b> "
                         f"{html.escape(e.text)}</div>")
        return ("<b>Cluster log</b> (newest first: preemptions, decisions, workers)"
                "<div style='font-size:90%;line-height:1.25'>" + "".join(lines) + "</div>")
