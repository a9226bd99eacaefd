"""The pages the cluster serves (nbtrain.engine.pages), read with Bokeh's own client: a real
scheduler's web server, real Bokeh sessions, the documents the browser would get. The browser
test drives them in Chromium."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
from bokeh.client import pull_session

import nbtrain
from nbtrain import Fault, JobState, Settings
from nbtrain.engine.standalone import BIN, free_port, standalone_cluster
from tests.clients import run_client
from tests.conftest import wait_for
from tests.recipes import Regression


@contextlib.contextmanager
def page(url: str) -> Iterator[Any]:
    """The page's Bokeh document, as a browser session would hold it."""
    base, _, query = url.partition("?")
    args = {k: v[0] for k, v in parse_qs(query).items()}
    with pull_session(url=base, arguments=args) as session:
        yield session.document


def model(doc: Any, name: str) -> Any:
    found = doc.select({"name": name})
    return next(iter(found)) if found else None


def generations_never_joined(doc: Any, ranks: int) -> list[int]:
    """The generations seen on each rank's step-time line; asserts a NaN point sits between
    every two consecutive points of different generations (the line is broken there)."""
    seen: list[int] = []
    for rank in range(ranks):
        data = model(doc, f"steptime-r{rank}").data
        gens, values = list(data["generation"]), list(data["step_ms"])
        for i in range(1, len(gens)):
            if gens[i] != gens[i - 1]:
                assert math.isnan(values[i]) or math.isnan(values[i - 1]), (rank, i)
        seen += sorted(set(gens))
    return seen


def test_the_owner_gets_controls_others_a_read_only_page(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.01), world_size=2, steps=10**6,
                              checkpoint=None, name="paged")
    try:
        wait_for(lambda: job.step >= 10, 120, "training")
        mine = job.page()
        assert mine.controls and "ticket=" in mine.url
        with page(mine.url) as doc:
            assert {"nbtrain-preempt", "nbtrain-stop", "nbtrain-checkpoint"} <= {
                m.name for m in doc.roots[0].references()}
            assert "paged" in model(doc, "nbtrain-header").text
            assert len(model(doc, "steptime-r1").data["step"]) >= 10
            # each rank's training state, from the memory events
            assert "state per rank (ddp, fp32): r0 params" in model(
                doc, "nbtrain-checkpoint-panel").text
        anyone = mine.url.split("&ticket=")[0]
        forged = anyone + "&ticket=not-a-ticket"
        for url in (anyone, forged):
            with page(url) as doc:
                names = {m.name for m in doc.roots[0].references()}
                assert "nbtrain-stop" not in names and "nbtrain-preempt" not in names
                assert "read-only" in model(doc, "nbtrain-message").text
        listed = json.loads(urllib.request.urlopen(
            free_cluster.page_url("individual-plots.json"), timeout=30).read())
        assert {"/individual-nbtrain-job", "/individual-nbtrain-cluster"} <= set(
            listed.values())  # what dask-labextension shows in JupyterLab's Dask panel
    finally:
        job.stop()
        job.wait(120)


def test_no_line_joins_two_generations_after_a_preemption_and_a_recovery(
        free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.01), world_size=2, steps=10**6,
                              checkpoint=5, name="generations",
                              faults=[Fault("kill", rank=1, step=15)])
    try:
        wait_for(lambda: job.restarts == 1 and job.step >= 25, 180, "the recovery")
        job.preempt()
        wait_for(lambda: job.status is JobState.PREEMPTED, 120, "preempted")
        held = job.step
        job.resume()
        # steps of generation 2 itself (the step count alone may be past 40 already)
        wait_for(lambda: job.generation == 2 and job.step >= held + 10, 180, "the resumed job")
        with page(job.page().url) as doc:
            assert set(generations_never_joined(doc, 2)) == {0, 1, 2}
            marks = model(doc, "generation-marks").data
            assert list(marks["generation"]) == [1, 2]
            assert list(marks["kind"]) == ["restart", "resume"]
            assert "worker died" in marks["label"][0] and "preempt" in marks["label"][1]
            loss = model(doc, "metric-loss").data
            assert sum(1 for v in loss["value"] if math.isnan(v)) == 2
    finally:
        job.stop()
        job.wait(120)


