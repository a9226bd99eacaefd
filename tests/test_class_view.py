"""What a teacher reads on the class view, without a cluster: each team's share of slot-time
over a recent window against its weight (from a scheduler run with known weights), waiting
times, jobs per student, and the cluster's log as sentences, newest first, by team.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from nbtrain.core import clusterevents as ce
from nbtrain.core.fairshare import FairShare
from nbtrain.core.lifecycle_types import Publish
from nbtrain.core.sched_types import Finished, JobRequest, SchedulerConfig, StartJob, Submit
from nbtrain.core.scheduler import Scheduler
from nbtrain.core.teamshare import jobs_per_student, team_shares, waiting_jobs
from nbtrain.core.topology import Topology
from tests.test_lifecycle import Harness, run_to_running


def test_window_usage_is_the_exact_integral_over_the_recent_window() -> None:
    fair = FairShare(lambda _t: 1.0, half_life_s=1e9, window_s=100.0)
    fair.advance(0.0)
    fair.hold("a", 3)
    fair.advance(50.0)
    fair.hold("b", 1)
    fair.advance(120.0)
    fair.hold("a", -3)
    fair.advance(200.0)
    # over [100, 200]: a held 3 slots for 20 s; b held 1 slot all 100 s
    assert fair.window_usage(200.0) == {"a": 60.0, "b": 100.0}
    # over [150, 250]: a nothing, b 1 slot for 100 s
    assert fair.window_usage(250.0) == {"a": 0.0, "b": 100.0}
    # several changes at one time: the last one holds from then on
    fair.hold("b", 2)
    fair.hold("b", -1)
    fair.advance(300.0)
    assert fair.window_usage(300.0)["b"] == 200.0


def _weighted_run(weights: dict[str, float], *, until: float = 2000.0,
                  window_s: float = 600.0) -> tuple[Scheduler, list[dict[str, Any]], float]:
    """A 4-slot cluster where every team always has 1-slot jobs of 10 s waiting: fair share
    gives them slot-time in their weights. Returns the scheduler, the jobs' statuses (as a
    snapshot lists them) and the time."""
    sched = Scheduler(Topology.declare(1, 4), SchedulerConfig(team_weights=weights,
                                                               share_window_s=window_s))
    ends: dict[str, float] = {}
    state: dict[str, str] = {}
    teams: dict[str, str] = {}
    n = 0
    now = 0.0

    def top_up() -> None:
        nonlocal n
        for team in weights:
            while sum(1 for j, s in state.items() if s == "QUEUED" and teams[j] == team) < 3:
                job_id = f"{team}{n}"
                n += 1
                state[job_id], teams[job_id] = "QUEUED", team
                take(sched.handle(Submit(now, JobRequest(job_id=job_id, size=1, team=team,
                                                         est_duration_s=10.0))))

    def take(decisions: list[Any]) -> None:
        for d in decisions:
            if isinstance(d, StartJob):
                state[d.job_id] = "RUNNING"
                ends[d.job_id] = now + 10.0

    top_up()
    while now < until:
        job_id = min(ends, key=lambda j: (ends[j], j))
        now = ends.pop(job_id)
        state[job_id] = "SUCCEEDED"
        take(sched.handle(Finished(now, job_id)))
        top_up()
    jobs = [{"job_id": j, "name": j, "owner": f"student-{teams[j]}", "team": teams[j],
             "state": s, "priority": 0, "world_size": 1} for j, s in state.items()]
    return sched, jobs, now


def test_team_shares_of_a_run_with_known_weights_match_the_weights() -> None:
    sched, jobs, now = _weighted_run({"big": 3.0, "small": 1.0})
    shares = {t["team"]: t for t in team_shares(sched.team_window(now), jobs)}
    assert set(shares) == {"big", "small"}
    big, small = shares["big"], shares["small"]
    assert (big["weight"], big["fair_share"], small["fair_share"]) == (3.0, 0.75, 0.25)
    # the window holds 600 s x 4 slots of slot-time, all of it used
    assert big["slot_s"] + small["slot_s"] == pytest.approx(2400.0)
    assert big["share"] == pytest.approx(0.75, abs=0.05)
    assert big["ratio"] == pytest.approx(1.0, abs=0.07)
    assert small["ratio"] == pytest.approx(1.0, abs=0.2)
    assert big["waiting"] == small["waiting"] == 3 and big["running"] + small["running"] == 4


def test_a_team_that_waits_is_owed_its_share_and_an_idle_team_nothing() -> None:
    window = {"a": (300.0, 1.0), "b": (0.0, 1.0), "idle": (0.0, 2.0)}
    jobs = [{"job_id": "1", "team": "a", "state": "RUNNING"},
            {"job_id": "2", "team": "b", "state": "QUEUED"},
            {"job_id": "3", "team": "new", "state": "QUEUED"}]
    shares = {t["team"]: t for t in team_shares(window, jobs)}
    assert shares["a"]["share"] == 1.0 and shares["a"]["ratio"] == pytest.approx(3.0)
    assert shares["b"]["fair_share"] == pytest.approx(1 / 3) and shares["b"]["ratio"] == 0.0
    assert shares["new"]["weight"] == 1.0 and shares["new"]["waiting"] == 1
    assert shares["idle"]["fair_share"] == 0.0 and shares["idle"]["ratio"] is None
    # nobody used anything yet: no shares, no division by zero
    assert all(t["share"] == 0.0 for t in team_shares({}, jobs))


def test_waiting_jobs_longest_first_and_jobs_per_student() -> None:
    jobs = [{"job_id": "j1", "name": "alice-mlp", "owner": "alice", "team": "red",
             "state": "QUEUED", "waiting_s": 12.0, "reason": "waiting for 2 slots",
             "world_size": 2},
            {"job_id": "j2", "name": "bob-big", "owner": "bob", "team": "blue",
             "state": "RUNNING", "waiting_s": 0.0},
            {"job_id": "j3", "name": "alice-cnn", "owner": "alice", "team": "red",
             "state": "QUEUED", "waiting_s": 40.5},
            {"job_id": "j4", "name": "alice-old", "owner": "alice", "team": "blue",
             "state": "FAILED"},
            {"job_id": "j5", "name": "bob-held", "owner": "bob", "team": "blue",
             "state": "PREEMPTED"}]  # held by its owner: not waiting for slots
    waiting = waiting_jobs(jobs, queue=["j1", "j3"])
    assert [(w["name"], w["waiting_s"], w["position"]) for w in waiting] == [
        ("alice-cnn", 40.5, 2), ("alice-mlp", 12.0, 1)]
    assert waiting[1]["reason"] == "waiting for 2 slots" and waiting[1]["ranks"] == 2
    students = jobs_per_student(jobs)
    assert students[0] == {"owner": "alice", "teams": ["blue", "red"], "jobs": 3,
                           "running": 0, "waiting": 2, "ended": 1, "failed": 1}
    assert students[1]["owner"] == "bob" and students[1]["running"] == 1


# ------------------------------------------------------------------ the log as sentences
def _entries() -> list[dict[str, Any]]:
    return [
        ce.worker_joined_event(slot="127.0.0.1#3", address="tcp://127.0.0.1:4001",
                               host="127.0.0.1"),
        ce.worker_left_event(slot="h#0", address="tcp://a", host="h", restarting=True),
        ce.worker_left_event(slot="h#1", address="tcp://b", host="h", restarting=False),
        ce.worker_refused_event(address="tcp://c", host="h", reason="two workers on one GPU"),
        ce.worker_slot_event("forgotten", slot="h#2", host="h", reason="gone for 1 h"),
        ce.slot_lost_event(slot="h#0", host="h", reason="its worker did not come back"),
        ce.job_line_event("preemption", "j1", "alice-mlp preempted: preempted for 'j2' "
                          "(priority 5)", name="alice-mlp", by="j2", by_name="bob-big",
                          priority=0, by_priority=5),
        ce.job_line_event("preemption", "j1", "alice-mlp preempted by its owner at step 40"),
        ce.job_line_event("scheduler", "j1", "held: it asked for 8 slots"),
        ce.job_line_event("resize", "j2", "bob-big resized 2 -> 1 ranks: a worker left"),
        ce.restored_event(jobs=2, live=1, epoch=3, state_dir="/s", seconds=0.1),
        ce.shutdown_event("j2"),
        ce.restart_event(addresses=("tcp://a", "tcp://b"), reason="a rank failed",
                         results={"tcp://a": "OK"}),
        ce.abort_event(job="j2", generation=4, addresses=["tcp://a"], reason="rank 1 failed",
                       results=None),
        ce.refused_event(job="j2", count=3, reason="no valid seal"),
        ce.controller_error_event(job=None, event="Tick", error="KeyError: 'x'"),
    ]


SENTENCES = [
    "worker 127.0.0.1#3 joined",
    "worker h#0 left (nbtrain restarts it)",
    "worker h#1 left",
    "worker tcp://c refused: two workers on one GPU",
    "slot h#2 forgotten: gone for 1 h",
    "slot h#0 lost: its worker did not come back",
    "bob-big preempted alice-mlp: priority 5 > 0",
    "alice-mlp preempted by its owner at step 40",
    "alice-mlp: held: it asked for 8 slots",
    "bob-big resized 2 -> 1 ranks: a worker left",
    "controller restarted: 2 jobs read back (1 live) from /s in 0.10 s",
    "controller closed while bob-big was live",
    "restarted 2 workers (tcp://a, tcp://b): a rank failed",
    "aborted the collectives of bob-big generation 4 on 1 worker: rank 1 failed",
    "refused 3 rank events of bob-big: no valid seal",
    "the controller failed on Tick: KeyError: 'x'",
]

JOBS = [{"job_id": "j1", "name": "alice-mlp", "team": "red"},
        {"job_id": "j2", "name": "bob-big", "team": "blue"}]


def test_every_kind_of_cluster_event_reads_as_a_sentence() -> None:
    entries = _entries()
    assert {e["kind"] for e in entries} == set(ce.CLUSTER_KINDS)
    names = {"j1": "alice-mlp", "j2": "bob-big"}
    assert [ce.sentence(ce.parse_cluster_event(e), names) for e in entries] == SENTENCES
    # no raw key=value text for any known kind
    assert not any("=" in s for s in SENTENCES)
    # an unknown kind still reads as its fields
    assert ce.sentence(ce.parse_cluster_event({"kind": "new", "x": 1})) == "x=1"


def test_cluster_log_lines_are_newest_first_and_filter_by_team() -> None:
    entries = [{**e, "time": 1.7e9 + i} for i, e in enumerate(_entries())]
    lines = ce.cluster_log_lines(entries, JOBS)
    assert [line["text"] for line in lines] == SENTENCES[::-1]
    assert lines[0]["time"] == 1.7e9 + len(entries) - 1
    red = ce.cluster_log_lines(entries, JOBS, team="red")
    # the preemption is about both teams' jobs; worker entries about none
    assert [line["text"] for line in red] == [SENTENCES[8], SENTENCES[7], SENTENCES[6]]
    assert red[-1]["teams"] == ["blue", "red"]
    blue = ce.cluster_log_lines(entries, JOBS, team="blue", limit=2)
    assert [line["text"] for line in blue] == [SENTENCES[14], SENTENCES[13]]


def test_the_machine_says_who_preempted_whom_and_why() -> None:
    h = Harness(workers=2, grace_s=30)
    run_to_running(h, "low")
    h.submit("high", 2, priority=5)
    [entry] = [dict(c.event) for c in h.of(Publish)
               if c.job_id is None and c.event.get("kind") == "preemption"]
    said = ce.sentence(ce.parse_cluster_event(entry))
    assert said == "job-high preempted job-low: priority 5 > 0"
    # the queued job's status says how long it has waited
    h.advance(7.5)
    assert h.m.status("high").state == "QUEUED"
    assert h.m.status("high").waiting_s == pytest.approx(7.5)
    assert h.m.status("low").waiting_s == 0.0
    assert not math.isnan(h.m.status("high").waiting_s)


# ------------------------------------------------------------------ the page's document
def _snapshot_of(sched: Scheduler, jobs: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """What ``cluster_snapshot`` sends for this run (the same functions), with the slots."""
    owners = sched.owners()
    slots = [{"slot": f"h#{i}", "host": "h", "nvlink": "h", "address": f"tcp://h:{i}",
              "state": "held" if owner else "free", "job": owner}
             for i, owner in enumerate(owners)]
    for job in jobs:
        job.update(step=0, reason="waiting for 1 slot" if job["state"] == "QUEUED" else "",
                   restarts=0, size=1 if job["state"] == "RUNNING" else 0, goodput={},
                   waiting_s=5.0 if job["state"] == "QUEUED" else 0.0)
    log = [ce.job_line_event("preemption", "big0", "x", name="big0", by="small1",
                             by_name="small1", priority=0, by_priority=5),
           ce.worker_joined_event(slot="h#3", address="tcp://h:3", host="h")]
    return {"slots": slots, "jobs": jobs, "queue": sched.queued(), "share_window_s": 600.0,
            "teams": team_shares(sched.team_window(now), jobs),
            "waiting": waiting_jobs(jobs, sched.queued()), "students": jobs_per_student(jobs),
            "log": log, "log_lines": ce.cluster_log_lines(log, jobs)}


def test_the_class_page_shows_team_shares_of_a_run_with_known_weights() -> None:
    from bokeh.document import Document

    from nbtrain.ui.clusterpage import ALL_TEAMS, ClusterPage

    snap = _snapshot_of(*_weighted_run({"big": 3.0, "small": 1.0}))
    page = ClusterPage(lambda: snap, lambda job_id: f"job?job={job_id}")
    doc = Document()
    doc.add_root(page.layout)
    teams = doc.get_model_by_name("cluster-teams").data
    assert list(teams["team"]) == ["big", "small"]
    assert list(teams["fair_share"]) == ["75%", "25%"]
    assert list(teams["share"]) == ["75%", "25%"] and list(teams["ratio"]) == ["1.00", "1.00"]
    assert list(teams["verdict"]) == ["about its share"] * 2
    assert "over the last 10 min 00 s" in page.teams_title.text
    students = doc.get_model_by_name("cluster-students").data
    assert set(students["owner"]) == {"student-big", "student-small"}
    assert "waiting 5 s" in page.queue.text and "#1 in the queue" in page.queue.text
    jobs = doc.get_model_by_name("cluster-jobs").data
    assert "5 s" in list(jobs["waiting"])
    # the log: sentences, newest first; the team filter keeps that team's entries only
    assert page.log.text.index("worker h#3 joined") < page.log.text.index(
        "small1 preempted big0: priority 5 &gt; 0")
    assert list(page.log_team.options) == [ALL_TEAMS, "big", "small"]
    page.log_team.value = "big"  # as the browser sets it: the page redraws its log
    assert "small1 preempted big0" in page.log.text and "joined" not in page.log.text
    assert "team big" in page.log.text


def test_the_text_class_view_lists_team_shares() -> None:
    from nbtrain.ui.cluster_view import ClusterText

    snap = _snapshot_of(*_weighted_run({"big": 3.0, "small": 1.0}))

    class Snapshots:
        def snapshot(self) -> dict[str, Any]:
            return snap

    text = repr(ClusterText(Snapshots()))
    assert "fair share over the last 10 min 00 s:" in text
    assert "team big (weight 3): fair share 75%, got 75% (got / fair 1.00)" in text
