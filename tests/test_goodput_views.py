"""The goodput views without a cluster: a job page fed a goodput-sized job's status draws its
speedup curve and current size (and a fixed job's page has no such plot); the cluster's
goodput series sampled from snapshots with known ledgers, and the class page drawing it."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from bokeh.document import Document

from nbtrain.ui.jobpage import JobPage


def curve(*, measured: Mapping[int, float], sizes: tuple[int, ...] = (2, 4, 6, 8),
          confidence: float = 0.8) -> list[dict[str, Any]]:
    """A status's ``speedup`` as ``GoodputModel.points`` writes it: ``measured`` maps a size
    to its mean step time; sizes beyond the largest measured one are less trusted."""
    top = max(measured)
    out = []
    for n in sizes:
        point: dict[str, Any] = {"size": float(n), "speedup": n / 4 * (1 - 0.02 * n),
                                 "confidence": confidence if n <= top else confidence / 4}
        if n in measured:
            point.update(step_s=measured[n], steps=40.0)
        out.append(point)
    return out


@dataclass
class StatusFeed:
    """A job page's feed (``JobFeed``) whose status the test sets; no rows, no events."""

    now: dict[str, Any]
    job_id: str = "j"
    can_control: bool = False
    asked: list[str] = field(default_factory=list)

    def rows_since(self, position: int) -> tuple[list[Any], int]:
        return [], position

    def events_since(self, position: int) -> tuple[list[dict[str, Any]], int]:
        return [], position

    def status(self) -> Mapping[str, Any]:
        return self.now

    def request(self, what: str, arg: Any = None) -> None:
        self.asked.append(what)


def _status(**extra: Any) -> dict[str, Any]:
    return {"state": "RUNNING", "name": "j", "world_size": 4, "min_size": 2, "max_size": 8,
            "size": 4, **extra}


def _page(feed: StatusFeed) -> tuple[JobPage, Document]:
    page = JobPage(feed)
    doc = Document()
    doc.add_root(page.layout)
    return page, doc


def test_a_goodput_jobs_page_draws_its_curve_measured_points_and_current_size() -> None:
    page, doc = _page(StatusFeed(_status(speedup=curve(measured={4: 0.1, 6: 0.072}))))
    assert page.speedup_plot is not None
    assert page.speedup_plot.figure in page.layout.children
    data = doc.get_model_by_name("speedup-curve").data
    assert list(data["size"]) == [2, 4, 6, 8]
    assert list(data["speedup"]) == [n / 4 * (1 - 0.02 * n) for n in (2, 4, 6, 8)]
    assert list(data["confidence"]) == [0.8, 0.8, 0.8, 0.2]
    # the extrapolated size is fainter, and so is the segment that reaches it
    assert data["alpha"][3] < data["alpha"][2] == data["alpha"][0]
    segments = doc.get_model_by_name("speedup-segments").data
    assert list(segments["x0"]) == [2, 4, 6] and list(segments["x1"]) == [4, 6, 8]
    assert segments["alpha"][2] == data["alpha"][3] < segments["alpha"][1]
    measured = doc.get_model_by_name("speedup-measured").data
    assert list(measured["size"]) == [4, 6]
    assert list(measured["step_ms"]) == [100.0, 72.0] and list(measured["steps"]) == [40, 40]
    assert math.isnan(data["step_ms"][0])  # not measured at 2: no step time on hover
    current = doc.get_model_by_name("speedup-current").data
    assert list(current["size"]) == [4] and list(current["speedup"]) == [data["speedup"][1]]
    assert page.speedup_plot.span.location == 4.0 and page.speedup_plot.span.visible


def test_a_fixed_jobs_page_has_no_speedup_plot() -> None:
    page, doc = _page(StatusFeed(_status(speedup=[])))
    page.refresh()
    assert page.speedup_plot is None
    assert doc.get_model_by_name("speedup-curve") is None
    assert doc.get_model_by_name("nbtrain-speedup") is None
    # a status without the field at all (an older controller) neither
    page, doc = _page(StatusFeed(_status()))
    assert page.speedup_plot is None and doc.get_model_by_name("speedup-curve") is None


