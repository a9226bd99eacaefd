"""The live views without a browser: real jobs on the shared cluster, widgets on a recording
comm (what the kernel would send to the browser), buttons pressed with the browser's message.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import comm
import numpy as np
import pytest
import torch
from comm.base_comm import BaseComm

import nbtrain
from nbtrain import JobState
from nbtrain.core.job import JobSpec
from nbtrain.engine.job import JobHandle
from nbtrain.examples import DigitsMLP
from nbtrain.ui import display as display_mod
from nbtrain.ui.cluster_view import ClusterDashboard, ClusterText
from nbtrain.ui.dashboard import JobDashboard, TextProgress, job_dashboard
from nbtrain.ui.eventlog import EventLog
from nbtrain.ui.jobpage import JobPage
from nbtrain.ui.poller import MAX_CONSECUTIVE_ERRORS, Poller
from nbtrain.ui.report import summary, thin_rows, write_report
from nbtrain.ui.static import static_plots
from tests.conftest import wait_for


class RecordingComm(BaseComm):
    """A comm that keeps what the kernel would publish (JSON-encoded, as on the wire)."""

    sent: list[dict[str, Any]]

    def __init__(self, **kwargs: Any) -> None:
        self.sent = []
        super().__init__(**kwargs)

    def publish_msg(self, msg_type: str, data: Any = None, metadata: Any = None,
                    buffers: Any = None, **keys: Any) -> None:
        self.sent.append({"msg_type": msg_type, "data": json.loads(json.dumps(data)),
                          "buffers": len(buffers or [])})


@pytest.fixture
def comms(monkeypatch: pytest.MonkeyPatch) -> list[RecordingComm]:
    made: list[RecordingComm] = []

    def create(**kwargs: Any) -> RecordingComm:
        c = RecordingComm(**kwargs)
        made.append(c)
        return c

    monkeypatch.setattr(comm, "create_comm", create)
    return made


def click(button: Any) -> None:
    """Press a widget button the way the browser does: a custom message on its comm."""
    button.comm.handle_msg({"content": {"data": {"method": "custom",
                                                 "content": {"event": "click"}}},
                            "buffers": []})


def patches(c: RecordingComm) -> int:
    return sum(1 for m in c.sent if m["data"].get("content", {}).get("msg") == "patch"
               or (m["data"].get("msg") == "patch"))


def offline_handle(world_size: int, steps: int = 10_000) -> JobHandle:
    """A real JobHandle attached to no cluster, fed through the follower's own entry point
    (``follow_update``): for the bounded-memory checks, which need more steps than a test
    should train."""
    spec = JobSpec(job_id="offline0", name="offline", world_size=world_size, steps=steps)
    return JobHandle(spec, checkpoint_url="memory://offline",
                     status={"state": "RUNNING", "reason": "training"})


def feed(job: JobHandle, world_size: int, first: int, n: int, t0: float = 1.7e9) -> None:
    for rank in range(world_size):
        rows = [(0, rank, s, t0 + s * 0.01, 0.01 + rank * 1e-4, 1e-3, 6e-3, 2e-3, 1e-3,
                 {"loss": 1.0 / (s + 1)}) for s in range(first, first + n)]
        job.follow_update({"rows": rows})


# -- a real job, watched by the widget and the text view at once ----------------------------
@pytest.fixture(scope="module")
def watched(cluster: nbtrain.Cluster) -> Iterator[dict[str, Any]]:
    wait_for(lambda: len(cluster.free_slots) == 2, 60, "free slots")
    made: list[RecordingComm] = []
    original = comm.create_comm
    comm.create_comm = lambda **kw: made.append(RecordingComm(**kw)) or made[-1]
    try:
        job = cluster.submit(DigitsMLP(eval_every=10), world_size=2, steps=60, name="watched",
                             checkpoint=None)
        out = io.StringIO()
        text = TextProgress(job, interval_s=0.2, out=out)
        dash = JobDashboard(job, start=False, window_steps=1000)
        ticks = [dash.refresh()]
        while ticks[-1]:  # what the poller does, driven here so the test controls the pace
            assert len(ticks) < 10_000, "the dashboard never reported the end"
            job._done.wait(0.05)
            ticks.append(dash.refresh())
        text.join(30)
        yield {"job": job, "dash": dash, "text": out.getvalue(), "comms": made,
               "ticks": len(ticks)}
    finally:
        comm.create_comm = original
    wait_for(lambda: len(cluster.free_slots) == 2, 60, "free slots after the watched job")


def test_widget_draws_every_row_of_a_real_job(watched: dict[str, Any]) -> None:
    job, dash = watched["job"], watched["dash"]
    assert job.status is JobState.SUCCEEDED, job.error
    rows, _ = job.rows_since(0)
    assert dash.rows_drawn == len(rows) == 2 * 60
    assert dash.step_plot.mode == "lines"
    for rank in (0, 1):
        assert list(dash.step_plot.sources[rank].data["step"]) == list(range(1, 61))
    assert list(dash.loss_plot.source.data["step"]) == list(range(1, 61))
    assert len(dash.rate_plot.source.data["step"]) == 59
    assert list(dash.split_plot.source.data["rank"]) == [0, 1]
    assert "SUCCEEDED" in dash.header.value and "step 60/60" in dash.header.value
    # the plots reached the (recorded) wire as Bokeh document patches, in batches
    bokeh_comm = dash.plots.comm
    assert patches(bokeh_comm) > 0
    assert all(b.disabled for b in dash.buttons.values())  # nothing to control any more
    # each rank's training state, as the memory event reported it
    assert "state per rank (ddp, fp32): r0 params" in dash.checkpoint_panel.value


def test_poller_stops_only_after_the_last_rows(watched: dict[str, Any]) -> None:
    # the loop in the fixture ended because refresh() said so: after the end and with
    # every row drawn (checked above), and within two quiet ticks of the end
    assert watched["dash"].refresh() is False


def test_text_progress_prints_lines_and_the_end(watched: dict[str, Any]) -> None:
    text = watched["text"]
    lines = text.strip().splitlines()
    assert any("step" in line and "/60" in line for line in lines)
    assert lines[-1].startswith("[watched] SUCCEEDED")
    assert any(line.startswith("[watched] state per rank (ddp, fp32): r0 params")
               for line in lines)


def test_report_is_standalone_html_with_plots_and_summary(watched: dict[str, Any],
                                                          tmp_path: Path) -> None:
    job = watched["job"]
    path = write_report(job, str(tmp_path / "report.html"))
    page = Path(path).read_text()
    assert "<title>nbtrain report: watched</title>" in page
    assert "cdn.bokeh.org" not in page and "Bokeh" in page  # BokehJS inline
    assert "steptime-r0" in page and "metric-loss" in page  # the dashboard's plots
    assert "SUCCEEDED" in page and "final loss" in page and "median step ms" in page
    assert "<svg" in page
    table = summary(job)
    assert dict(table.rows)["steps"] == "60 of 60"
    assert [r["rank"] for r in table.per_rank] == [0, 1]


def test_static_picture_is_valid_svg(watched: dict[str, Any], tmp_path: Path) -> None:
    picture = static_plots(watched["job"])
    root = ET.fromstring(picture._repr_svg_())
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    lines = root.findall(f"{ns}polyline")
    assert len(lines) == 4  # rank 0, rank 1, loss, throughput
    picture.save(str(tmp_path / "plots.svg"))
    assert (tmp_path / "plots.svg").read_text().startswith("<svg")


# -- controls act on a running job ----------------------------------------------------------
def test_controls_preempt_resume_checkpoint_stop(free_cluster: nbtrain.Cluster,
                                                 comms: list[RecordingComm]) -> None:
    job = free_cluster.submit(DigitsMLP(), world_size=2, steps=1_000_000, name="steered",
                              checkpoint=None)
    dash = JobDashboard(job, start=False)
    try:
        wait_for(lambda: dash.refresh() and job.step >= 5, 120, "training progress")
        assert set(dash.buttons) >= {"stop", "preempt", "resume", "checkpoint", "inject"}
        assert dash.buttons["resume"].disabled and not dash.buttons["preempt"].disabled

        click(dash.buttons["checkpoint"])
        wait_for(lambda: dash.refresh() and dash.eventlog.checkpoint.commits >= 1, 60,
                 "the requested checkpoint to commit")
        assert "last committed step" in dash.checkpoint_panel.value

        click(dash.buttons["preempt"])
        assert "preempt requested" in dash.message.value
        wait_for(lambda: dash.refresh() and job.status is JobState.PREEMPTED, 60, "PREEMPTED")
        assert "PREEMPTED" in dash.header.value
        assert not dash.buttons["resume"].disabled and dash.buttons["preempt"].disabled
        at = job.step

        click(dash.buttons["resume"])
        wait_for(lambda: dash.refresh() and job.status is JobState.RUNNING
                 and job.step > at + 5, 120, "training again after Resume")
        assert job.generation == 1

        click(dash.buttons["stop"])
        wait_for(lambda: (dash.refresh() or True) and job.done, 60, "the job to stop")
        assert job.status is JobState.CANCELLED
        while dash.refresh():
            pass
        assert "CANCELLED" in dash.header.value
    finally:
        job.stop()
        job.wait(60)


def test_fault_panel_calls_inject_with_the_chosen_fault(free_cluster: nbtrain.Cluster,
                                                        comms: list[RecordingComm]) -> None:
    job = free_cluster.submit(DigitsMLP(), world_size=2, steps=1_000_000, name="faulty",
                              checkpoint=None)
    calls: list[tuple[Any, ...]] = []
    real_inject = job.inject

    def spy(*args: Any, **kwargs: Any) -> Any:  # records, then does the real thing
        calls.append((args, kwargs))
        return real_inject(*args, **kwargs)

    job.inject = spy  # type: ignore[method-assign]
    dash = JobDashboard(job, start=False)
    try:
        wait_for(lambda: dash.refresh() and job.status is JobState.RUNNING, 120, "RUNNING")
        assert dash.fault_panel is not None
        dash.fault_controls["kind"].value = "slow"
        dash.fault_controls["rank"].value = 1
        dash.fault_controls["factor"].value = 2.5
        click(dash.buttons["inject"])
        assert calls == [(("slow", 1), {"step": None, "factor": 2.5})]
        assert "inject slow on rank 1 requested" in dash.message.value
        wait_for(lambda: dash.refresh() and "injected slow x2.5 into rank 1"
                 in dash.alerts_panel.value, 60, "the injected slowdown in the alerts")
    finally:
        job.stop()
        job.wait(60)


class RefusingController:
    """What a handle calls on its cluster, answering every request as the controller's
    machine answers a resume of a job that is not PREEMPTED."""

    operator_token = ""

    def credential(self, token: str) -> str:
        return token

    def read_tokens(self, job_id: str, token: str) -> dict[str, object]:
        return {"tokens": {job_id: token} if token else {}, "token": ""}

    def follow(self, handle: object) -> None:
        pass

    def rpc(self, op: str, **kwargs: object) -> dict[str, object]:
        if op == "nbtrain_follow":
            return {"jobs": {}}
        raise ValueError("job offline is RUNNING: only a PREEMPTED job can resume(); to "
                         "continue an ended job submit it again with resume='latest'")


def test_a_failing_control_is_shown_not_raised(comms: list[RecordingComm]) -> None:
    job = offline_handle(2)
    job._cluster = RefusingController()  # type: ignore[assignment]
    dash = JobDashboard(job, start=False)
    # resume() on a job that is not PREEMPTED raises ValueError (the controller judges)
    dash._act("resume", job.resume)
    assert "resume failed" in dash.message.value and "PREEMPTED" in dash.message.value


# -- bounded memory, phase selector, heatmap ---------------------------------------------
@pytest.mark.parametrize("world_size", [2, 16])
def test_rollover_bounds_what_the_plots_hold(world_size: int,
                                             comms: list[RecordingComm]) -> None:
    job = offline_handle(world_size)
    dash = JobDashboard(job, start=False, window_steps=50, max_points=400)
    for first in range(0, 1000, 100):
        feed(job, world_size, first, 100)
        assert dash.refresh()
    assert dash.rows_drawn == 1000 * world_size
    if world_size == 2:
        assert dash.step_plot.mode == "lines"
        assert dash.step_plot.point_count() == 2 * 50
        assert list(dash.step_plot.sources[1].data["step"]) == list(range(950, 1000))
    else:
        assert dash.step_plot.mode == "heatmap"
        assert dash.step_plot.point_count() == 400
    assert len(dash.loss_plot.source.data["step"]) <= dash.loss_plot.window


def test_phase_selector_redraws_the_chosen_phase(comms: list[RecordingComm]) -> None:
    job = offline_handle(2)
    feed(job, 2, 0, 20)
    dash = JobDashboard(job, start=False)
    sent_before = patches(dash.plots.comm)
    dash.phase.value = "comm"
    assert all(r.glyph.y == "comm_ms" for r in dash.step_plot._renderers.values())
    assert "(comm)" in dash.step_plot.figure.title.text
    assert patches(dash.plots.comm) > sent_before

    heat = JobDashboard(offline_handle(16), start=False)
    heat.phase.value = "compute"
    assert heat.step_plot._heat_renderer.glyph.fill_color.field == "compute_ms"


def test_the_ranks_output_is_shown_per_rank(comms: list[RecordingComm]) -> None:
    job = offline_handle(2)
    dash = JobDashboard(job, start=False)
    lines = [{"rank": r, "gen": 0, "stream": "stdout", "text": f"line {i} of rank {r}",
              "time": 1.7e9} for r in (0, 1) for i in range(20)]
    job.follow_update({"output": lines})
    dash.refresh()
    shown = dash.logs_panel.value
    assert "[rank 0 g0] line 19 of rank 0" in shown and "[rank 1 g0] line 19 of rank 1" in shown
    assert "line 11 of rank 0" not in shown  # only the newest lines per rank
    assert len(job.logs(tail=None)) == 40 and job.logs(rank=1, tail=1) == [
        "[rank 1 g0] line 19 of rank 1"]


def test_straggler_lines_are_drawn_thicker(comms: list[RecordingComm]) -> None:
    job = offline_handle(2)
    dash = JobDashboard(job, start=False)
    job.follow_update({"events": [{"kind": "straggler", "rank": 1, "phase": "compute",
                            "state": "confirmed", "ratio": 2.5, "since_step": 7,
                            "hint": "thermal"}]})
    dash.refresh()
    widths = {r: line.glyph.line_width for r, line in dash.step_plot._renderers.items()}
    assert widths[1] > widths[0]
    assert "rank 1 confirmed straggler in compute: 2.50x" in dash.alerts_panel.value


# -- elastic jobs: the resize slider, generation marks -----------------------------------
def test_resize_slider_is_bounded_and_disabled_with_the_reason(
        comms: list[RecordingComm]) -> None:
    fixed = JobDashboard(offline_handle(2), start=False)
    assert fixed.resize_slider is not None and fixed.resize_slider.disabled
    assert fixed.buttons["resize"].disabled
    assert "fixed size (2 ranks): submit with min_size=" in fixed.resize_status.value

    spec = JobSpec(job_id="elastic0", name="elastic", world_size=2, steps=100, min_size=1,
                   max_size=3)
    job = JobHandle(spec, checkpoint_url="memory://offline",
                    status={"state": "RUNNING", "reason": "training", "size": 2,
                            "target_size": 2, "resize_note": ""})
    dash = JobDashboard(job, start=False)
    slider = dash.resize_slider
    assert slider is not None and (slider.min, slider.max, slider.value) == (1, 3, 2)
    assert not slider.disabled and not dash.buttons["resize"].disabled
    assert "2 ranks now" in dash.resize_status.value
    # A resize made elsewhere (the API) moves the slider; the reason it waits is shown.
    job.follow_update({"status": {"state": "RUNNING", "reason": "training", "size": 2,
                           "target_size": 3, "resize_note": "growing to 3 ranks (2 now) when "
                           "1 more slot is free"}})
    dash.refresh()
    assert slider.value == 3 and "when 1 more slot is free" in dash.resize_status.value
    job.follow_update({"status": {"state": "STOPPING", "reason": "resizing", "size": 2,
                           "target_size": 3, "resize_note": ""}})
    dash.refresh()
    assert slider.disabled and "stopping" in dash.resize_status.value
    # The button calls resize(n) on the handle (offline here: the error is shown).
    job.follow_update({"status": {"state": "RUNNING", "reason": "training", "size": 3,
                           "target_size": 3, "resize_note": ""}})
    dash.refresh()
    slider.value = 1
    click(dash.buttons["resize"])
    assert "resize to 1 failed" in dash.message.value and "not attached" in dash.message.value


def test_lines_break_and_marks_appear_at_generation_changes(
        comms: list[RecordingComm]) -> None:
    job = offline_handle(2)
    dash = JobDashboard(job, start=False)
    feed(job, 2, 1, 10)  # generation 0, steps 1..10
    job.follow_update({"events": [{"kind": "resize", "phase": "started", "old": 2, "new": 1,
                            "generation": 1, "reason": "asked", "time": 1.7e9}]})
    rows = [(1, 0, s, 1.7e9 + s, 0.01, 1e-3, 6e-3, 2e-3, 1e-3, {"loss": 0.5})
            for s in range(9, 15)]  # generation 1 resumes from step 8, one rank
    job.follow_update({"rows": rows})
    dash.refresh()
    steps = list(dash.step_plot.sources[0].data["step"])
    values = list(dash.step_plot.sources[0].data["step_ms"])
    [gap] = [i for i, v in enumerate(values) if math.isnan(v)]
    assert steps[:gap] == list(range(1, 11))  # generation 0, then the break
    assert steps[gap:] == [9, *range(9, 15)]  # at the first step of generation 1
    loss = list(dash.loss_plot.source.data["value"])
    assert sum(math.isnan(v) for v in loss) == 1
    assert dash.marks.marks == [(1, 9, "2\u21921 ranks")]
    assert list(dash.marks.source.data["x"]) == [8.5]


# -- the poller -------------------------------------------------------------------------------
def test_poller_runs_on_the_loop_until_tick_says_done() -> None:
    calls: list[int] = []

    def tick() -> bool:
        calls.append(1)
        return len(calls) < 3

    async def main() -> Poller:
        poller = Poller(tick, hz=20.0)
        assert poller.start()
        while poller.running:
            await asyncio.sleep(0.01)
        return poller

    poller = asyncio.run(main())
    assert len(calls) == 3 and poller.ticks == 3 and not poller.running


def test_poller_gives_up_after_repeated_errors_and_reports_them() -> None:
    seen: list[BaseException] = []

    def tick() -> bool:
        raise RuntimeError("boom")

    async def main() -> Poller:
        poller = Poller(tick, hz=20.0, on_error=seen.append)
        poller.start()
        while poller.running:
            await asyncio.sleep(0.01)
        return poller

    poller = asyncio.run(main())
    assert len(seen) == MAX_CONSECUTIVE_ERRORS and str(poller.last_error) == "boom"


def test_dashboard_poller_stops_itself_after_drawing_the_end(
        comms: list[RecordingComm]) -> None:
    """On a running loop (as in the kernel) the dashboard refreshes by itself, draws the rows
    that arrived last, and stops once the job has ended."""
    job = offline_handle(2)

    async def main() -> JobDashboard:
        dash = JobDashboard(job, rate_hz=20.0)
        assert dash.poller.running
        feed(job, 2, 1, 30)
        job.follow_update({"status": {"state": "SUCCEEDED", "reason": "completed 30 steps"}})
        while dash.poller.running:
            await asyncio.sleep(0.01)
        return dash

    dash = asyncio.run(main())
    assert dash.rows_drawn == 60 and dash.step_plot.point_count() == 60
    assert "SUCCEEDED" in dash.header.value and dash.poller.ticks >= 3


def test_poller_without_a_loop_does_not_start() -> None:
    assert Poller(lambda: True, hz=4.0).start() is False


# -- display mode -----------------------------------------------------------------------------
def test_display_mode_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NBTRAIN_DISPLAY", raising=False)
    assert display_mod.resolve_display() == "text"  # not in a kernel
    assert display_mod.resolve_display("widget") == "widget"
    monkeypatch.setenv("NBTRAIN_DISPLAY", "widget")
    assert display_mod.resolve_display("auto") == "widget"
    assert display_mod.resolve_display("text") == "text"  # an explicit argument wins
    assert display_mod.resolve_display("page") == "page"
    monkeypatch.setenv("NBTRAIN_DISPLAY", "txt")
    with pytest.raises(ValueError, match=r"NBTRAIN_DISPLAY.*auto, page, widget, text"):
        display_mod.resolve_display()
    with pytest.raises(ValueError, match="one of auto, page, widget, text"):
        display_mod.resolve_display("html")


def test_refresh_rate_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NBTRAIN_DASHBOARD_HZ", raising=False)
    assert display_mod.dashboard_hz() == display_mod.DEFAULT_HZ
    monkeypatch.setenv("NBTRAIN_DASHBOARD_HZ", "8")
    assert display_mod.dashboard_hz() == 8.0
    assert display_mod.dashboard_hz(2) == 2.0
    with pytest.raises(ValueError, match=r"use 0\.2 to 20"):
        display_mod.dashboard_hz(100)


def test_job_dashboard_text_mode_returns_text_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBTRAIN_DISPLAY", "text")
    job = offline_handle(2)
    view = job_dashboard(job, start=False)
    assert isinstance(view, TextProgress)
    assert "text progress of job offline" in repr(view)


# -- event folding ----------------------------------------------------------------------------
def test_eventlog_folds_checkpoints_stragglers_and_unknown_kinds() -> None:
    log = EventLog()
    t = 1.7e9
    log.add({"kind": "checkpoint", "phase": "snapshot", "step": 10, "bytes": 2048,
             "blocking_ms": 3.0, "time": t})
    assert log.checkpoint.in_flight_step == 10 and log.checkpoint.committed_step is None
    log.add({"kind": "checkpoint", "phase": "committed", "step": 10, "time": t + 1})
    ck = log.checkpoint
    assert (ck.committed_step, ck.in_flight_step, ck.commits, ck.bytes) == (10, None, 1, 2048)
    assert ck.describe(t + 31) == ("last committed step 10, 30 s ago, 2.0 KB, "
                                   "blocked 3.0 ms")
    log.add({"kind": "straggler", "rank": 3, "phase": "comm", "state": "confirmed",
             "ratio": 1.8, "since_step": 5, "time": t})
    assert set(log.stragglers) == {3}
    log.add({"kind": "straggler", "rank": 3, "phase": "comm", "state": "cleared", "time": t})
    assert log.stragglers == {}
    assert log.add({"kind": "mitigation", "action": "alert", "rank": 3, "time": 123.0}) is None
    odd = log.add({"kind": "resize_planned", "rank": 1, "to": 4, "time": 55.5})
    assert odd is not None and odd.time is None  # a monotonic stamp is not a time of day
    assert "resize_planned" in odd.text and "to=4" in odd.text
    assert log.add({"kind": "rank_started", "rank": 0}) is None
    log.add({"kind": "recovery", "generation": 2, "recovery_s": 4.5, "lost_steps": 3})
    assert log.restarts == 1
    assert log.recent(1)[0].text == "recovered: generation 2 in 4.5 s, 3 steps redone"


def straggler_events() -> list[dict[str, Any]]:
    """Verdicts as the detector makes them: rank 2's own comm wait 5 ms above peers that wait
    about none (suspect only: 5% of a step), and rank 1's compute 2x (confirmed)."""
    from nbtrain.core.records import Phase
    from nbtrain.core.straggler import StragglerDetector
    from tests.test_straggler import ddp_frames

    comm_frames = ddp_frames(3, 80)
    for f in comm_frames:
        ready = f.phases[0] + f.phases[1] + f.phases[3]
        f.phases[2] = ready.max() - ready + (0.005 if f.step >= 40 else 0.0) * (
            np.arange(3) == 2)
    comm_det, compute_det = StragglerDetector(3), StragglerDetector(3)
    verdicts = [d for f in comm_frames for d in comm_det.observe_frame(f)]
    verdicts += [d for f in ddp_frames(3, 200, slow=(1, Phase.COMPUTE, 2.0, 30, 150))
                 for d in compute_det.observe_frame(f)]
    return [{**d.to_event(), "kind": "straggler", "time": 1.7e9 + i}
            for i, d in enumerate(verdicts)]


