"""nbtrain's live pages, served by the Dask scheduler's web server next to its dashboard.

- ``/individual-nbtrain-job?job=<id>[&ticket=<t>]``: one job's page (:mod:`nbtrain.ui.jobpage`);
  with a ticket its owner got from ``job.dashboard()`` it has controls, without it is
  read-only;
- ``/individual-nbtrain-cluster``: the class view (:mod:`nbtrain.ui.clusterpage`).

On a cluster with ``visibility="owner"`` a job's page needs its ticket, and the class view
shows every job as the scheduling facts only (:mod:`nbtrain.engine.access`).

They run in the scheduler's process, on its event loop, next to the controller, and read the
job logs there: they stay live whatever the notebook kernels are doing (busy, dead,
restarted). Their names start with ``individual-`` so dask-labextension lists them among the
dashboard's plots in JupyterLab's Dask panel.

How they are served: :func:`install` adds them to Dask's own dashboard applications before a
scheduler starts in this process (``connect()``'s embedded cluster, ``dask scheduler
--preload nbtrain.engine.preload``); on a scheduler already running (``connect(address)``
to a cluster started without the preload) :func:`attach` serves them from a second Bokeh
application on the same web server (the pages work; dask-labextension does not list them).

Tickets (:mod:`nbtrain.engine.tickets`): a page's controls act through the same rules as
the API. ``job.dashboard()`` asks the controller for a ticket, which it grants to the job's
owner or the operator; the ticket goes in the page's URL, is valid for that one job for
``view_ticket_s``, and is dropped when the job is forgotten. A saved notebook holds the URL:
treat it like a short-lived password.
"""

from __future__ import annotations

import functools
import html
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from nbtrain.engine.tickets import PAGE_CLUSTER, PAGE_JOB, ViewTicket, check_ticket

if TYPE_CHECKING:
    from nbtrain.engine.port import ControllerPort

logger = logging.getLogger(__name__)

__all__ = ["PAGE_CLUSTER", "PAGE_JOB", "ControllerFeed", "ViewTicket", "attach", "install"]

#: How often a page pulls what is new (ms): live to the eye, cheap for the scheduler.
REFRESH_MS = 250


# ====================================================================== documents
def job_document(scheduler: Any, extra: Mapping[str, Any], doc: Any) -> None:
    """A job's page; without ``?job=`` a list of the cluster's jobs. ``&suspects=1`` lists
    suspect stragglers among the alerts too."""
    from bokeh.models.widgets.markups import Div

    ctl = _controller(scheduler)
    job_id, ticket = _arg(doc, "job"), _arg(doc, "ticket")
    if ctl is None:
        doc.add_root(Div(text="<b>nbtrain's controller is not running on this cluster</b>: "
                              "connect with nbtrain.connect() first"))
        return
    if not job_id or job_id not in ctl.assets:
        doc.title = "nbtrain jobs"
        doc.add_root(Div(text=_job_list_html(ctl, job_id), name="nbtrain-job-list"))
        return
    if ctl.settings.visibility == "owner" and not check_ticket(ctl, job_id, ticket):
        from nbtrain.engine.access import refusal

        doc.title = "nbtrain: not yours"
        status = ctl.job_status(job_id) or {"name": job_id, "job_id": job_id}
        doc.add_root(Div(text=f"<b>{html.escape(str(refusal(status, 'page')))}</b> (this "
                              "cluster's visibility is 'owner'): open it with "
                              "job.dashboard() in the owner's notebook",
                         name="nbtrain-refused"))
        return
    from nbtrain.ui.jobpage import JobPage

    feed = ControllerFeed(ctl, job_id, ticket)
    page = JobPage(feed, show_suspects=_arg(doc, "suspects") in ("1", "true"))
    doc.title = f"nbtrain: {ctl.assets[job_id].spec.name}"
    doc.add_root(page.layout)
    _every(doc, page.refresh, f"page of job {job_id}")


def cluster_document(scheduler: Any, extra: Mapping[str, Any], doc: Any) -> None:
    """The class view."""
    from bokeh.models.widgets.markups import Div

    ctl = _controller(scheduler)
    if ctl is None:
        doc.add_root(Div(text="<b>nbtrain's controller is not running on this cluster</b>"))
        return
    from nbtrain.engine.handlers import cluster_snapshot
    from nbtrain.ui.clusterpage import ClusterPage

    page = ClusterPage(lambda: cluster_snapshot(ctl),
                       lambda job_id: f".{PAGE_JOB}?{urlencode({'job': job_id})}",
                       goodput=ctl.goodput_series)
    doc.title = "nbtrain cluster"
    doc.add_root(page.layout)
    _every(doc, page.refresh, "class view")


def _every(doc: Any, refresh: Any, what: str) -> None:
    """Refresh every REFRESH_MS; an error is logged once and stops that page's updates (a
    page must never take the scheduler down)."""
    state: dict[str, Any] = {}

    def tick() -> None:
        try:
            refresh()
        except Exception:
            logger.exception("nbtrain: the %s stopped updating", what)
            doc.remove_periodic_callback(state["cb"])

    state["cb"] = doc.add_periodic_callback(tick, REFRESH_MS)