def test_the_curve_is_redrawn_only_when_it_or_the_size_changed() -> None:
    feed = StatusFeed(_status(speedup=curve(measured={4: 0.1})))
    page, doc = _page(feed)
    plot = page.speedup_plot
    assert plot is not None
    source = doc.get_model_by_name("speedup-curve")
    drawn = source.data
    page.refresh()
    page.refresh()
    assert source.data is drawn  # the same curve: nothing sent to the browser
    # the job ran at 6 too: the curve, its confidence and the measured points change
    feed.now = _status(size=6, speedup=curve(measured={4: 0.1, 6: 0.07}, confidence=0.9))
    page.refresh()
    assert source.data is not drawn
    assert list(doc.get_model_by_name("speedup-measured").data["size"]) == [4, 6]
    assert list(source.data["confidence"]) == [0.9, 0.9, 0.9, 0.225]
    assert list(doc.get_model_by_name("speedup-current").data["size"]) == [6]
    assert plot.span.location == 6.0
    # preempted: it holds no slots; the curve stays, the current size is not marked
    feed.now = {**feed.now, "state": "PREEMPTED", "size": 0}
    page.refresh()
    assert list(doc.get_model_by_name("speedup-current").data["size"]) == []
    assert plot.span.location is None and not plot.span.visible
    assert list(source.data["size"]) == [2, 4, 6, 8]
    assert page.speedup_plot is plot  # one plot, updated in place
    assert sum(1 for c in page.layout.children if c is plot.figure) == 1


# ====================================================================== the cluster's goodput
def _slots(free: int, held: dict[str, int], offline: int = 0) -> list[dict[str, Any]]:
    out = [{"slot": f"f{i}", "state": "free", "job": None} for i in range(free)]
    out += [{"slot": f"{job}{i}", "state": "held", "job": job}
            for job, n in held.items() for i in range(n)]
    return out + [{"slot": f"o{i}", "state": "offline", "job": None} for i in range(offline)]


def _job(job_id: str, size: int, productive_s: float, **extra: Any) -> dict[str, Any]:
    return {"job_id": job_id, "size": size, "goodput": {"productive_s": productive_s},
            **extra}


def test_the_cluster_goodput_is_the_productive_share_of_online_slot_time() -> None:
    from nbtrain.core.clustergoodput import ClusterGoodputSeries, GoodputSeriesSettings

    series = ClusterGoodputSeries(GoodputSeriesSettings(period_s=10.0, max_points=3))
    slots = _slots(2, {"a": 4, "b": 2}, offline=3)  # 8 online: 6 held, 2 free; 3 offline
    # the first sample only sets the ledgers' baselines
    assert series.sample(0.0, 1000.0, slots, [_job("a", 4, 50.0), _job("b", 2, 7.0)]) is None
    assert series.points() == []
    assert not series.due(9.0) and series.due(10.0)
    # over 10 s: a trained all of it (4 slots), b 5 s of it (2 slots; recovering the rest);
    # c, submitted in the period, trained 3 s but holds no slots now (it ended): it adds 0
    point = series.sample(10.0, 1010.0, slots, [
        _job("a", 4, 60.0), _job("b", 2, 12.0), _job("c", 0, 3.0)])
    assert point is not None
    assert point.share == (4 * 10 + 2 * 5) / (8 * 10)
    assert (point.held, point.online, point.speedup) == (6 / 8, 8, 0.0)
    # a rollback (productive_s fell: work lost) counts 0 for that job, never below; a new job
    # counts from 0; a ledger cannot give more than the period; goodput-sized jobs' speedups
    # at their current size add up
    curve_a = [{"size": 2.0, "speedup": 0.6}, {"size": 4.0, "speedup": 1.1}]
    point = series.sample(20.0, 1020.0, slots, [
        _job("a", 4, 40.0, speedup=curve_a), _job("b", 2, 100.0),
        _job("d", 2, 4.0, speedup=[{"size": 2.0, "speedup": 1.0}])])
    assert point is not None
    assert point.share == (0 + 2 * 10 + 2 * 4) / (8 * 10)
    assert point.speedup == 1.1 + 1.0
    # bounded: the newest max_points samples
    for t in (30.0, 40.0):
        series.sample(t, 1000.0 + t, slots, [])
    assert [p["time"] for p in series.points()] == [1020.0, 1030.0, 1040.0]
    assert series.points()[-1]["share"] == 0.0  # nobody trained
    # no online slot: share and held are 0, not a division by zero
    empty = series.sample(50.0, 1050.0, _slots(0, {}, offline=2), [])
    assert empty is not None and (empty.share, empty.held, empty.online) == (0.0, 0.0, 0)