@dataclass
class FixedFeed:
    """A served page's feed (``nbtrain.ui.jobpage.JobFeed``) over a fixed list of events."""

    events: list[dict[str, Any]]
    job_id: str = "j"
    can_control: bool = False

    def rows_since(self, position: int) -> tuple[list[Any], int]:
        return [], position

    def events_since(self, position: int) -> tuple[list[dict[str, Any]], int]:
        return self.events[position:], len(self.events)

    def status(self) -> Mapping[str, Any]:
        return {"state": "SUCCEEDED", "name": "j", "world_size": 3}

    def request(self, what: str, arg: Any = None) -> None:
        raise PermissionError("read-only")


@pytest.mark.parametrize("show_suspects", [False, True])
def test_views_show_confirmed_stragglers_and_suspects_on_demand(
        show_suspects: bool, comms: list[RecordingComm]) -> None:
    events = straggler_events()
    states = [(e["rank"], e["phase"], e["state"]) for e in events]
    assert (2, "comm", "suspect") in states and (1, "compute", "confirmed") in states
    assert (2, "comm", "confirmed") not in states
    job = offline_handle(3)
    job.follow_update({"events": events, "status": {"state": "SUCCEEDED", "reason": "done"}})
    assert [e["level"] for e in job.alerts] == [
        {"suspect": "warning", "confirmed": "critical", "cleared": "info"}[e["state"]]
        for e in events]
    out = io.StringIO()
    text = TextProgress(job, interval_s=0.1, out=out, show_suspects=show_suspects)
    text.join(30)
    dash = JobDashboard(job, start=False, show_suspects=show_suspects, alerts_shown=20)
    panel = dash.alerts_panel.value
    printed = out.getvalue()
    served = JobPage(FixedFeed(events), show_suspects=show_suspects, alerts_shown=20)
    for shown in (printed, panel, served.alerts.text):
        # (the injected slowdown is 2x)
        assert re.search(r"rank 1 confirmed straggler in compute: [12]\.\d\dx its peers", shown)
        assert "rank 1 is no longer slow (compute)" in shown
        assert "inf" not in shown.replace("info", "")
        suspect = r"rank 2 suspect straggler in comm: \+\d\.\d ms/step \(peers ~0 ms\)"
        assert bool(re.search(suspect, shown)) is show_suspects
        assert ("rank 1 suspect" in shown) is show_suspects


