"""Goodput sizing in the gang scheduler, on hand-built cases: who shrinks for whom, fair
share, exploration, no thrash under noisy measurements; and the request's validation."""

from __future__ import annotations

import numpy as np
import pytest

from nbtrain.core.goodputmodel import GoodputModel
from nbtrain.core.sched_types import (
    Decision,
    Event,
    Finished,
    JobRequest,
    ResizeJob,
    SchedulerConfig,
    StartJob,
    StepTimes,
    Submit,
    Tick,
)
from nbtrain.core.scheduler import Scheduler
from nbtrain.core.speedup import StepTimeCurve
from nbtrain.core.topology import Topology

TOPO = Topology.declare(2, 8, hosts_per_leaf=2)  # 16 slots
GOOD = StepTimeCurve(a=0.01, b=1.0, c=0.02, d=0.001)  # near-linear to 16 ranks
POOR = StepTimeCurve(a=0.05, b=1.0, c=0.4, d=0.02)  # communication bound past 2 ranks
# a tight hysteresis band (5%, the noise level of the noisy case) and a low knee, so the
# hand-built cases move on small differences
CFG = SchedulerConfig(goodput_interval_s=300.0, goodput_check_s=30.0, goodput_min_gain=0.05,
                      goodput_knee=0.5)


def _gp(job_id: str, size: int, *, min_size: int = 2, max_size: int = 16,
        **kw: object) -> JobRequest:
    return JobRequest(job_id=job_id, size=size, min_size=min_size, max_size=max_size,
                      sizing="goodput", **kw)


def _measure(s: Scheduler, now: float, job_id: str, curve: StepTimeCurve,
             sizes: tuple[int, ...], steps: float = 50.0) -> None:
    for n in sizes:
        s.handle(StepTimes(now, job_id, n, curve.step_s(n), steps))


def _resizes(ds: list[Decision]) -> dict[str, ResizeJob]:
    return {d.job_id: d for d in ds if isinstance(d, ResizeJob)}


def _run(s: Scheduler, ev: Event) -> list[Decision]:
    out = s.handle(ev)
    s.check_invariants()
    return out


def test_a_poorly_scaling_job_gives_slots_to_a_well_scaling_one_when_nobody_waits() -> None:
    s = Scheduler(TOPO, CFG)
    started = _run(s, Submit(0.0, _gp("poor", 8))) + _run(s, Submit(0.0, _gp("good", 8)))
    assert {d.job_id: d.size for d in started if isinstance(d, StartJob)} == {
        "poor": 8, "good": 8}  # no curve yet: each starts at the size it asked for
    _measure(s, 10.0, "poor", POOR, (2, 4, 8))
    _measure(s, 10.0, "good", GOOD, (4, 8))
    assert _resizes(_run(s, Tick(200.0))) == {}  # within the resize interval: nothing moves
    ds = _run(s, Tick(400.0))
    moved = _resizes(ds)
    assert set(moved) == {"poor", "good"}
    assert moved["poor"].placement.world_size < 8 < moved["good"].placement.world_size
    assert [d.job_id for d in ds] == ["poor", "good"]  # the shrink frees the slots first
    assert "of its speedup" in moved["poor"].reason and "good" in moved["poor"].reason
    assert "adds" in moved["good"].reason
    # the move raised the summed speedup the models predict
    before = sum(m.speedup(8) for m in (s.goodput_model("poor"), s.goodput_model("good"))
                 if m is not None)
    pm, gm = s.goodput_model("poor"), s.goodput_model("good")
    assert pm is not None and gm is not None
    after = pm.speedup(s.job("poor").size) + gm.speedup(s.job("good").size)
    assert after > before