def test_a_restarted_series_continues_the_points_with_a_break_in_the_line() -> None:
    from nbtrain.core.clustergoodput import ClusterGoodputSeries, GoodputSeriesSettings

    settings = GoodputSeriesSettings(period_s=10.0, max_points=100)
    first = ClusterGoodputSeries(settings)
    slots = _slots(0, {"a": 2})
    for t in (0.0, 10.0, 20.0):
        first.sample(t, 1000.0 + t, slots, [_job("a", 2, t)])
    kept = first.points()
    assert [p["share"] for p in kept] == [1.0, 1.0]
    # a new controller, 100 s later, whose ledgers started again
    second = ClusterGoodputSeries(settings, points=kept)
    assert second.points() == kept
    assert second.sample(5.0, 1120.0, slots, [_job("a", 2, 1.0)]) is None  # baselines
    second.sample(15.0, 1130.0, slots, [_job("a", 2, 6.0)])
    cols = second.columns()
    assert cols["time"][:2] == [1010.0, 1020.0] and cols["time"][3] == 1130.0
    assert cols["time"][2] == (1020.0 + 1130.0) / 2 and math.isnan(cols["share"][2])
    assert cols["share"][3] == 0.5


def test_goodput_series_settings_name_the_fix() -> None:
    from nbtrain.core.clustergoodput import GoodputSeriesSettings

    with pytest.raises(ValueError, match=r"period_s=0 must be a positive.*max_points=1 must"):
        GoodputSeriesSettings(period_s=0, max_points=1)


def _cluster_snapshot(productive_s: float) -> dict[str, Any]:
    """A 4-slot cluster as ``cluster_snapshot`` sends it: job a holds 2 slots."""
    slots = [{"slot": f"h#{i}", "host": "h", "nvlink": "h", "address": f"tcp://h:{i}",
              "state": "held" if i < 2 else "free", "job": "a" if i < 2 else None}
             for i in range(4)]
    jobs = [{"job_id": "a", "name": "a", "owner": "ann", "team": "t", "priority": 0,
             "state": "RUNNING", "reason": "", "world_size": 2, "size": 2, "step": 7,
             "steps": None, "restarts": 0, "waiting_s": 0.0,
             "goodput": {"productive_s": productive_s, "fraction": 0.5}}]
    return {"slots": slots, "jobs": jobs, "queue": [], "log": []}