def test_eventlog_keeps_the_newest_generations_memory_per_rank() -> None:
    log = EventLog()
    mem = {"kind": "memory", "strategy": "fsdp", "precision": "fp32",
           "optimizer_bytes": 2 * 1024 * 1024}
    assert log.describe_memory() == ""
    log.add({**mem, "rank": 0, "gen": 0, "params_bytes": 4 * 1024 * 1024})
    log.add({**mem, "rank": 0, "gen": 1, "params_bytes": 1024 * 1024})
    log.add({**mem, "rank": 1, "gen": 1, "params_bytes": 1024 * 1024})
    log.add({**mem, "rank": 2, "gen": 0, "params_bytes": 9})  # late, from the old generation
    assert sorted(log.memory) == [0, 1] and log.memory_generation == 1
    assert log.describe_memory() == ("state per rank (fsdp, fp32): r0 params 1.0 MB + "
                                     "optimizer 2.0 MB; r1 params 1.0 MB + optimizer 2.0 MB")
    assert not log.alerts  # a panel line, not an alert
    for rank in range(2, 10):
        log.add({**mem, "rank": rank, "gen": 1, "params_bytes": 1024 * 1024})
    text = log.describe_memory()
    assert "r3 params" in text and "... 4 more ..." in text and "r9 params" in text
    assert "r5 params" not in text


