"""A job's live page as a Bokeh document: the plots, panels and controls of the dashboard,
built from Bokeh models only, so the cluster can serve it (``nbtrain.engine.pages``) and it
stays live whatever the notebook kernel is doing.

The page reads the job through a :class:`JobFeed` (rows and events after a position, the
status, the requests its viewer may make) and refreshes from a periodic callback of its
document. It does not know where it runs: the controller's feed reads the job log in the
scheduler's process; a test can feed it anything.

A goodput-sized job's page also draws its fitted speedup curve with the current size on it
(:mod:`nbtrain.ui.speedupplot`), from the status's ``speedup``; other jobs' pages have no
such plot.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any, Protocol

from bokeh.layouts import column, row
from bokeh.models.widgets.buttons import Button
from bokeh.models.widgets.groups import RadioButtonGroup
from bokeh.models.widgets.markups import Div
from bokeh.models.widgets.sliders import Slider

from nbtrain.core.job import user_actions
from nbtrain.ui.eventlog import EventLog
from nbtrain.ui.knobpanel import KnobPanel
from nbtrain.ui.panels import alerts_html, checkpoint_html, header_html
from nbtrain.ui.plots import (
    PHASES,
    GenerationMarks,
    KnobMarks,
    MetricPlot,
    PhaseSplitPlot,
    StepTimePlot,
    ThroughputPlot,
    feed_plots,
)
from nbtrain.ui.speedupplot import SpeedupPlot

__all__ = ["CONTROLS", "JobFeed", "JobPage"]

#: Buttons of an owner's page: (request, label, tooltip).
CONTROLS = (
    ("preempt", "Preempt", "checkpoint at the next step boundary, then free the slots"),
    ("resume", "Resume", "queue the preempted job again; it continues from its checkpoint"),
    ("checkpoint", "Checkpoint now", "a checkpoint at the next agreed step boundary"),
    ("stop", "Stop", "stop at the next step boundary and free the slots"),
)


class JobFeed(Protocol):
    """What a page reads of one job, and the requests its viewer may make."""

    job_id: str
    can_control: bool  # the viewer owns the job (or is the operator)

    def rows_since(self, position: int) -> tuple[list[Any], int]: ...
    def events_since(self, position: int) -> tuple[list[dict[str, Any]], int]: ...
    def status(self) -> Mapping[str, Any]: ...
    def request(self, what: str, arg: Any = None) -> None: ...


class JobPage:
    """The page's models and its refresh. ``layout`` goes into a Bokeh document;
    :meth:`refresh` pulls what is new (call it from the document's periodic callback).
    ``show_suspects=True`` also lists suspect stragglers (the early signal) among the alerts;
    by default only confirmed ones (the page's ``?suspects=1``)."""

    def __init__(self, feed: JobFeed, *, lines_max_ranks: int = 8, window_steps: int = 600,
                 alerts_shown: int = 10, show_suspects: bool = False) -> None:
        self.feed = feed
        self.alerts_shown = alerts_shown
        self.log = EventLog(show_suspects=show_suspects)  # confirmed stragglers only, or all
        self.rows_at = 0
        self.events_at = 0
        self.rows_drawn = 0
        status = feed.status()
        world = max(int(status.get("world_size", 1)), int(status.get("max_size") or 1))
        self.step_plot = StepTimePlot(world, lines_max_ranks=lines_max_ranks,
                                      window_steps=window_steps, width=560)
        self.split_plot = PhaseSplitPlot(width=340)
        self.loss_plot = MetricPlot("loss", width=560)
        self.rate_plot = ThroughputPlot(width=340)
        self.marks = GenerationMarks([self.step_plot.figure, *self.loss_plot.figures,
                                      self.rate_plot.figure])
        self.knob_marks = KnobMarks([*self.loss_plot.figures, self.rate_plot.figure])
        self.header = Div(text="", name="nbtrain-header", sizing_mode="stretch_width")
        self.message = Div(text="", name="nbtrain-message")
        self.checkpoint = Div(text="", width=340, name="nbtrain-checkpoint-panel")
        self.alerts = Div(text="", width=560, name="nbtrain-alerts")
        self.phase = RadioButtonGroup(labels=list(PHASES.values()), active=0)
        self.phase.on_change("active", lambda _a, _o, new: self.step_plot.set_phase(
            list(PHASES)[new]))
        self.buttons: dict[str, Button] = {}
        self.slider: Slider | None = None
        controls = self._controls(status)
        #: Number inputs and sliders per declared knob: for the owner (or operator) only.
        self.knobs = KnobPanel(self._act) if feed.can_control else None
        #: A goodput-sized job's speedup curve: made, and added under the plots, on the
        #: first status that carries one (``status["speedup"]``); None for any other job.
        self.speedup_plot: SpeedupPlot | None = None
        self.layout = column(
            self.header, controls, *([self.knobs.layout] if self.knobs else []),
            row(self.checkpoint, self.alerts), self.phase,
            row(self.step_plot.figure, self.split_plot.figure),
            row(self.loss_plot.view, self.rate_plot.figure),
            name="nbtrain-job-page")
        self.refresh()

    # -- controls ---------------------------------------------------------------------------
    def _controls(self, status: Mapping[str, Any]) -> Any:
        if not self.feed.can_control:
            self.message.text = ("<i>read-only: steer this job from the notebook that "
                                 "submitted it (job.dashboard() there), or as the cluster's "
                                 "operator</i>")
            return row(self.message)
        for what, label, tip in CONTROLS:
            button = Button(label=label, button_type="danger" if what == "stop" else "default",
                            name=f"nbtrain-{what}", width=120, tags=[tip])
            button.on_click(lambda _e=None, w=what: self._act(w))
            self.buttons[what] = button
        widgets: list[Any] = list(self.buttons.values())
        lo, hi = int(status.get("min_size") or 1), int(status.get("max_size") or 1)
        if lo < hi:
            self.slider = Slider(start=lo, end=hi, step=1, title="ranks",
                                 value=int(status.get("target_size") or lo), width=200,
                                 name="nbtrain-resize-slider")
            resize = Button(label="Resize", name="nbtrain-resize", width=90,
                            tags=["resize at the next step boundary"])
            resize.on_click(lambda _e=None: self._act(
                "resize", {"size": int(self.slider.value) if self.slider else lo,
                           "wait_for_workers": False}))
            self.buttons["resize"] = resize
            widgets += [self.slider, resize]
        return column(row(*widgets), self.message)

    def _act(self, what: str, arg: Any = None) -> None:
        """Make a request; errors are shown on the page, never raised into the server."""
        try:
            self.feed.request(what, arg)
        except Exception as exc:
            self.message.text = (f"<span style='color:#c33'>{html.escape(what)} failed: "
                                 f"{html.escape(str(exc))}</span>")
        else:
            self.message.text = f"<i>{html.escape(what)} requested</i>"
        self._update_controls(self.feed.status())

    def _update_controls(self, status: Mapping[str, Any]) -> None:
        wanted = user_actions(str(status.get("state", "")))
        for what, button in self.buttons.items():
            disabled = not wanted.get(what, wanted["stop"])
            if button.disabled != disabled:
                button.disabled = disabled
        if self.slider is not None:
            self.slider.disabled = not wanted["resize"]

    # -- refresh ----------------------------------------------------------------------------
    def refresh(self) -> None:
        rows, self.rows_at = self.feed.rows_since(self.rows_at)
        events, self.events_at = self.feed.events_since(self.events_at)
        for event in events:
            self.log.add(event)
        self.knob_marks.add(events)
        if self.knobs is not None:
            self.knobs.update(events)
        if rows:
            self.rows_drawn += feed_plots(rows, (self.step_plot, self.split_plot, self.loss_plot,
                                                 self.rate_plot), self.marks,
                                          self.log.describe_generation)
        if events:
            self.step_plot.mark_slow(set(self.log.stragglers))
            self._set(self.alerts, alerts_html(self.log, self.alerts_shown))
        status = self.feed.status()
        self._set(self.header, header_html(status, self.log, self.rate_plot.latest))
        self._set(self.checkpoint, checkpoint_html(self.log))
        if self.buttons:
            self._update_controls(status)
        self._draw_speedup(status)

    def _draw_speedup(self, status: Mapping[str, Any]) -> None:
        points = list(status.get("speedup") or ())
        if not points and self.speedup_plot is None:
            return
        if self.speedup_plot is None:
            self.speedup_plot = SpeedupPlot()
            self.layout.children.append(self.speedup_plot.figure)
        self.speedup_plot.update(points, int(status.get("size") or 0))

    @staticmethod
    def _set(div: Div, text: str) -> None:
        if div.text != text:  # unchanged text is not sent to the browser again
            div.text = text
