"""``job.dashboard()``: a live ipywidgets layout with Bokeh plots, or text lines when headless.

The widget pulls what is new from the job (a :class:`~nbtrain.ui.jobview.JobView`: the
``JobHandle``) on the kernel's event loop a few times a second (:mod:`nbtrain.ui.poller`),
never from Dask's or the controller's threads, and draws it in one batch per plot. Plot
buffers roll over, so memory is bounded however long the job runs. Buttons call the handle's
methods at once; the handle returns immediately and the controller does the work, so the
kernel stays free.

Controls appear as the handle grows them: Stop always; Preempt/Resume and Checkpoint now
when the handle has ``preempt``/``resume``/``checkpoint``; the fault-injection panel when it
has ``inject``; a resize slider when it has ``resize`` (bounded by the job's ``min_size`` and
``max_size``, disabled with the reason when the job cannot be resized).
"""

from __future__ import annotations

import contextlib
import html
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

import ipywidgets as widgets

from nbtrain.core.job import user_actions
from nbtrain.ui.display import dashboard_hz, in_kernel, resolve_display
from nbtrain.ui.eventlog import EventLog
from nbtrain.ui.jobview import JobView
from nbtrain.ui.knobinputs import KnobInputs
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
from nbtrain.ui.poller import Poller

FAULT_KINDS = ("kill", "raise", "hang", "slow")

_bokehjs_loaded = False


def ensure_bokehjs(force: bool = False) -> bool:
    """Load BokehJS into the notebook page, inline, once per kernel (or again with ``force``).

    The default loads it from a CDN, which fails on offline and air-gapped clusters and in
    CI, leaving the widget at "Click to show javascript error". Only the core bundle is sent
    (about 1.3 MB, not the 3.9 MB with widgets, tables, GL and MathJax the plots do not use).
    Returns whether it published anything (False outside a kernel).
    """
    global _bokehjs_loaded
    if (_bokehjs_loaded and not force) or not in_kernel():
        return False
    from bokeh.io import output_notebook
    from bokeh.resources import Resources

    output_notebook(resources=Resources(mode="inline", components=["bokeh"]), hide_banner=True)
    _bokehjs_loaded = True
    return True


def job_dashboard(job: JobView, display: str | None = None, **options: Any) -> Any:
    """The view ``job.dashboard(display=...)`` returns: :class:`JobDashboard` (a widget) or
    :class:`TextProgress` (lines on stdout), chosen by :func:`~nbtrain.ui.display.resolve_display`.
    ``options`` go to the chosen class."""
    mode = resolve_display(display)
    if mode == "text":
        return TextProgress(job, **options)
    if mode == "page":
        try:
            return job.page(show_suspects=bool(options.get("show_suspects", False)))
        except RuntimeError:  # no pages on this cluster: the kernel-side widget instead
            pass
    ensure_bokehjs()
    return JobDashboard(job, **options)