def test_state_memory_counts_local_tensors_once() -> None:
    from nbtrain.runtime.memory import state_memory

    lin = torch.nn.Linear(4, 4).double()
    model = torch.nn.Sequential(lin, torch.nn.Tanh(), lin)  # the same layer twice: tied
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = (16 + 4) * 8
    assert state_memory({"model": model, "optimizer": opt}) == {
        "params_bytes": params, "grads_bytes": 0, "optimizer_bytes": 0}
    model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()  # SGD creates its momentum buffers in its first step
    assert state_memory({"model": model, "optimizer": opt, "extra": [model]}) == {
        "params_bytes": params, "grads_bytes": params, "optimizer_bytes": params}


def test_thin_rows_keeps_the_same_steps_on_every_rank() -> None:
    rows = [(0, r, s, 0.0, 0.1, 0, 0, 0, 0, {}) for s in range(1, 1001) for r in range(2)]
    kept = thin_rows(rows, 100)
    per_rank = {r: [row[2] for row in kept if row[1] == r] for r in (0, 1)}
    assert per_rank[0] == per_rank[1]
    assert len(per_rank[0]) <= 101 and per_rank[0][-1] == 1000


# -- cluster view -----------------------------------------------------------------------------
def test_cluster_view_shows_slots_by_job_and_why_jobs_wait(free_cluster: nbtrain.Cluster,
                                                           comms: list[RecordingComm]) -> None:
    running = free_cluster.submit(DigitsMLP(), world_size=2, steps=1_000_000, name="holder",
                                  checkpoint=None)
    waiting = free_cluster.submit(DigitsMLP(), world_size=2, steps=10, name="waiter",
                                  checkpoint=None)
    view = ClusterDashboard(free_cluster, start=False)
    try:
        wait_for(lambda: view.refresh() and running.status is JobState.RUNNING, 120, "RUNNING")
        view.refresh()
        data = view.source.data
        assert list(data["job"]) == ["holder", "holder"]
        assert set(data["state"]) == {"RUNNING"}
        assert "waiter" in view.jobs.value and html_escape(waiting.reason) in view.jobs.value
        assert "0 free" in view.header.value
        text = repr(ClusterText(free_cluster))
        assert "holder | holder" in text and "job waiter: QUEUED" in text
    finally:
        running.stop()
        waiting.stop()
        running.wait(60)
        waiting.wait(60)
    wait_for(lambda: view.refresh() and set(view.source.data["state"]) == {"free"}, 60,
             "slots shown free")


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