def test_while_jobs_wait_a_poorly_scaling_job_gives_back_the_ranks_past_its_knee() -> None:
    s = Scheduler(TOPO, CFG)
    _run(s, Submit(0.0, _gp("poor", 16)))
    _measure(s, 10.0, "poor", POOR, (2, 4, 8, 16))
    ds = _run(s, Submit(400.0, JobRequest(job_id="next", size=8)))
    moved = _resizes(ds)
    new = moved["poor"].placement.world_size
    assert new < 8  # more than the waiting job needed: the ranks past the knee add little
    assert "waiting jobs" in moved["poor"].reason and "%" in moved["poor"].reason
    assert any(isinstance(d, StartJob) and d.job_id == "next" for d in ds)


def test_a_blocked_head_shrinks_the_job_that_loses_least_speedup() -> None:
    # knee 0: no job gives ranks back by itself; only the head's shrink moves anyone
    s = Scheduler(TOPO, SchedulerConfig(goodput_knee=0.0))
    _run(s, Submit(0.0, _gp("good", 8)))  # submitted first: the old rule shrinks it first
    _run(s, Submit(0.0, _gp("poor", 8)))
    _measure(s, 1.0, "good", GOOD, (2, 4, 8))
    _measure(s, 1.0, "poor", POOR, (2, 4, 8))
    ds = _run(s, Submit(2.0, JobRequest(job_id="head", size=4)))
    moved = _resizes(ds)
    assert list(moved) == ["poor"]
    assert moved["poor"].reason.startswith("shrunk for 'head': 8->4 ranks costs")
    assert s.job("head").state == "running" and s.job("good").size == 8


def test_goodput_growth_does_not_keep_another_teams_job_waiting() -> None:
    s = Scheduler(TOPO, CFG)
    _run(s, Submit(0.0, _gp("g", 8, team="x")))
    _run(s, Submit(0.0, JobRequest(job_id="f1", size=8, team="y")))
    _measure(s, 1.0, "g", GOOD, (4, 8, 16))
    _run(s, Finished(400.0, "f1"))
    assert s.job("g").size == 16  # idle slots: the well scaling job takes them
    ds = _run(s, Submit(401.0, JobRequest(job_id="f2", size=8, team="y")))
    assert any(isinstance(d, StartJob) and d.job_id == "f2" for d in ds)
    assert s.job("g").size == 8 and s.job("f2").size == 8


def test_a_job_known_at_one_size_is_probed_at_half_while_jobs_wait() -> None:
    s = Scheduler(TOPO, CFG)
    _run(s, Submit(0.0, _gp("new", 16)))
    _measure(s, 5.0, "new", GOOD, (16,))
    ds = _run(s, Submit(400.0, JobRequest(job_id="other", size=4)))
    moved = _resizes(ds)
    assert moved["new"].placement.world_size == 8
    assert "exploring" in moved["new"].reason
    assert s.job("other").state == "running"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_measurements_do_not_make_sizes_thrash(seed: int) -> None:
    rng = np.random.default_rng(seed)
    s = Scheduler(TOPO, CFG)
    _run(s, Submit(0.0, _gp("poor", 8)))
    _run(s, Submit(0.0, _gp("good", 8)))
    for n in (2, 4, 8):  # as if measured at these sizes in earlier generations
        s.handle(StepTimes(1.0, "poor", n, POOR.step_s(n), 50.0))
        s.handle(StepTimes(1.0, "good", n, GOOD.step_s(n), 50.0))
    moves: list[tuple[float, str, int]] = []
    t = 1.0
    while t < 20_000.0:
        t += 10.0
        for jid, curve in (("poor", POOR), ("good", GOOD)):
            n = s.job(jid).size
            ds = _run(s, StepTimes(t, jid, n, curve.step_s(n) * rng.lognormal(0.0, 0.05), 10))
            moves += [(t, d.job_id, d.placement.world_size) for d in ds
                      if isinstance(d, ResizeJob)]
    assert moves, "the poorly scaling job should give ranks to the well scaling one"
    assert len(moves) <= 4  # settles after a move or two per job
    assert moves[-1][0] < 2000.0  # and stays settled under 5% noise