class JobDashboard(widgets.VBox):
    """Live view and controls of one job (an ``ipywidgets.VBox``: display it, or nest it).

    ``rate_hz``: refreshes per second (default ``NBTRAIN_DASHBOARD_HZ`` or 4).
    ``lines_max_ranks``: up to this many ranks the step time is one line per rank, above it a
    rank x step heatmap. ``window_steps``: recent steps kept per rank in the step-time plot.
    ``start=False`` leaves refreshing to explicit :meth:`refresh` calls (tests, scripts).
    ``show_suspects=True`` also lists suspect stragglers (the detector's early signal) among
    the alerts; by default only confirmed ones, which are worth acting on.
    """

    OUTPUT_LINES = 8  # recent output lines shown per rank

    def __init__(self, job: JobView, *, rate_hz: float | None = None,
                 lines_max_ranks: int = 8, window_steps: int = 600, max_points: int = 20_000,
                 alerts_shown: int = 8, show_suspects: bool = False,
                 start: bool = True) -> None:
        from bokeh.layouts import column, row
        from jupyter_bokeh.widgets import BokehModel

        self.job = job
        self.eventlog = EventLog(show_suspects=show_suspects)
        self.alerts_shown = alerts_shown
        self._row_index = 0
        self._event_index = 0
        self._quiet_ticks = 0
        self._last_goodput_poll = 0.0
        self.rows_drawn = 0

        world = max(job.spec.world_size, job.size_bounds[1])  # an elastic job may grow
        self.step_plot = StepTimePlot(world, lines_max_ranks=lines_max_ranks,
                                      window_steps=window_steps, max_points=max_points)
        self.split_plot = PhaseSplitPlot(width=330)
        self.loss_plot = MetricPlot("loss", width=520)
        self.rate_plot = ThroughputPlot(width=330)
        self.marks = GenerationMarks([self.step_plot.figure, *self.loss_plot.figures,
                                      self.rate_plot.figure])
        self.knob_marks = KnobMarks([*self.loss_plot.figures, self.rate_plot.figure])
        self.plots = BokehModel(column(
            row(self.step_plot.figure, self.split_plot.figure),
            row(self.loss_plot.view, self.rate_plot.figure),
        ))

        self.header = widgets.HTML()
        self.phase = widgets.ToggleButtons(
            options=[(label, key) for key, label in PHASES.items()], value="step",
            description="phase", style={"button_width": "80px"})
        self.phase.observe(lambda change: self.step_plot.set_phase(change["new"]), "value")
        self.checkpoint_panel = widgets.HTML()
        self.alerts_panel = widgets.HTML()
        self.message = widgets.HTML()
        self.buttons: dict[str, widgets.Button] = {}
        controls = self._build_controls()
        #: The elastic resize slider (disabled, with the reason, when the job cannot resize).
        self.resize_slider: widgets.IntSlider | None = None
        self._resize_target = -1
        self.resize_status = widgets.HTML()
        self.resize_box = widgets.HBox(self._build_resize())
        self.extras = widgets.VBox()
        #: The live knobs: an input per declared knob, Apply sends ``job.set`` (None: the
        #: view has no ``set``).
        self.knob_inputs = self._build_knobs()
        self.fault_panel = self._build_fault_panel()
        #: The ranks' recent output, newest last, per rank (shown when there is any).
        self.logs_panel = widgets.HTML()
        self._recent_output: dict[int, deque[str]] = {}
        self._output_index = 0

        self.checkpoint_panel.layout = widgets.Layout(width="38%", margin="0 12px 0 0")
        self.alerts_panel.layout = widgets.Layout(width="60%")
        panels = widgets.HBox([self.checkpoint_panel, self.alerts_panel])
        children: list[widgets.Widget] = [self.header, controls, self.resize_box, panels]
        if self.knob_inputs is not None:
            children.append(self.knob_inputs)
        children += [self.phase, self.plots]
        if self.fault_panel is not None:
            children.append(self.fault_panel)
        children += [self.logs_panel, self.extras]
        super().__init__(children=children)
        self.add_class("nbtrain-dashboard")

        self.poller = Poller(self.refresh, dashboard_hz(rate_hz),
                             name=f"dashboard of {job.name}", on_error=self._show_error)
        self.refresh()
        if start:
            self.poller.start()

    # -- the tick ---------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Pull what is new and draw it. Returns False once the job ended and everything is
        drawn (the poller then stops)."""
        job = self.job
        done = job.done  # read first: rows added before the end are then certainly pulled
        rows, self._row_index = job.rows_since(self._row_index)
        events = job.events
        new_events = events[self._event_index:]
        self._event_index = len(events)
        for event in new_events:
            self.eventlog.add(event)
        self.knob_marks.add(new_events)
        if self.knob_inputs is not None:
            self.knob_inputs.update(new_events)
        if rows:
            self.rows_drawn += feed_plots(rows, (self.step_plot, self.split_plot, self.loss_plot,
                                                 self.rate_plot), self.marks,
                                          self.eventlog.describe_generation)
        if new_events:
            self.step_plot.mark_slow(set(self.eventlog.stragglers))
            self.alerts_panel.value = self._alerts_html()
        output, self._output_index = job.output_since(self._output_index)
        if output:
            self._add_output(output)
        self._poll_goodput()
        self.header.value = self._header_html()
        self.checkpoint_panel.value = checkpoint_html(self.eventlog)
        self._update_controls()
        if done and not rows and not new_events:
            self._quiet_ticks += 1
        else:
            self._quiet_ticks = 0
        # Stop after one quiet tick past the end: late rows from the event stream still land.
        return self._quiet_ticks < 2

    def close(self) -> None:
        """Stop refreshing and close the widgets."""
        poller = getattr(self, "poller", None)
        if poller is not None:
            poller.stop()
        super().close()

    def _add_output(self, records: list[dict[str, Any]]) -> None:
        from nbtrain.runtime.output import format_lines

        for record, line in zip(records, format_lines(records), strict=True):
            recent = self._recent_output.setdefault(int(record["rank"]),
                                                    deque(maxlen=self.OUTPUT_LINES))
            recent.append(line)
        text = "\n".join(line for rank in sorted(self._recent_output)
                         for line in self._recent_output[rank])
        self.logs_panel.value = (
            "<b>Output</b> <span style='color:#777'>(recent lines per rank; all with "
            "job.logs())</span><pre class='nbtrain-logs' style='max-height:14em;overflow:auto;"
            f"font-size:85%;margin:2px 0'>{html.escape(text)}</pre>")

    # -- panels -----------------------------------------------------------------------------
    def _header_html(self) -> str:
        job = self.job
        status = {"name": job.name, "state": job.status.value, "reason": job.reason,
                  "step": job.step, "steps": job.spec.steps, "generation": job.generation,
                  "size": job.size or len(job.slots), "world_size": job.spec.world_size}
        restarts = getattr(job, "restarts", None)
        status["restarts"] = restarts if isinstance(restarts, int) else self.eventlog.restarts
        return header_html(status, self.eventlog, self.rate_plot.latest)

    def _alerts_html(self) -> str:
        return alerts_html(self.eventlog, self.alerts_shown)

    def _poll_goodput(self) -> None:
        """Ask the handle for its goodput (when it has the method) at most every 2 s."""
        fn = getattr(self.job, "goodput", None)
        now = time.monotonic()
        if not callable(fn) or now - self._last_goodput_poll < 2.0:
            return
        self._last_goodput_poll = now
        try:
            value = fn()
        except Exception:
            return
        fraction = (value.get("fraction") if isinstance(value, dict)
                    else getattr(value, "fraction", value))
        if isinstance(fraction, (int, float)):
            self.eventlog.goodput = float(fraction)

    def _show_error(self, exc: BaseException) -> None:
        self.message.value = (f"<span style='color:#c33'>dashboard refresh failed: "
                              f"{html.escape(type(exc).__name__)}: {html.escape(str(exc))}"
                              f"</span>")

    # -- controls ---------------------------------------------------------------------------
    def _build_controls(self) -> widgets.HBox:
        specs: list[tuple[str, str, str, Callable[[], Any] | None]] = [
            ("preempt", "Preempt", "checkpoint, release the slots, wait for Resume",
             getattr(self.job, "preempt", None)),
            ("resume", "Resume", "queue the preempted job again", getattr(self.job, "resume",
                                                                            None)),
            ("checkpoint", "Checkpoint now", "take a checkpoint at the next step boundary",
             getattr(self.job, "checkpoint", None)),
            ("stop", "Stop", "end at the next step boundary and release the slots",
             self.job.stop),
        ]
        for key, label, tip, method in specs:
            if not callable(method):
                continue
            button = widgets.Button(description=label, tooltip=tip,
                                    button_style="danger" if key == "stop" else "")
            button.add_class(f"nbtrain-{key}")
            button.on_click(lambda _b, k=key, m=method: self._act(k, m))
            self.buttons[key] = button
        return widgets.HBox([*self.buttons.values(), self.message])

    def _act(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run a control; the handle returns at once. Errors are shown, never raised into the
        kernel's comm handler (where nobody would see them)."""
        try:
            method(*args, **kwargs)
        except Exception as exc:
            self.message.value = (f"<span style='color:#c33'>{html.escape(what)} failed: "
                                  f"{html.escape(str(exc))}</span>")
        else:
            self.message.value = (f"<i>{html.escape(what)} requested at step "
                                  f"{self.job.step}</i>")
        self._update_controls()

    def _update_controls(self) -> None:
        state = self.job.status.value
        terminal = self.job.status.terminal
        wanted = user_actions(state)
        why_not = self._resize_blocked(state)
        wanted["resize"] = not why_not  # user_actions' rule, and the job must be elastic
        for key, button in self.buttons.items():
            disabled = not wanted.get(key, not terminal)
            if button.disabled != disabled:
                button.disabled = disabled
        if terminal and self.knob_inputs is not None:
            self.knob_inputs.disable(f"the job has ended ({state}): its knobs can no longer "
                                     "change")
        if self.resize_slider is not None:
            self._update_resize(why_not)

    def _resize_blocked(self, state: str) -> str:
        """Why the slider cannot resize the job now ("" when it can)."""
        lo, hi = self.job.size_bounds
        if lo == hi:
            return (f"fixed size ({lo} ranks): submit with min_size= / max_size= to make the "
                    "job elastic")
        if self.job.status.terminal:
            return f"the job has ended ({state})"
        if state == "STOPPING":
            return "the job is stopping (a resize, preemption or stop is under way)"
        return ""

    def _update_resize(self, why_not: str) -> None:
        assert self.resize_slider is not None
        slider = self.resize_slider
        target = self.job.target_size
        if target != self._resize_target:  # follow resizes made elsewhere (the API)
            self._resize_target = target
            slider.value = min(max(target, slider.min), slider.max)
        if slider.disabled != bool(why_not):
            slider.disabled = bool(why_not)
        size = self.job.size
        note = why_not or self.job.resize_note or (
            f"{size} ranks now" + (f", resizing to {target}" if size and size != target
                                   else ""))
        text = f"<span style='color:#666'>{html.escape(note)}</span>"
        if self.resize_status.value != text:
            self.resize_status.value = text

    def _build_resize(self) -> list[widgets.Widget]:
        resize = getattr(self.job, "resize", None)
        if not callable(resize):
            return []
        lo, hi = self.job.size_bounds
        slider = widgets.IntSlider(value=self.job.spec.world_size, min=lo, max=max(hi, lo + 1),
                                   description="ranks", continuous_update=False)
        slider.add_class("nbtrain-resize-slider")
        button = widgets.Button(description="Resize", tooltip="resize at the next step "
                                "boundary: checkpoint, restart at the new size, the rest of the "
                                "epoch split over the new ranks")
        button.add_class("nbtrain-resize")
        button.on_click(lambda _b: self._act(f"resize to {slider.value}", resize,
                                             slider.value))
        self.buttons["resize"] = button
        self.resize_slider = slider
        self.resize_status.add_class("nbtrain-resize-status")
        return [slider, button, self.resize_status]

    def _build_knobs(self) -> KnobInputs | None:
        set_knobs = getattr(self.job, "set", None)
        if not callable(set_knobs):
            return None
        return KnobInputs(lambda values: set_knobs(wait=False, **values))

    def _build_fault_panel(self) -> widgets.Widget | None:
        inject = getattr(self.job, "inject", None)
        if not callable(inject):
            return None
        world = self.job.spec.world_size
        kind = widgets.Dropdown(options=FAULT_KINDS, value="slow", description="fault")
        rank = widgets.BoundedIntText(value=min(1, world - 1), min=0, max=world - 1,
                                      description="rank")
        factor = widgets.BoundedFloatText(value=3.0, min=1.0, max=100.0, step=0.5,
                                          description="slow x")
        button = widgets.Button(description="Inject", button_style="warning",
                                tooltip="inject the fault at the next step (teaching)")
        button.add_class("nbtrain-inject")

        def fire(_b: widgets.Button) -> None:
            options: dict[str, Any] = {"step": None}
            if kind.value == "slow":
                options["factor"] = factor.value
            self._act(f"inject {kind.value} on rank {rank.value}", inject, kind.value,
                      rank.value, **options)

        button.on_click(fire)
        self.buttons["inject"] = button
        self.fault_controls = {"kind": kind, "rank": rank, "factor": factor}
        body = widgets.HBox([kind, rank, factor, button])
        panel = widgets.Accordion(children=[body])
        panel.set_title(0, "Fault injection (teaching): kill, raise, hang or slow a rank")
        panel.selected_index = None
        return panel