def test_loss_covers_the_whole_run_in_bounded_memory_and_keeps_the_breaks() -> None:
    from nbtrain.ui.plots import MetricPlot

    plot = MetricPlot("loss", window=100)
    for gen, steps in ((0, range(1, 3001)), (1, range(2990, 6001))):
        plot.add([(gen, 0, s, 1.7e9 + s, 0.01, 0, 0.01, 0, 0, {"loss": 1.0 / s})
                  for s in steps])
    data = plot.source.data
    steps, values = list(data["step"]), list(data["value"])
    assert len(steps) <= 100
    assert steps[0] == 1 and steps[-1] > 5900  # the start of the run is still there
    [gap] = [i for i, v in enumerate(values) if math.isnan(v)]
    assert steps[gap] == 2990 and all(g == 0 for g in list(data["generation"])[:gap])


def test_views_mark_knob_changes_with_their_author(comms: list[RecordingComm]) -> None:
    """The widget and the served page draw a mark where a live change took effect, saying
    what changed and who changed it."""
    events = [{"kind": "knob_set", "time": 1.7e9, "change": {
                  "seq": 1, "values": {"lr": 0.01}, "who": "ann", "ramp": 0}},
              {"kind": "knob_applied", "time": 1.7e9 + 1, "rank": 0, "gen": 0, "step": 41,
               "values": {"lr": 0.01}, "changes": [
                   {"seq": 1, "values": {"lr": 0.01}, "who": "ann", "ramp": 0},
                   {"seq": 2, "values": {"aux_weight": 0.5}, "who": "bob", "ramp": 20}]}]
    job = offline_handle(2)
    job.follow_update({"events": events, "status": {"state": "SUCCEEDED", "reason": "done"}})
    dash = JobDashboard(job, start=False)
    dash.refresh()
    served = JobPage(FixedFeed(events))
    served.refresh()
    for view in (dash, served):
        assert view.knob_marks.marks == [
            (42, "lr=0.01 by ann; aux_weight=0.5 over 20 steps by bob")]
    assert "knob change by ann: lr=0.01" in served.alerts.text