def test_goodput_requests_are_validated() -> None:
    with pytest.raises(ValueError, match="sizing='bogus' must be one of"):
        JobRequest(job_id="a", size=4, sizing="bogus")
    with pytest.raises(ValueError, match="needs a range of sizes"):
        JobRequest(job_id="a", size=4, sizing="goodput")
    with pytest.raises(ValueError, match="max_size=2 must be a multiple of 1 of at least"):
        JobRequest(job_id="a", size=4, min_size=2, max_size=2, sizing="goodput")
    with pytest.raises(ValueError, match="goodput_knee"):
        SchedulerConfig(goodput_knee=1.5)
    ok = JobRequest(job_id="a", size=4, max_size=8, sizing="goodput")
    assert ok.max_slots == 8 and ok.goodput_sized


def test_step_times_of_other_jobs_are_ignored() -> None:
    s = Scheduler(TOPO, CFG)
    _run(s, Submit(0.0, JobRequest(job_id="fixed", size=4, min_size=2)))
    assert _run(s, StepTimes(1.0, "fixed", 4, 0.1)) == []
    assert _run(s, StepTimes(1.0, "unknown", 4, 0.1)) == []
    assert s.goodput_model("fixed") is None


def _fair_day_with_goodput(seed: int,
                           weights: dict[str, float]) -> tuple[dict[str, float], int]:
    """Closed loop as in ``tests/test_sim.py``: every team always has 3 jobs queued, half of
    them goodput-sized (some scaling well, some poorly, each reporting its step times at
    every size it runs at); returns each team's share of the slot-time used over a day, and
    how many resizes goodput sizing made."""
    rng = np.random.default_rng(seed)
    s = Scheduler(Topology.declare(8, 8, hosts_per_leaf=4),
                  SchedulerConfig(team_weights=weights, goodput_interval_s=300.0))
    running: list[tuple[float, str]] = []
    ends: dict[str, float] = {}
    curves: dict[str, StepTimeCurve] = {}
    n = 0
    moved = 0

    def act(out: list[Decision], t: float) -> None:
        nonlocal moved
        moved += sum(1 for d in out if isinstance(d, ResizeJob) and "of its speedup" in d.reason)
        for d in out:
            if isinstance(d, StartJob):
                ends[d.job_id] = t + float(rng.uniform(600, 2400))
                running.append((ends[d.job_id], d.job_id))
                running.sort()
                submit(d.job_id.split("-")[0], t)
            if isinstance(d, StartJob | ResizeJob) and d.job_id in curves:
                n_ranks = d.placement.world_size
                act(s.handle(StepTimes(t, d.job_id, n_ranks,
                                       curves[d.job_id].step_s(n_ranks), 50.0)), t)

    def submit(team: str, t: float) -> None:
        nonlocal n
        n += 1
        job_id = f"{team}-{n}"
        if rng.random() < 0.5:
            curves[job_id] = GOOD if rng.random() < 0.5 else POOR
            req = _gp(job_id, 8, min_size=1, max_size=16, team=team)
        else:
            req = JobRequest(job_id=job_id, size=int(rng.choice([1, 2, 4, 8])), team=team)
        act(s.handle(Submit(t, req)), t)

    for team in weights:
        for _ in range(3):
            submit(team, 0.0)
    day = 86400.0
    while running and running[0][0] <= day:
        t, job_id = running.pop(0)
        act(s.handle(Finished(t, job_id)), t)
        s.check_invariants()
    s.handle(Tick(day))
    used = s.team_usage()
    total = sum(used.values())
    return {team: used[team] / total for team in weights}, moved


@pytest.mark.parametrize("seed", [0, 1])
def test_fair_share_holds_with_goodput_sized_jobs_in_every_team(seed: int) -> None:
    weights = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0}
    shares, moved = _fair_day_with_goodput(seed, weights)
    assert moved > 0  # goodput sizing acted during the day
    total_w = sum(weights.values())
    for team, w in weights.items():
        target = w / total_w
        assert abs(shares[team] - target) <= 0.05 * target, (team, shares[team], target)