def _controller(scheduler: Any) -> ControllerPort | None:
    from nbtrain.engine.assets import PLUGIN_NAME

    plugin = scheduler.plugins.get(PLUGIN_NAME)
    return plugin if plugin is not None and hasattr(plugin, "assets") else None


def _arg(doc: Any, name: str) -> str:
    request = getattr(doc.session_context, "request", None)
    values = (getattr(request, "arguments", None) or {}).get(name) or []
    value = values[0] if values else b""
    return value.decode() if isinstance(value, bytes) else str(value)


def _job_list_html(ctl: ControllerPort, asked: str) -> str:
    missing = (f"<p>No job <code>{html.escape(asked)}</code> here (ended jobs are forgotten "
               "after a while).</p>" if asked else "")
    items = "".join(
        f"<li><a href='?{urlencode({'job': jid})}'>{html.escape(a.spec.name)}</a> "
        f"({html.escape(str((ctl.job_status(jid) or {}).get('state', '?')))})</li>"
        for jid, a in ctl.assets.items())
    return f"<h3>nbtrain jobs</h3>{missing}<ul>{items or '<li>none yet</li>'}</ul>"


# ====================================================================== the feed
class ControllerFeed:
    """A job page's view of one job, read from the controller in the scheduler's process."""

    MAX_ROWS = 20_000  # per refresh: a page opened late catches up over a few ticks

    def __init__(self, ctl: ControllerPort, job_id: str, ticket: str = "") -> None:
        self.ctl = ctl
        self.job_id = job_id
        self.ticket = ticket
        self.can_control = bool(ticket) and check_ticket(ctl, job_id, ticket)
        self._last: Mapping[str, Any] | None = None  # the last status seen in memory

    def rows_since(self, position: int) -> tuple[list[Any], int]:
        assets = self.ctl.assets.get(self.job_id)
        if assets is None:
            return [], position
        at, rows = assets.log.rows.since(position, self.MAX_ROWS)
        return list(rows), at + len(rows)

    def events_since(self, position: int) -> tuple[list[dict[str, Any]], int]:
        assets = self.ctl.assets.get(self.job_id)
        if assets is None:
            return [], position
        at, events = assets.log.events.since(position, 1_000)
        if not check_ticket(self.ctl, self.job_id, self.ticket):  # another user's view
            from nbtrain.engine.access import public_event

            return [public_event(e) for e in events], at + len(events)
        return [dict(e) for e in events], at + len(events)

    def status(self) -> Mapping[str, Any]:
        """The job's status; once the controller has dropped it from memory (an ended job
        past ``jobs_kept``), the last one this page saw, never an invented end state."""
        status = self.ctl.job_status(self.job_id)
        if status is not None:
            self._last = status
            return status
        if self._last is not None:
            return self._last
        return {"name": self.job_id, "state": "UNKNOWN",
                "reason": "not in the controller's memory (an ended job past jobs_kept): "
                          "cluster.job(id) reads it back from the controller's journal"}

    def request(self, what: str, arg: Any = None) -> None:
        from nbtrain.engine.handlers import apply_request

        if not check_ticket(self.ctl, self.job_id, self.ticket):
            raise PermissionError("this page's ticket has expired or was never valid: open "
                                  "the page again with job.dashboard() in the owner's notebook")
        apply_request(self.ctl, self.job_id, what, arg)


# ====================================================================== serving
def install() -> None:
    """Add the pages to Dask's dashboard applications (idempotent): every scheduler started
    in this process afterwards serves them with its dashboard."""
    try:
        from distributed.dashboard import scheduler as dashboard
    except ImportError:  # no bokeh: Dask runs without a dashboard
        return
    dashboard.applications.setdefault(PAGE_JOB, job_document)
    dashboard.applications.setdefault(PAGE_CLUSTER, cluster_document)


def attach(scheduler: Any) -> str:
    """Serve the pages on a running scheduler's web server; returns how: "dashboard" (Dask's
    dashboard already serves them), "attached" (a second Bokeh application added) or "none"
    (the scheduler has no web server)."""
    http = getattr(scheduler, "http_application", None)
    if http is None:
        return "none"
    from bokeh.server.tornado import BokehTornado

    for app in getattr(http, "applications", []):
        if isinstance(app, BokehTornado) and PAGE_JOB in app.app_paths:
            return "dashboard"
    import dask.config
    from bokeh.application import Application
    from bokeh.application.handlers.function import FunctionHandler
    from bokeh.server.util import create_hosts_allowlist
    from tornado.ioloop import IOLoop

    kwargs = dict(dask.config.get("distributed.scheduler.dashboard.bokeh-application"))
    origins = create_hosts_allowlist(kwargs.pop("allow_websocket_origin", ["*"]),
                                     scheduler.http_server.port)
    apps = {path: Application(FunctionHandler(functools.partial(fn, scheduler, {})))
            for path, fn in ((PAGE_JOB, job_document), (PAGE_CLUSTER, cluster_document))}
    bokeh_app = BokehTornado(apps, prefix="/", use_index=False, absolute_url="",
                             extra_websocket_origins=origins, **kwargs)
    http.add_application(bokeh_app)
    bokeh_app.initialize(IOLoop.current())
    bokeh_app.start()
    return "attached"