#: How long the text view's thread leaves the last lines to a caller of ``job.wait()``.
TAIL_CLAIM_S = 0.5


class TextProgress:
    """Headless view: a progress line every ``interval_s``, a line per alert and the ranks'
    output (``[rank 1 g0] ...``), until the job ends, printed from a daemon thread so
    ``job.wait()`` in a script or a papermill cell does not hold it up (only text is written
    from that thread; no widget is involved). Stragglers are printed once confirmed;
    ``show_suspects=True`` prints the suspects (the early signal) too."""

    def __init__(self, job: JobView, *, interval_s: float | None = None,
                 out: TextIO | None = None, show_suspects: bool = False,
                 start: bool = True) -> None:
        from nbtrain.config import Settings

        self.job = job
        self.interval_s = (Settings.load().progress_interval_s if interval_s is None
                           else float(interval_s))
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {self.interval_s}")
        self.out = out
        self.eventlog = EventLog(show_suspects=show_suspects)
        self.lines = 0
        self._event_index = 0
        self._output_index = 0
        self._stop = threading.Event()
        self._claimed = threading.Event()  # a waiting caller prints the tail (finish)
        self._tail_lock = threading.Lock()
        self._tail_done = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"nbtrain-progress-{job.name}")
        finish_with = getattr(job, "finish_with", None)
        if callable(finish_with):
            finish_with(self.finish)
        if start:
            self._thread.start()

    def finish(self, timeout: float) -> None:
        """The job ended and ``job.wait()`` returns: print the last lines here, in the caller's
        thread. A notebook shows what a thread prints in the cell that started it, and
        papermill keeps no output a cell prints after it finished; the waiting cell is
        running."""
        if threading.current_thread() is self._thread:
            return  # the view's own wait: its thread prints the tail itself
        self._claimed.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._tail()

    def _print(self, text: str) -> None:
        print(text, file=self.out or sys.stdout, flush=True)
        self.lines += 1

    def _run(self) -> None:
        from nbtrain.ui.text import progress_line

        last = ""
        while not self._stop.is_set() and not self._claimed.is_set():
            if self.job.done:
                break
            self._print_alerts()
            line = progress_line(self.job)
            if line != last:
                self._print(line)
                last = line
            with contextlib.suppress(TimeoutError):
                self.job.wait(timeout=self.interval_s)
        if not self._claimed.wait(TAIL_CLAIM_S):  # nobody waits on the job: print it here
            self._tail()

    def _tail(self) -> None:
        """The last lines, once: alerts not shown yet, the final progress line, the newest
        checkpoint, the state per rank, and how the job ended."""
        from nbtrain.ui.text import progress_line

        with self._tail_lock:
            if self._tail_done:
                return
            self._tail_done = True
            self._print_alerts()
            self._print(progress_line(self.job))
            ck = self.eventlog.checkpoint
            if ck.committed_step is not None:
                self._print(f"[{self.job.name}] checkpoint: {ck.describe(time.time())}")
            if self.eventlog.memory:
                self._print(f"[{self.job.name}] {self.eventlog.describe_memory()}")
            self._print(f"[{self.job.name}] {self.job.status.value}: {self.job.reason}")

    def _print_alerts(self) -> None:
        from nbtrain.runtime.output import format_lines

        output, self._output_index = self.job.output_since(self._output_index)
        for line in format_lines(output):
            self._print(line)
        events = self.job.events
        for event in events[self._event_index:]:
            alert = self.eventlog.add(event)
            if alert is not None and alert.kind != "state":
                self._print(f"[{self.job.name}] {alert.level}: {alert.text}")
        self._event_index = len(events)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the final lines are printed."""
        self._thread.join(timeout)

    def stop(self) -> None:
        self._stop.set()

    def __repr__(self) -> str:
        return (f"<nbtrain text progress of job {self.job.name}: a line every "
                f"{self.interval_s:g} s until it ends>")
