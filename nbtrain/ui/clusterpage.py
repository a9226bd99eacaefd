"""The class view: the whole cluster as a Bokeh document the cluster serves
(``nbtrain.engine.pages``), for an instructor watching every student's job, or anyone who
wants to see why their job waits.

- slots by host and NVLink domain, coloured by the job holding them;
- every client's jobs: state, step, ranks, owner, team, priority, goodput, with a link to
  each job's page;
- the cluster's goodput over time: the share of its online slot-time that trained
  productively, against the share held (:mod:`nbtrain.ui.goodputplot`), when the controller
  keeps the series;
- fair share for a teacher: each team's share of slot-time over a recent window against the
  share its weight entitles it to (``snapshot()["teams"]``), and jobs per student;
- the queue in the scheduler's order, with how long and why each job waits;
- the cluster's log as sentences, newest first, filterable by team: preemptions (who took
  whose slots, and why), scheduler decisions, workers joining and leaving.

Read-only: steering happens on a job's own page, with the owner's ticket.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Mapping
from typing import Any

from bokeh.layouts import column
from bokeh.models import ColumnDataSource
from bokeh.models.widgets.inputs import Select
from bokeh.models.widgets.markups import Div
from bokeh.models.widgets.tables import DataTable, HTMLTemplateFormatter, TableColumn

from nbtrain.core.clusterevents import cluster_log_lines
from nbtrain.core.clustergoodput import ClusterGoodputSeries
from nbtrain.core.job import status_progress
from nbtrain.core.teamshare import duration, jobs_per_student, team_shares, waiting_jobs
from nbtrain.ui.goodputplot import GoodputPlot
from nbtrain.ui.slots import fit_slot_figure, slot_columns, slot_figure

__all__ = ["ALL_TEAMS", "ClusterPage"]

_JOB_COLUMNS = ("link", "state", "progress", "ranks", "owner", "team", "priority", "goodput",
                "restarts", "waiting", "reason")
_TEAM_COLUMNS = ("team", "weight", "fair_share", "share", "ratio", "slot_s", "running",
                 "waiting", "verdict")
_STUDENT_COLUMNS = ("owner", "teams", "jobs", "running", "waiting", "ended", "failed")
#: The log filter's choice for every team (and the entries about no job: workers, restarts).
ALL_TEAMS = "all teams"


def _clock(when: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when)) if when else ""


def _verdict(team: dict[str, Any]) -> str:
    ratio = team.get("ratio")
    if ratio is None:
        return "nothing to run"
    if ratio < 0.8:
        return "below its share" + (": its jobs go first" if team.get("waiting") else "")
    if ratio > 1.25:
        return "above its share"
    return "about its share"


def team_facts(snap: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The snapshot's ``teams`` (computed here from ``jobs`` for an older controller that
    sent none: no window usage then)."""
    teams = snap.get("teams")
    if teams is None:
        teams = team_shares({}, snap.get("jobs") or ())
    return list(teams)