@dataclass
class SteerableFeed(FixedFeed):
    """A fixed feed whose viewer owns the job and records what the page asks for."""

    can_control: bool = True
    asked: list[tuple[str, Any]] | None = None

    def request(self, what: str, arg: Any = None) -> None:
        if self.asked is None:
            self.asked = []
        self.asked.append((what, arg))
        if arg and arg.get("values", {}).get("aux_weight", 0) > 1:
            raise ValueError("cannot set the knobs of job j: aux_weight=2: 2 is above its max 1")

    def status(self) -> Mapping[str, Any]:
        return {"state": "RUNNING", "name": "j", "world_size": 2}


def test_owner_page_has_an_input_per_knob_and_sends_changes() -> None:
    specs = [{"name": "lr", "default": 0.1, "min": 0.0, "max": None, "builtin": True},
             {"name": "aux_weight", "default": 0.1, "min": 0.0, "max": 1.0, "builtin": False}]
    events: list[dict[str, Any]] = []
    feed = SteerableFeed(events)
    page = JobPage(feed)
    assert page.knobs is not None and page.knobs.inputs == {}  # not declared yet
    events.append({"kind": "knobs", "time": 1.7e9, "rank": 0, "gen": 0, "specs": specs,
                   "values": {"lr": 0.1, "aux_weight": 0.1}, "step": 0, "history": []})
    page.refresh()
    assert sorted(page.knobs.inputs) == ["aux_weight", "lr"]
    assert list(page.knobs.sliders) == ["aux_weight"]  # only a knob with both bounds
    page.knobs.send()
    assert feed.asked is None  # nothing changed: nothing sent
    page.knobs.sliders["aux_weight"].value = 0.4  # the slider moves its number input
    assert page.knobs.inputs["aux_weight"].value == 0.4
    page.knobs.send()
    assert feed.asked == [("set", {"values": {"aux_weight": 0.4}, "who": "job page"})]
    page.knobs.inputs["aux_weight"].value = 2.0
    page.knobs.send()
    assert "aux_weight=2: 2 is above its max 1" in page.message.text
    events.append({"kind": "knob_applied", "time": 1.7e9, "rank": 0, "gen": 0, "step": 9,
                   "changes": [], "values": {"lr": 0.1, "aux_weight": 0.4}})
    page.refresh()
    assert "aux_weight=0.4" in page.knobs.note.text
    # A read-only page has no knob inputs.
    assert JobPage(FixedFeed(events)).knobs is None