def test_class_view_shows_every_clients_jobs_and_the_page_outlives_its_kernel(
        tmp_path: Path) -> None:
    with standalone_cluster(2, logs=tmp_path / "logs") as cc:
        owner = run_client(f"""
            import nbtrain, os, time
            c = nbtrain.connect({cc.address!r})
            job = c.submit(recipes.Regression(step_sleep=0.02), world_size=1, steps=10**6,
                           name="alice", team="teaching", checkpoint=None)
            while job.step < 5:
                time.sleep(0.05)
            print(json.dumps({{"url": job.page().url}}), flush=True)
            os.kill(os.getpid(), 9)  # the kernel dies
        """, env={"NBTRAIN_TOKEN_FILE": str(tmp_path / "alice.json")})
        out, err = owner.communicate(timeout=180)
        assert owner.returncode == -signal.SIGKILL, err
        alice_url = json.loads(out.strip().splitlines()[-1])["url"]
        settings = Settings.load(token_file=str(tmp_path / "bob.json"))
        with nbtrain.connect(cc.address, settings=settings) as bob:
            mine = bob.submit(Regression(step_sleep=0.02), world_size=1, steps=10**6,
                              name="bob", checkpoint=None)
            wait_for(lambda: mine.step >= 5, 120, "bob's job training")
            with page(bob.page().url) as doc:
                wait_for(lambda: sorted(model(doc, "cluster-jobs").data["state"]) == [
                    "RUNNING", "RUNNING"], 30, "both jobs in the class view")
                jobs = model(doc, "cluster-jobs").data
                assert sorted(j.split(">")[1].split("<")[0] for j in jobs["link"]) == [
                    "alice", "bob"]
                assert len(set(jobs["owner"])) >= 1 and "teaching" in jobs["team"]
                assert sorted(set(model(doc, "cluster-slots").data["job"])) == ["alice", "bob"]
                # the teacher's view: both teams' shares of slot-time, in the page and the
                # snapshot; a third job waits, and says for how long
                wait_for(lambda: sorted(model(doc, "cluster-teams").data["team"]) == [
                    "default", "teaching"], 30, "both teams in the fair-share table")
                waits = bob.submit(Regression(), world_size=1, steps=5, name="bob-waits",
                                   checkpoint=None)
                wait_for(lambda: any(w["name"] == "bob-waits" and w["waiting_s"] > 0.5
                                     for w in bob.snapshot()["waiting"]), 60, "a waiting job")
                with page(bob.page().url) as now:  # a page opened now shows it waiting
                    queue = model(now, "nbtrain-queue").text
                    assert "bob-waits" in queue and "waiting" in queue, queue
                snap = bob.snapshot()
                shares = {t["team"]: t for t in snap["teams"]}
                assert shares["teaching"]["slot_s"] > 0 and shares["default"]["slot_s"] > 0
                assert sum(t["share"] for t in snap["teams"]) == pytest.approx(1.0)
                assert shares["default"]["waiting"] == 1
                assert sum(st["jobs"] for st in snap["students"]) == 3
                assert any(line["text"].startswith("worker ") and line["text"].endswith(
                    " joined") for line in snap["log_lines"]), snap["log_lines"]
                waits.stop()
            # Alice's kernel is gone; her page (with her ticket) still updates, and steers.
            # (by the newest step shown: the plot keeps a window of steps, which a job that
            # has trained this long has filled, so the count of rows stops growing)
            with page(alice_url) as doc:
                newest = max(model(doc, "steptime-r0").data["step"], default=0)
                assert "nbtrain-stop" in {m.name for m in doc.roots[0].references()}
            with page(alice_url) as doc:
                wait_for(lambda: max(model(doc, "steptime-r0").data["step"], default=0)
                         > newest, 60, "the page updating after its kernel died")
            mine.stop()
            alice = bob.job("alice")
            bob.rpc("nbtrain_request", job_id=alice.id, what="stop",
                             token=cc.operator_token)
            assert alice.wait(120) is JobState.CANCELLED


