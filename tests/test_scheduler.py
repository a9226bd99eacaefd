"""Gang scheduler state machine: admission, preemption, backfill, elasticity, invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbtrain.core.placement import Layout
from nbtrain.core.sched_types import (
    Checkpointed,
    Decision,
    Failed,
    Finished,
    JobRequest,
    PreemptJob,
    RejectJob,
    Released,
    ResizeJob,
    ResizeRequested,
    SchedulerConfig,
    StartJob,
    Submit,
    Tick,
    WorkersAdded,
    WorkersRemoved,
)
from nbtrain.core.scheduler import Scheduler
from nbtrain.core.topology import Topology


def _job(job_id: str, size: int, **kw: object) -> JobRequest:
    return JobRequest(job_id=job_id, size=size, **kw)  # type: ignore[arg-type]


def _kinds(decisions: list[Decision]) -> list[tuple[str, str]]:
    return [(type(d).__name__, d.job_id) for d in decisions]


def test_two_100_rank_gangs_on_100_slots_never_both_partial() -> None:
    s = Scheduler(Topology.declare(25, 4))
    d1 = s.handle(Submit(0.0, _job("a", 100)))
    d2 = s.handle(Submit(0.0, _job("b", 100)))
    assert _kinds(d1) == [("StartJob", "a")] and d2 == []
    assert s.job("a").size == 100 and s.job("b").size == 0 and s.job("b").state == "queued"
    s.check_invariants()
    d3 = s.handle(Finished(10.0, "a"))
    assert _kinds(d3) == [("StartJob", "b")]
    assert isinstance(d3[0], StartJob) and d3[0].size == 100
    s.check_invariants()


def test_preemption_frees_a_domain_the_preemptor_can_use() -> None:
    """Cheapest victims would be the two fresh 1-GPU jobs, one on each host: freeing them
    gives one slot per host and a tp=2 job still cannot start. The scheduler must free a host."""
    topo = Topology.declare(2, 4)
    s = Scheduler(topo, SchedulerConfig(restart_cost_s=0.0))
    # host 0: old3 (3 slots, started at t=0); host 1: old3b (3 slots, t=0)
    s.handle(Submit(0.0, _job("old3", 3)))
    s.handle(Submit(0.0, _job("old3b", 3)))
    # the remaining slot of each host: young 1-GPU jobs started much later
    s.handle(Submit(900.0, _job("young1", 1)))
    s.handle(Submit(900.0, _job("young2", 1)))
    hosts = {j: {str(x).split(":")[0] for x in s.job(j).slots} for j in s.job_ids()}
    assert hosts["old3"] != hosts["old3b"] and hosts["young1"] != hosts["young2"]
    assert s.n_free == 0
    s.handle(Checkpointed(950.0, "old3"))  # old3 just checkpointed: it loses the least work
    out = s.handle(Submit(1000.0, _job("urgent", 2, layout=Layout(tp=2), priority=5)))
    victims = [d.job_id for d in out if isinstance(d, PreemptJob)]
    assert victims == ["old3"], out
    assert all(d.for_job == "urgent" for d in out if isinstance(d, PreemptJob))
    out = s.handle(Released(1010.0, "old3"))
    start = [d for d in out if isinstance(d, StartJob)]
    assert [d.job_id for d in start] == ["urgent"]
    assert {str(x).split(":")[0] for x in start[0].placement.slots} == hosts["old3"]
    s.check_invariants()


def test_no_preemption_among_equal_priorities_and_no_cycles() -> None:
    s = Scheduler(Topology.declare(1, 4))
    s.handle(Submit(0.0, _job("a", 4, priority=1)))
    out = s.handle(Submit(1.0, _job("b", 4, priority=1)))
    assert out == []  # equal priority waits
    out = s.handle(Submit(2.0, _job("c", 4, priority=2)))
    assert _kinds(out) == [("PreemptJob", "a")]
    out = s.handle(Released(3.0, "a"))
    assert _kinds(out) == [("StartJob", "c")]
    # a (priority 1) is back in the queue and must not preempt c (priority 2)
    assert s.handle(Tick(4.0)) == []
    assert [(r.by, r.victim) for r in s.preemption_log] == [("c", "a")]
    s.check_invariants()


def test_preemption_skips_non_preemptible_jobs() -> None:
    s = Scheduler(Topology.declare(1, 4))
    s.handle(Submit(0.0, _job("keep", 4, preemptible=False)))
    assert s.handle(Submit(1.0, _job("hi", 4, priority=9))) == []


def test_backfill_respects_the_head_reservation() -> None:
    s = Scheduler(Topology.declare(2, 4))
    s.handle(Submit(0.0, _job("run", 4, est_duration_s=100.0)))
    s.handle(Submit(0.0, _job("half", 2, est_duration_s=1000.0)))
    # 2 slots left; the head needs all 8 and is reserved from t=...
    assert s.handle(Submit(1.0, _job("big", 8, est_duration_s=50.0))) == []
    # a short job ending before "half" and "run" end (shadow at t=1000) may backfill
    out = s.handle(Submit(2.0, _job("short", 2, est_duration_s=30.0)))
    assert _kinds(out) == [("StartJob", "short")]
    s.handle(Finished(40.0, "short"))
    # a long small job would hold slots the big job needs at the shadow time: it waits
    assert s.handle(Submit(41.0, _job("long", 2, est_duration_s=5000.0))) == []
    assert s.queued() == ["big", "long"]
    s.handle(Finished(100.0, "run"))
    out = s.handle(Finished(1000.0, "half"))
    assert _kinds(out) == [("StartJob", "big")]


def test_unknown_estimates_still_protect_the_head() -> None:
    s = Scheduler(Topology.declare(2, 4))
    s.handle(Submit(0.0, _job("a", 6)))
    assert s.handle(Submit(1.0, _job("big", 8))) == []
    # without estimates nobody can prove they end in time: no backfill onto the 2 free slots
    assert s.handle(Submit(2.0, _job("small", 2))) == []


def test_fifo_without_backfill_blocks_behind_the_head() -> None:
    cfg = SchedulerConfig(order="fifo", backfill=False, preemption=False, fair_share=False)
    s = Scheduler(Topology.declare(2, 4), cfg)
    s.handle(Submit(0.0, _job("a", 6)))
    s.handle(Submit(1.0, _job("big", 8)))
    assert s.handle(Submit(2.0, _job("small", 1, est_duration_s=1.0))) == []
    # the nbtrain policy would have started it
    s2 = Scheduler(Topology.declare(2, 4))
    s2.handle(Submit(0.0, _job("a", 6, est_duration_s=100.0)))
    s2.handle(Submit(1.0, _job("big", 8)))
    assert _kinds(s2.handle(Submit(2.0, _job("small", 1, est_duration_s=1.0)))) == [
        ("StartJob", "small")]


def test_priority_orders_the_queue() -> None:
    s = Scheduler(Topology.declare(1, 4))
    s.handle(Submit(0.0, _job("run", 4, preemptible=False)))
    s.handle(Submit(1.0, _job("low", 4, priority=0)))
    s.handle(Submit(2.0, _job("high", 4, priority=3)))
    assert s.queued() == ["high", "low"]


def test_elastic_starts_small_grows_and_shrinks_for_a_waiting_job() -> None:
    s = Scheduler(Topology.declare(2, 4))
    s.handle(Submit(0.0, _job("rigid", 4)))
    out = s.handle(Submit(1.0, _job("el", 8, min_size=2)))
    assert _kinds(out) == [("StartJob", "el")] and s.job("el").size == 4
    out = s.handle(Finished(2.0, "rigid"))
    assert _kinds(out) == [("ResizeJob", "el")] and s.job("el").size == 8
    out = s.handle(Submit(3.0, _job("new", 4)))
    # shrunk no further than the new job needs (not to its minimum of 2), and not regrown
    assert _kinds(out) == [("ResizeJob", "el"), ("StartJob", "new")]
    assert s.job("el").size == 4 and s.job("new").size == 4 and s.n_free == 0
    s.check_invariants()


def test_rejects_impossible_requests_with_reasons() -> None:
    s = Scheduler(Topology.declare(2, 4))
    out = s.handle(Submit(0.0, _job("wide", 8, layout=Layout(tp=8))))
    assert isinstance(out[0], RejectJob) and "lower tp to at most 4" in out[0].reason
    out = s.handle(Submit(0.0, _job("huge", 16)))
    assert isinstance(out[0], RejectJob) and "ask for at most 8" in out[0].reason
    s.handle(Submit(0.0, _job("a", 1)))
    out = s.handle(Submit(0.0, _job("a", 1)))
    assert isinstance(out[0], RejectJob) and "already in use" in out[0].reason
    with pytest.raises(ValueError, match="feed events in time order"):
        s.handle(Tick(-1.0))


def test_job_request_validation() -> None:
    with pytest.raises(ValueError, match="multiple of tp\\*cp\\*pp=4"):
        _job("x", 6, layout=Layout(tp=4))
    with pytest.raises(ValueError, match="min_size=3"):
        _job("x", 8, layout=Layout(tp=2), min_size=3)


def test_lost_worker_stops_rigid_jobs_and_shrinks_elastic_ones() -> None:
    topo = Topology.declare(2, 4)
    s = Scheduler(topo, SchedulerConfig(elastic_grow=False))
    s.handle(Submit(0.0, _job("rigid", 4)))
    s.handle(Submit(0.0, _job("el", 4, min_size=2)))
    lost_r = s.job("rigid").slots[0]
    lost_e = s.job("el").slots[0]
    out = s.handle(WorkersRemoved(5.0, (lost_r, lost_e)))
    kinds = dict(_kinds(out)[i][::-1] for i in range(len(out)))
    assert kinds == {"rigid": "PreemptJob", "el": "ResizeJob"}
    assert s.job("el").size == 3 and lost_e not in s.job("el").slots
    pre = next(d for d in out if isinstance(d, PreemptJob))
    assert pre.grace_s == 0.0 and pre.for_job is None
    out = s.handle(Released(6.0, "rigid"))
    # 3 healthy slots are free; the elastic job gives up one more so rigid can restart
    assert _kinds(out) == [("ResizeJob", "el"), ("StartJob", "rigid")]
    assert s.job("el").size == 2 and s.n_free == 0
    assert not {lost_r, lost_e} & set(s.job("rigid").slots + s.job("el").slots)
    s.handle(WorkersAdded(7.0, {"h0000": (lost_r,), "h0001": (lost_e,)}))
    assert s.n_free == 2
    s.check_invariants()


def test_new_hosts_extend_an_engine_topology() -> None:
    s = Scheduler(Topology.from_hosts({"10.0.0.1": ["w1", "w2"]}))
    s.handle(Submit(0.0, _job("a", 2)))
    assert s.handle(Submit(1.0, _job("b", 2))) == []
    out = s.handle(WorkersAdded(2.0, {"10.0.0.2": ("w3", "w4")}))
    assert _kinds(out) == [("StartJob", "b")]
    assert set(s.job("b").slots) == {"w3", "w4"} and set(s.job("a").slots) == {"w1", "w2"}
    s.check_invariants()


def test_resize_requests() -> None:
    s = Scheduler(Topology.declare(2, 4))
    s.handle(Submit(0.0, _job("a", 2)))
    out = s.handle(ResizeRequested(1.0, "a", 6))
    assert _kinds(out) == [("ResizeJob", "a")] and s.job("a").size == 6
    assert isinstance(out[0], ResizeJob) and out[0].old_size == 2
    out = s.handle(ResizeRequested(2.0, "a", 12))
    assert isinstance(out[0], RejectJob) and s.job("a").size == 6
    out = s.handle(ResizeRequested(3.0, "a", 1))
    assert _kinds(out) == [("ResizeJob", "a")] and s.job("a").size == 1
    s.check_invariants()


def test_a_queued_job_resized_beyond_the_cluster_is_refused() -> None:
    """Found by tests/test_scheduler_property.py (seeds 201, 949): a queued job resized to
    more than the cluster can ever hold was kept, and waited for ever. Refused as at submit,
    it keeps its size; a cluster that may still grow keeps the new size."""
    s = Scheduler(Topology.declare(1, 2))
    s.handle(Submit(0.0, _job("run", 2)))
    s.handle(Submit(0.0, _job("q", 2)))
    out = s.handle(ResizeRequested(1.0, "q", 3))
    assert isinstance(out[0], RejectJob) and "ask for at most 2" in out[0].reason, out
    assert s.job("q").request.size == 2 and s.queued() == ["q"]
    assert _kinds(s.handle(Finished(2.0, "run"))) == [("StartJob", "q")]
    g = Scheduler(Topology.declare(1, 2), SchedulerConfig(can_grow=True))
    g.handle(Submit(0.0, _job("run", 2)))
    g.handle(Submit(0.0, _job("q", 2)))
    assert g.handle(ResizeRequested(1.0, "q", 3)) == [] and g.job("q").request.size == 3


def test_failed_job_requeues_on_request() -> None:
    s = Scheduler(Topology.declare(1, 4))
    s.handle(Submit(0.0, _job("a", 4)))
    out = s.handle(Failed(1.0, "a", requeue=True))
    assert _kinds(out) == [("StartJob", "a")]
    s.handle(Failed(2.0, "a"))
    assert s.job("a").state == "done" and s.n_free == 4


# ------------------------------------------------------------------ property-based invariants
_EVENT = st.tuples(
    st.sampled_from(["submit", "submit", "submit", "finish", "release", "fail", "resize",
                     "remove", "add", "ckpt"]),
    st.integers(0, 10_000),
    st.integers(0, 4),  # size exponent
    st.sampled_from([1, 2, 4]),  # tp
    st.integers(0, 3),  # priority
    st.booleans(),  # elastic
)


@settings(max_examples=120, deadline=None)
@given(events=st.lists(_EVENT, min_size=1, max_size=60),
       placement=st.sampled_from(["topology", "first_fit"]),
       backfill=st.booleans())
def test_invariants_hold_under_random_events(
    events: list[tuple[str, int, int, int, int, bool]], placement: str, backfill: bool
) -> None:
    """Whatever happens: jobs hold 0 or a whole gang >= min, starts use free slots only,
    preemption goes strictly down in priority, and counts stay exact."""
    topo = Topology.declare(4, 4, hosts_per_leaf=2)
    s = Scheduler(topo, SchedulerConfig(placement=placement, backfill=backfill,
                                        team_weights={"a": 1.0, "b": 3.0}))
    t = 0.0
    n = 0
    removed: list[str] = []
    for kind, pick, sz, tp, prio, elastic in events:
        t += 1.0
        owners_before = s.owners()
        ended: set[str] = set()  # jobs whose slots the event itself frees
        live = s.job_ids("running") + s.job_ids("stopping")
        if kind == "submit":
            size = max(tp, 2**sz // tp * tp)
            req = JobRequest(job_id=f"j{n}", size=size, layout=Layout(tp=tp), priority=prio,
                             team="ab"[n % 2], min_size=tp if elastic and size > tp else None,
                             est_duration_s=float(1 + pick % 50))
            n += 1
            out = s.handle(Submit(t, req))
        elif kind in ("finish", "release", "fail", "resize", "ckpt") and live:
            job = live[pick % len(live)]
            if kind in ("finish", "release", "fail"):
                ended.add(job)
            if kind == "finish":
                out = s.handle(Finished(t, job))
            elif kind == "release":
                out = s.handle(Released(t, job))
            elif kind == "fail":
                out = s.handle(Failed(t, job, requeue=bool(pick % 2)))
            elif kind == "ckpt":
                out = s.handle(Checkpointed(t, job))
            else:
                r = s.job(job).request.layout.replica
                out = s.handle(ResizeRequested(t, job, r * (1 + pick % 3)))
        elif kind == "remove":
            slot = topo.slot_ids[pick % topo.n_slots]
            removed.append(str(slot))
            out = s.handle(WorkersRemoved(t, (slot,)))
        elif kind == "add" and removed:
            slot = removed.pop()
            out = s.handle(WorkersAdded(t, {slot.split(":")[0]: (slot,)}))
        else:
            out = s.handle(Tick(t))
        freed = ended | {d.job_id for d in out if isinstance(d, ResizeJob)}
        for d in out:
            if isinstance(d, StartJob | ResizeJob):
                idx = np.asarray(d.placement.indices)
                assert len(set(idx.tolist())) == idx.shape[0]
                # a start may only use slots that were free, or that a resize in the same
                # batch gave back
                for i in idx.tolist():
                    before = owners_before[i]
                    assert before is None or before == d.job_id or before in freed, (
                        f"{d.job_id} got slot {i} held by {before}")
        s.check_invariants()


def _fair_replay(max_wait_s: float | None) -> Scheduler:
    cfg = SchedulerConfig(team_weights={"big": 4.0, "small": 1.0}, max_wait_s=max_wait_s)
    s = Scheduler(Topology.declare(1, 4), cfg)
    s.handle(Submit(0.0, _job("run", 4, team="big", preemptible=False)))
    s.handle(Submit(10.0, _job("s1", 4, team="small")))
    s.handle(Submit(20.0, _job("b1", 4, team="big")))
    # big holds 4 slots with weight 4, small holds none: small is further below its share
    assert s.queued() == ["s1", "b1"]
    s.handle(Finished(1000.0, "run"))  # s1 starts; big used 4 slots x 1000 s, weight 4
    s.handle(Submit(1100.0, _job("s2", 4, team="small")))
    # small used 4 x 100 s at weight 1: 400 < 4000 / 4, still below big
    assert s.queued() == ["s2", "b1"]
    s.handle(Submit(2200.0, _job("b2", 4, team="big")))
    # small used 4 x 1200 s = 4800 > 1000: big goes first now
    assert s.queued() == ["b1", "b2", "s2"]
    s.handle(Finished(9000.0, "s1"))  # b1 starts
    s.handle(Submit(9100.0, _job("b3", 4, team="big")))
    return s


def test_fair_share_orders_teams_and_aging_overrides_it() -> None:
    assert _fair_replay(None).queued() == ["b2", "b3", "s2"]
    # s2 and b2 have waited longer than max_wait_s: they go first, in submit order, although
    # small is far above its share
    assert _fair_replay(3600.0).queued() == ["s2", "b2", "b3"]