def test_step_times_that_grow_with_the_size_never_break_the_pass() -> None:
    # Measured at 2 and 4 ranks only, slower at 4: communication alone (d * (n - 1)) fits
    # them exactly and predicts a step of no time at one rank, a division by zero wherever
    # the pass asks for the speedup at one rank (here: whom to shrink for a blocked job).
    s = Scheduler(TOPO, CFG)
    _run(s, Submit(0.0, _gp("comm", 4, min_size=1, max_size=8)))
    _run(s, StepTimes(10.0, "comm", 4, 0.3, 50.0))
    _run(s, StepTimes(10.0, "comm", 2, 0.1, 50.0))
    model = s.goodput_model("comm")
    assert model is not None and model.curve() is not None
    assert 0 < model.speedup(1) < float("inf")
    assert model.confidence(1) < CFG.goodput_min_confidence  # such a curve is not acted on
    ds = _run(s, Submit(400.0, JobRequest(job_id="big", size=14)))
    assert {d.job_id: d.placement.world_size for d in ds
            if isinstance(d, ResizeJob | StartJob)} == {"comm": 2, "big": 14}


def test_idle_slots_go_where_a_rank_second_saves_most_of_a_run() -> None:
    from nbtrain.core import goodput_sizing
    from nbtrain.core.goodputmodel import GoodputModel

    def model(curve: StepTimeCurve) -> GoodputModel:
        m = GoodputModel(ref_size=4)
        for n in (2, 4, 8, 16):
            m.observe(n, curve.step_s(n), 100.0)
        return m

    good, poor = model(GOOD), model(POOR)
    assert goodput_sizing.time_return(good, 4, 4) > goodput_sizing.time_return(poor, 4, 4) > 0
    flat = GoodputModel(ref_size=4)
    flat.observe(4, 1.0)
    flat.observe(8, 1.0)
    assert goodput_sizing.time_return(flat, 4, 4) == 0.0  # saves nothing
    assert goodput_sizing.time_return(GoodputModel(ref_size=4), 4, 4) == float("inf")
    cands = [goodput_sizing.Candidate(name, m, 4, 2, 16, 2)
             for name, m in (("good", good), ("poor", poor))]
    plan = {c.job_id: c.new for c in goodput_sizing.rebalance(
        cands, 8, min_gain=0.05, min_confidence=0.3)}
    assert plan["good"] > 4 and plan.get("poor", 4) < plan["good"]
    # A run's second worth under a rank: neither grows, though 8 slots are idle (good's
    # next replica saves about 1 s of its run per rank-second added).
    assert goodput_sizing.rebalance(cands, 8, min_gain=0.05, min_confidence=0.3,
                                    value_ranks=0.5) == []


def test_goodput_value_ranks_is_validated() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="goodput_value_ranks must be a positive"):
            SchedulerConfig(goodput_value_ranks=bad)


def _known(curve: StepTimeCurve, sizes: tuple[int, ...], ref: int = 4) -> GoodputModel:
    m = GoodputModel(ref_size=ref)
    for n in sizes:
        m.observe(n, curve.step_s(n), 100.0)
    return m


def test_idle_slots_go_first_to_the_job_with_the_least_time_left() -> None:
    from nbtrain.core import goodput_sizing

    # Two jobs with the same curve at the same size, room for one to grow: the one nearer its
    # end takes it (heSRPT); without times left the tie falls to the job id.
    def plan(left_a: float | None, left_b: float | None) -> dict[str, int]:
        cands = [goodput_sizing.Candidate(name, _known(GOOD, (2, 4, 8, 16)),
                                          4, 4, 16, 4, left_s=left)
                 for name, left in (("a", left_a), ("b", left_b))]
        return {c.job_id: c.new for c in goodput_sizing.rebalance(
            cands, 4, min_gain=0.05, min_confidence=0.3)}

    assert plan(3600.0, 600.0) == {"b": 8}
    assert plan(600.0, 3600.0) == {"a": 8}
    assert plan(None, None) == {"a": 8}
    assert plan(None, 3600.0) == {"b": 8}  # a known end goes before an unknown one