def test_pages_are_served_by_a_scheduler_started_without_nbtrain(tmp_path: Path) -> None:
    """A plain ``dask scheduler`` (no preload): the controller starts with the first client
    and serves the pages from a second Bokeh application on the same web server."""
    port = free_port()
    log = open(tmp_path / "scheduler.log", "wb")  # noqa: SIM115
    sched = subprocess.Popen(
        [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
         "--dashboard-address", "127.0.0.1:0"], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    worker = subprocess.Popen(
        [str(BIN / "dask"), "worker", f"tcp://127.0.0.1:{port}", "--nthreads", "1",
         "--host", "127.0.0.1", "--no-dashboard"], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True, env={**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"})
    try:
        settings = Settings.load(token_file=str(tmp_path / "t.json"),
                                 state_dir=str(tmp_path / "state"))
        with nbtrain.connect(f"tcp://127.0.0.1:{port}", settings=settings) as c, \
                page(c.page().url) as doc:
            assert "nbtrain cluster" in model(doc, "nbtrain-cluster-header").text
    finally:
        for proc in (worker, sched):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        log.close()


@pytest.mark.parametrize("display", ["page", "auto"])
def test_dashboard_in_a_kernel_is_the_served_page(display: str, monkeypatch: pytest.MonkeyPatch,
                                                  free_cluster: nbtrain.Cluster) -> None:
    from nbtrain.ui import display as display_mod
    from nbtrain.ui.pageview import PageView

    monkeypatch.delenv("NBTRAIN_DISPLAY", raising=False)
    monkeypatch.setattr(display_mod, "in_kernel", lambda: True)
    job = free_cluster.submit(Regression(), world_size=1, steps=5, checkpoint=None)
    view = job.dashboard(display=display)
    assert isinstance(view, PageView) and view.controls
    assert f"<iframe src='{view.url}" in view._repr_html_().replace("&amp;", "&")
    early = job.dashboard(display=display, show_suspects=True)  # suspect stragglers too
    assert "suspects=1" in early.url and "suspects" not in view.url
    with page(early.url) as doc:
        assert model(doc, "nbtrain-alerts") is not None
    assert isinstance(free_cluster.dashboard(display=display), PageView)
    job.wait(120)


def test_the_page_module_imports_without_bokeh_server_at_import_time() -> None:
    code = ("import sys, nbtrain.engine.pages; "
            "print('bokeh.server' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def _feed_across_forgetting(dask_scheduler: Any, job_id: str) -> list[dict[str, Any]]:
    """On the scheduler: a job page's feed before and after the controller drops the ended
    job from memory (what ``jobs_kept`` does), and a new feed opened only after."""
    from nbtrain.engine.assets import PLUGIN_NAME
    from nbtrain.engine.pages import ControllerFeed

    ctl = dask_scheduler.plugins[PLUGIN_NAME]
    feed = ControllerFeed(ctl, job_id)
    before = dict(feed.status())
    ctl.ended.remove(job_id)
    ctl.machine.forget(job_id)
    ctl.assets.pop(job_id)
    return [before, dict(feed.status()), dict(ControllerFeed(ctl, job_id).status())]


def _owner_page_sets(dask_scheduler: Any, job_id: str, lr: float) -> dict[str, Any]:
    """On the scheduler: an owner's page (a ticket the controller issued) sets the job's
    ``lr`` through its knob inputs; what the page then shows."""
    from nbtrain.engine.assets import PLUGIN_NAME
    from nbtrain.engine.pages import ControllerFeed
    from nbtrain.engine.tickets import issue_ticket
    from nbtrain.ui.jobpage import JobPage

    ctl = dask_scheduler.plugins[PLUGIN_NAME]
    served = JobPage(ControllerFeed(ctl, job_id, issue_ticket(ctl, job_id)))
    assert served.knobs is not None
    inputs = {name: field.mode for name, field in served.knobs.inputs.items()}
    served.knobs.inputs["lr"].value = lr
    served.knobs.send()
    return {"inputs": inputs, "message": served.message.text}


def test_the_owners_page_sets_knobs(free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.01), world_size=2, steps=10**6,
                              checkpoint=None, name="knob-page")
    try:
        wait_for(lambda: bool(job.knobs.declared) and job.step >= 3, 120, "its knobs")
        shown = free_cluster.client.run_on_scheduler(_owner_page_sets, job_id=job.id,
                                                     lr=0.01)
        # The optimizer's knobs, the checkpoint interval and the controller's straggler
        # settings; whole numbers where the knob counts steps.
        assert set(shown["inputs"]) == {"grad_clip", "lr", "lr_factor", "weight_decay",
                                        "checkpoint_every", "straggler_ratio",
                                        "straggler_window", "straggler_suspect_votes",
                                        "straggler_confirm_share", "straggler_confirm_z",
                                        "straggler_confirm_s"}
        assert shown["inputs"]["checkpoint_every"] == shown["inputs"]["straggler_window"] \
            == "int" and shown["inputs"]["lr"] == "float"
        assert "set requested" in shown["message"]
        wait_for(lambda: bool(job.knobs.history), 60, "the change applied")
        [change] = job.knobs.history
        assert dict(change.values) == {"lr": 0.01} and change.who == "job page"
        bad = free_cluster.client.run_on_scheduler(_owner_page_sets, job_id=job.id, lr=-1.0)
        assert "lr=-1: -1 is below its min 0" in bad["message"]
        with page(job.page().url.split("&ticket=")[0]) as doc:  # read-only: no inputs
            assert "nbtrain-knob-lr" not in {m.name for m in doc.roots[0].references()}
    finally:
        job.stop()
        job.wait(120)


def test_a_page_never_invents_an_end_state_for_a_forgotten_job(
        free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(), world_size=1, steps=5, name="forgotten")
    assert job.wait(120) is JobState.SUCCEEDED
    before, after, fresh = free_cluster.client.run_on_scheduler(_feed_across_forgetting,
                                                                job_id=job.id)
    assert before["state"] == after["state"] == "SUCCEEDED"
    assert fresh["state"] == "UNKNOWN" and "journal" in fresh["reason"]