class ClusterPage:
    """Models of the class view; :meth:`refresh` redraws from a new snapshot.
    ``snapshot()`` returns what ``Cluster.snapshot()`` returns; ``job_link(job_id)`` the
    URL of a job's page (relative to this one); ``goodput`` the controller's goodput series
    (None: no goodput plot)."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]],
                 job_link: Callable[[str], str], *, log_shown: int = 15,
                 goodput: ClusterGoodputSeries | None = None) -> None:
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
        self.teams = ColumnDataSource({k: [] for k in _TEAM_COLUMNS}, name="cluster-teams")
        self.teams_title = Div(text="", width=900, name="nbtrain-teams-title")
        self.teams_table = DataTable(source=self.teams, width=900, height=120,
                                     index_position=None, name="nbtrain-teams-table", columns=[
            TableColumn(field="team", title="team", width=110),
            TableColumn(field="weight", title="weight", width=55),
            TableColumn(field="fair_share", title="its fair share", width=90),
            TableColumn(field="share", title="slot-time it got", width=100),
            TableColumn(field="ratio", title="got / fair", width=70),
            TableColumn(field="slot_s", title="slot-seconds", width=85),
            TableColumn(field="running", title="running", width=55),
            TableColumn(field="waiting", title="waiting", width=55),
            TableColumn(field="verdict", title="", width=230)])
        self.students = ColumnDataSource({k: [] for k in _STUDENT_COLUMNS},
                                         name="cluster-students")
        self.students_table = DataTable(source=self.students, width=900, height=140,
                                        index_position=None, name="nbtrain-students-table",
                                        columns=[
            TableColumn(field="owner", title="student (owner)", width=160),
            TableColumn(field="teams", title="teams", width=160),
            TableColumn(field="jobs", title="jobs", width=60),
            TableColumn(field="running", title="running", width=60),
            TableColumn(field="waiting", title="waiting", width=60),
            TableColumn(field="ended", title="ended", width=60),
            TableColumn(field="failed", title="failed", width=60)])
        self.queue = Div(text="", width=900, name="nbtrain-queue")
        self.log_team = Select(title="cluster log of", value=ALL_TEAMS,
                               options=list[Any]([ALL_TEAMS]), width=200,
                               name="nbtrain-log-team")
        self.log_team.on_change("value", lambda _a, _o, _n: self._draw_log())
        self.log = Div(text="", width=900, name="nbtrain-cluster-log")
        self._snap: Mapping[str, Any] = {}
        self.goodput = None if goodput is None else GoodputPlot(goodput)
        self.layout = column(self.header, self.figure,
                             *([self.goodput.figure] if self.goodput else []),
                             self.teams_title, self.teams_table,
                             Div(text="<b>Jobs</b>"), self.jobs_table, self.queue,
                             Div(text="<b>Jobs per student</b>"), self.students_table,
                             self.log_team, self.log, name="nbtrain-class-view")
        self._last: tuple[Any, ...] = ()
        self.refresh()

    def refresh(self) -> None:
        if self.goodput is not None:
            self.goodput.update()  # (only when the series took a sample)
        snap = dict(self.snapshot())
        cols, jobs = slot_columns(snap)
        teams = team_facts(snap)
        key = (tuple(map(tuple, cols.values())),
               tuple((j["job_id"], j["state"], j.get("step"), j["reason"], j.get("size"),
                      int(j.get("waiting_s") or 0)) for j in jobs),
               len(snap.get("log") or ()), tuple(snap.get("queue") or ()),
               tuple((t["team"], round(float(t["slot_s"]))) for t in teams))
        if key == self._last:
            return
        self._last = key
        self._snap = snap
        fit_slot_figure(self.figure, cols)
        self.slots.data = cols
        self.jobs.data = dict(self._job_columns(jobs))
        self.teams.data = dict(self._team_columns(teams))
        window = float(snap.get("share_window_s") or 0.0)
        self.teams_title.text = (
            f"<b>Fair share</b>: each team's share of the slot-time used over the last "
            f"{duration(window)}, against its weight's share among the teams with jobs"
            if window else "<b>Fair share</b>")
        students = snap.get("students")
        self.students.data = dict(self._student_columns(
            jobs_per_student(jobs) if students is None else list(students)))
        options = [ALL_TEAMS, *sorted({str(t["team"]) for t in teams}
                                      | {str(j.get("team") or "default") for j in jobs})]
        if list(self.log_team.options) != options:
            self.log_team.options = list[Any](options)
        n_free = sum(1 for s in cols["state"] if s == "free")
        running = sum(1 for j in jobs if j["state"] == "RUNNING")
        self.header.text = (f"<b>nbtrain cluster</b>: {len(cols['x'])} slots on "
                            f"{len(set(cols['host']))} host(s), {n_free} free; {len(jobs)} "
                            f"jobs, {running} running <span style='color:#888'>(updated "
                            f"{time.strftime('%H:%M:%S')})</span>")
        self.queue.text = self._queue_html(snap, jobs)
        self._draw_log()

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
            out["waiting"].append(duration(float(j["waiting_s"]))
                                  if j.get("waiting_s") else "")
            out["reason"].append(str(j.get("reason") or ""))
        return out

    @staticmethod
    def _team_columns(teams: list[dict[str, Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in _TEAM_COLUMNS}
        for t in teams:
            ratio = t.get("ratio")
            out["team"].append(str(t["team"]))
            out["weight"].append(float(t["weight"]))
            out["fair_share"].append(f"{float(t['fair_share']):.0%}")
            out["share"].append(f"{float(t['share']):.0%}")
            out["ratio"].append("" if ratio is None else f"{float(ratio):.2f}")
            out["slot_s"].append(round(float(t["slot_s"]), 1))
            out["running"].append(int(t["running"]))
            out["waiting"].append(int(t["waiting"]))
            out["verdict"].append(_verdict(t))
        return out

    @staticmethod
    def _student_columns(students: list[dict[str, Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in _STUDENT_COLUMNS}
        for st in students:
            for k in _STUDENT_COLUMNS:
                value = st.get(k, 0)
                out[k].append(", ".join(value) if k == "teams" else value)
        return out

    @staticmethod
    def _queue_html(snap: Mapping[str, Any], jobs: list[dict[str, Any]]) -> str:
        waiting = snap.get("waiting")
        if waiting is None:
            waiting = waiting_jobs(jobs, snap.get("queue") or ())
        if not waiting:
            return "<b>Waiting</b>: nobody"
        items = "".join(
            f"<li><b>{html.escape(w['name'])}</b> ({html.escape(w['owner'])}, team "
            f"{html.escape(w['team'])}, {w['ranks']} ranks, priority {w['priority']}"
            + (f", #{w['position']} in the queue" if w.get("position") else "")
            + f"): waiting {duration(float(w['waiting_s']))}: {html.escape(w['reason'])}</li>"
            for w in waiting)
        return f"<b>Waiting</b> (longest first)<ol>{items}</ol>"

    def _draw_log(self) -> None:
        snap = self._snap
        team = None if self.log_team.value == ALL_TEAMS else str(self.log_team.value)
        lines = snap.get("log_lines") if team is None else None
        if lines is None:
            lines = cluster_log_lines(list(snap.get("log") or ()), list(snap.get("jobs") or ()),
                                      team=team, limit=self.log_shown)
        lines = list(lines)[:self.log_shown]
        about = "every team" if team is None else f"team {html.escape(team)}"
        if not lines:
            text = f"<b>Cluster log</b> ({about}): nothing yet"
        else:
            rows = "".join(
                f"<div>{_clock(line['time'])} {html.escape(line['text'])}</div>"
                for line in lines)
            text = (f"<b>Cluster log</b> ({about}, newest first)"
                    f"<div style='font-size:90%;line-height:1.25'>{rows}</div>")
        if self.log.text != text:
            self.log.text = text