@dataclass
class RowsFeed(FixedFeed):
    """A fixed feed with step rows (rank 0's loss falling by orders of magnitude)."""

    rows: list[Any] | None = None

    def rows_since(self, position: int) -> tuple[list[Any], int]:
        rows = self.rows or []
        return rows[position:], len(rows)


def loss_rows(losses: list[float]) -> list[Any]:
    return [(0, 0, s, 1.7e9 + s, 0.01, 0, 0.01, 0, 0, {"loss": v})
            for s, v in enumerate(losses, start=1)]


def test_loss_axis_toggle_in_the_page_the_widget_and_the_report(
        comms: list[RecordingComm], tmp_path: Path) -> None:
    """The loss is drawn on a log axis by default, a linear one a click away; the toggle
    runs in the browser, so the served page, the widget and the standalone report have it."""
    from bokeh.document import Document
    from bokeh.models import CustomJS, LogScale, RadioButtonGroup

    page = JobPage(RowsFeed([], rows=loss_rows([10.0 ** -(s / 20) for s in range(1, 101)])))
    doc = Document()
    doc.add_root(page.layout)
    [toggle] = doc.select({"name": "metric-loss-scale", "type": RadioButtonGroup})
    assert toggle.labels == ["linear", "log"] and toggle.active == 1
    linear, log = page.loss_plot.figures
    assert isinstance(log.y_scale, LogScale) and not isinstance(linear.y_scale, LogScale)
    assert (linear.visible, log.visible) == (False, True)
    assert log.x_range is linear.x_range  # zoom on one, the other follows
    [callback] = toggle.js_property_callbacks["change:active"]
    assert isinstance(callback, CustomJS)
    assert callback.args == {"linear": linear, "log": log}
    assert "linear.visible = cb_obj.active == 0" in callback.code
    assert len(page.loss_plot.source.data["value"]) == 100
    # both figures carry the generation and knob marks
    assert all(any(r.data_source is page.marks.source for r in f.renderers)
               for f in (linear, log))
    # the viewer's choice (the toggle as the browser sets it) is kept ...
    toggle.active = 0
    page.feed.rows = page.feed.rows + loss_rows([-1.0])  # type: ignore[attr-defined,operator]
    page.refresh()
    assert page.loss_plot.scale == "linear"
    toggle.active = 1
    page.refresh()
    assert page.loss_plot.scale == "log"
    # ... while a plot nobody touched turns linear at its first value <= 0
    fresh = JobPage(RowsFeed([], rows=loss_rows([2.0, 1.0, 0.0, -0.5])))
    assert fresh.loss_plot.scale == "linear"
    assert (fresh.loss_plot.figure.visible, fresh.loss_plot.log_figure.visible) == (True, False)
    # the widget draws the same plot
    job = offline_handle(1)
    feed(job, 1, 0, 50)
    dash = JobDashboard(job, start=False)
    dash.refresh()
    assert dash.loss_plot.scale == "log" and dash.loss_plot.scale_toggle.labels == ["linear", "log"]
    assert dash.loss_plot.view in dash.plots._model.select({"name": "metric-loss-view"})
    # the report, standalone HTML, has the toggle and its script
    path = write_report(job, str(tmp_path / "report.html"))
    text = Path(path).read_text()
    assert "metric-loss-scale" in text and "LogScale" in text
    assert "linear.visible = cb_obj.active == 0" in text