def test_the_class_page_draws_the_cluster_goodput_when_the_series_samples() -> None:
    from nbtrain.core.clustergoodput import ClusterGoodputSeries, GoodputSeriesSettings
    from nbtrain.ui.clusterpage import ClusterPage

    series = ClusterGoodputSeries(GoodputSeriesSettings(period_s=10.0))
    snap = _cluster_snapshot(0.0)

    def sample(now: float, productive_s: float) -> None:
        snap.update(_cluster_snapshot(productive_s))
        series.sample(now, 1.7e9 + now, snap["slots"], snap["jobs"])

    sample(0.0, 0.0)
    sample(10.0, 10.0)  # a trained all 10 s on 2 of the 4 slots
    page = ClusterPage(lambda: snap, lambda job_id: f"job?job={job_id}", goodput=series)
    doc = Document()
    doc.add_root(page.layout)
    assert doc.get_model_by_name("nbtrain-cluster-goodput") is not None
    source = doc.get_model_by_name("cluster-goodput")
    assert list(source.data["time"]) == [1e3 * (1.7e9 + 10.0)]  # ms, for the datetime axis
    assert list(source.data["share"]) == [0.5] and list(source.data["held"]) == [0.5]
    assert list(source.data["online"]) == [4.0]
    drawn = source.data
    page.refresh()
    assert source.data is drawn  # no new sample: nothing redrawn
    sample(20.0, 15.0)  # 5 s of the next 10: a checkpoint or a recovery took the rest
    page.refresh()
    assert list(source.data["share"]) == [0.5, 0.25]
    assert list(source.data["held"]) == [0.5, 0.5]
    # a class page given no series (an older controller's) has no goodput plot
    bare = ClusterPage(lambda: snap, lambda job_id: f"job?job={job_id}")
    assert bare.goodput is None
    assert not any(getattr(m, "name", None) == "cluster-goodput"
                   for m in bare.layout.references())


def test_the_store_keeps_a_note_across_a_reopen(tmp_path: Any) -> None:
    from nbtrain.engine.store import ControllerStore

    store = ControllerStore(tmp_path)
    assert store.note("cluster_goodput") is None
    store.put_note("cluster_goodput", [{"time": 1.0, "share": 0.5}])
    store.put_note("cluster_goodput", [{"time": 2.0, "share": 0.25}])  # replaces it
    store.close()
    again = ControllerStore(tmp_path)
    try:
        assert again.note("cluster_goodput") == [{"time": 2.0, "share": 0.25}]
        assert again.epoch == 2  # the schema's own entries are untouched
    finally:
        again.close()


def _sample_often(dask_scheduler: Any, period_s: float | None) -> int:
    """On the scheduler: the controller's goodput series replaced by one that samples every
    ``period_s`` (None: its default settings, continuing the points); its point count."""
    from nbtrain.core.clustergoodput import ClusterGoodputSeries, GoodputSeriesSettings
    from nbtrain.engine.assets import PLUGIN_NAME

    ctl = dask_scheduler.plugins[PLUGIN_NAME]
    settings = None if period_s is None else GoodputSeriesSettings(period_s=period_s)
    ctl.goodput_series = ClusterGoodputSeries(settings, points=ctl.goodput_series.points())
    return len(ctl.goodput_series.points())


def test_the_class_view_of_a_live_cluster_shows_its_goodput_growing(
        free_cluster: Any) -> None:
    from tests.conftest import wait_for
    from tests.recipes import Regression
    from tests.test_pages import model, page

    client = free_cluster.client
    client.run_on_scheduler(_sample_often, period_s=0.5)
    job = free_cluster.submit(Regression(step_sleep=0.01), world_size=2, steps=10**6,
                              checkpoint=None, name="goodput-live")
    try:
        wait_for(lambda: job.step >= 20, 120, "training")
        url = free_cluster.page().url

        def on_the_page() -> dict[str, list[float]]:
            """The series as a class view opened now shows it (a pulled session is a copy
            of the document at the time: pull again to see more)."""
            with page(url) as doc:
                return {k: list(v) for k, v in model(doc, "cluster-goodput").data.items()}

        # The first points cover the ranks' start (slots held, nothing productive yet); a
        # period spent training all of it reads about 1.
        deadline = time.monotonic() + 60
        shown = on_the_page()
        while not (len(shown["share"]) >= 3 and shown["share"][-1] > 0.5):
            assert time.monotonic() < deadline, f"no training period on the class view: {shown}"
            time.sleep(0.5)
            shown = on_the_page()
        assert shown["held"][-1] == 1.0 and shown["online"][-1] == 2.0  # both slots, the job's
        assert shown["time"] == sorted(shown["time"])
    finally:
        job.stop()
        job.wait(120)
        client.run_on_scheduler(_sample_often, period_s=None)