def test_a_job_is_shrunk_by_rebalance_only_as_far_as_its_curve_is_trusted() -> None:
    from nbtrain.core import goodput_sizing

    # Measured at 8 and 16 only: trusted at 8 (inside the measured range), less below, so
    # with min_confidence 0.3 it gives back down to 6, the smallest size trusted (the old
    # rule: nothing, its minimum of 2 not being trusted).
    poor = _known(POOR, (8, 16), ref=16)
    conf = {n: poor.confidence(n) for n in (2, 4, 6, 8)}
    assert conf[8] > conf[6] >= 0.3 > conf[4] > conf[2]
    cands = [goodput_sizing.Candidate("poor", poor, 16, 2, 16, 2, left_s=36_000.0),
             goodput_sizing.Candidate("good", _known(GOOD, (2, 4, 8)), 8, 2, 16, 2,
                                      left_s=600.0)]
    moved = {c.job_id: c.new for c in goodput_sizing.rebalance(
        cands, 0, min_gain=0.05, min_confidence=0.3)}
    assert moved == {"poor": 6, "good": 16}


def test_a_blocked_head_shrinks_the_job_furthest_from_its_end() -> None:
    # Same curve, same size: the job with the most time left gives the head its slots, the
    # one about to end keeps them (step times carry each job's steps left).
    s = Scheduler(TOPO, SchedulerConfig(goodput_knee=0.0))
    _run(s, Submit(0.0, _gp("near", 8)))  # submitted first: the old rule shrank it first
    _run(s, Submit(0.0, _gp("far", 8)))
    for job_id, left in (("near", 100.0), ("far", 10_000.0)):
        for n in (2, 4, 8):
            _run(s, StepTimes(1.0, job_id, n, GOOD.step_s(n), 50.0, steps_left=left))
    ds = _run(s, Submit(2.0, JobRequest(job_id="head", size=4)))
    assert list(_resizes(ds)) == ["far"]
    assert s.job("head").state == "running" and s.job("near").size == 8


def test_while_jobs_wait_only_as_many_ranks_are_given_back_as_they_need() -> None:
    # Two jobs past their knee; the waiting job needs 2 slots: only the job furthest from its
    # end gives ranks back (each give-back is a restart), the other keeps its 8.
    s = Scheduler(TOPO, CFG)
    _run(s, Submit(0.0, _gp("near", 8)))
    _run(s, Submit(0.0, _gp("far", 8)))
    for job_id, left in (("near", 5_000.0), ("far", 50_000.0)):
        for n in (2, 4, 8):
            _run(s, StepTimes(10.0, job_id, n, POOR.step_s(n), 50.0, steps_left=left))
    ds = _run(s, Submit(400.0, JobRequest(job_id="small", size=2)))
    moved = _resizes(ds)
    assert list(moved) == ["far"], moved
    assert "waiting jobs" in moved["far"].reason
    assert s.job("near").size == 8 and s.job("small").state == "running"


def test_probes_go_first_among_the_give_backs_while_jobs_wait() -> None:
    from nbtrain.core import goodput_sizing

    known = goodput_sizing.Candidate("known", _known(POOR, (2, 4, 8)), 8, 2, 16, 2,
                                     left_s=50_000.0)
    fresh = goodput_sizing.Candidate("fresh", _known(GOOD, (8,), ref=8), 8, 2, 16, 2,
                                     left_s=100.0)
    changes = []
    for c in (known, fresh):
        change = goodput_sizing.for_queue(c, threshold=0.5, min_confidence=0.3)
        assert change is not None
        changes.append((c, change))
    (first, probe), (second, knee_change) = goodput_sizing.queue_order(changes)
    assert (first.job_id, probe.probe, probe.new) == ("fresh", True, 4)
    assert (second.job_id, knee_change.probe) == ("known", False) and knee_change.new < 8
