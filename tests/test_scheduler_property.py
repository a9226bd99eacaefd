"""The gang scheduler never raises on valid input and keeps its guarantees after every event.

Thousands of seeded random workloads drive ``core.Scheduler`` the way the engine does: jobs of
every size (one slot to the whole cluster, some larger than it), several priorities and teams
with fair-share weights, elastic bounds, estimates or none, failures, cancellations while
queued and while running, suspensions, resize requests, workers that leave, come back, join
and are forgotten, on clusters from 1 x 1 to 8 x 4 GPUs with NVLink pairs and multi-host
NVLink domains, under every policy switch. A small model of the engine carries the decisions
out in order and, after every event, is compared with the scheduler's own books:

- ``handle`` never raises and ``check_invariants`` holds;
- a slot is held by at most one job, in the order the decisions are carried out (a start may
  use slots a resize earlier in the same batch gave back, never those of a job still
  stopping);
- a gang starts whole or not at all: a running job holds exactly its placement, between its
  minimum and its size, in whole replicas, on online slots; a stopping job keeps what it held;
- starts are for queued jobs, resizes and preemptions for running ones; a job is never both
  queued and running; what the scheduler says a job holds is what the decisions gave it;
- held slots never exceed the cluster, and running jobs hold only online slots;
- a submit is refused (``RejectJob``) exactly when the cluster could never hold the job; a
  resize is refused (the request unchanged) or asks for what the cluster could hold;
- an idle cluster leaves no queued job waiting that it could hold;
- at the end every job is in exactly one terminal state and holds nothing.

A failure names the seed and the event; ``python -m tests.test_scheduler_property SEED``
replays that workload and prints every event with its decisions.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from itertools import pairwise
from typing import TextIO

import pytest

from nbtrain.core.placement import Layout
from nbtrain.core.sched_types import (
    Cancelled,
    Checkpointed,
    Decision,
    Event,
    Failed,
    Finished,
    JobRequest,
    PreemptJob,
    RejectJob,
    Released,
    ResizeJob,
    ResizeRequested,
    Resume,
    SchedulerConfig,
    StartJob,
    Submit,
    Suspend,
    Tick,
    WorkersAdded,
    WorkersForgotten,
    WorkersRemoved,
)
from nbtrain.core.scheduler import Scheduler
from nbtrain.core.topology import Topology

# Small random workloads (5-60 jobs each), in CHUNKS parametrized cases. The suite runs 800;
# a longer campaign: NBTRAIN_PROPERTY_WORKLOADS=20000 pytest tests/test_scheduler_property.py
N_WORKLOADS = int(os.environ.get("NBTRAIN_PROPERTY_WORKLOADS", "800"))
CHUNKS = 8
BIG_SEEDS = (0, 1, 2)  # the 400-job, three-priority, 4 x 8 GPU workload of issue 24
# Seeds that find a bug, replayed one by one: 24 and 193 raised "need at least one array to
# concatenate" before the empty-victims fix (as do all three BIG_SEEDS); 113, 154 and 183
# kept a queued job resized beyond the cluster, which then waited for ever.
REGRESSIONS = (24, 113, 154, 183, 193)

# The engine's view of a job; the scheduler's own states plus the two it never holds.
QUEUED, RUNNING, STOPPING, HELD, DONE = "queued", "running", "stopping", "held", "done"
REJECTED, FORGOTTEN = "rejected", "forgotten"


class Violation(AssertionError):
    """A broken guarantee, with the seed and event that reproduce it."""


@dataclasses.dataclass
class _Job:
    req: JobRequest
    state: str = QUEUED
    slots: tuple[Hashable, ...] = ()


# ---------------------------------------------------------------------------------- clusters
def _declared(hosts: int, gpus: int, *, hosts_per_leaf: int | None = None,
              nvlink_gpus: int | None = None, nvlink_hosts: int = 1
              ) -> Callable[[random.Random], Topology]:
    return lambda rng: Topology.declare(hosts, gpus, hosts_per_leaf=hosts_per_leaf,
                                        nvlink_gpus=nvlink_gpus, nvlink_hosts=nvlink_hosts)


def _from_hosts(rng: random.Random) -> Topology:
    """1-4 hosts of 1-4 slots, sometimes NVLink pairs and two leaf switches."""
    hosts: dict[str, list[Hashable]] = {}
    nvlink: dict[Hashable, str] = {}
    leaf: dict[str, str] = {}
    pairs = rng.random() < 0.3
    for h in range(rng.randint(1, 4)):
        name = f"h{h}"
        hosts[name] = [f"{name}/{k}" for k in range(rng.randint(1, 4))]
        if pairs:
            nvlink.update({s: f"{name}-p{k // 2}" for k, s in enumerate(hosts[name])})
        if rng.random() < 0.5:
            leaf[name] = f"leaf{h % 2}"
    return Topology.from_hosts(hosts, nvlink_of=nvlink, leaf_of=leaf)


# name -> (builder, whether workers may join as new hosts and be forgotten)
SHAPES: dict[str, tuple[Callable[[random.Random], Topology], bool]] = {
    "1x1": (_declared(1, 1), False),
    "1x2": (_declared(1, 2), False),
    "3x2": (_declared(3, 2), False),
    "2x4": (_declared(2, 4), False),
    "4x4-nvlink-pairs": (_declared(4, 4, nvlink_gpus=2, hosts_per_leaf=2), False),
    "4x8": (_declared(4, 8, hosts_per_leaf=2), False),
    "8x4-nvl2": (_declared(8, 4, hosts_per_leaf=4, nvlink_hosts=2), False),
    "from-hosts": (_from_hosts, True),
}
SHAPE_WEIGHTS = (1, 2, 1, 3, 2, 3, 1, 4)


def _tp_capacity(topo: Topology, online: set[Hashable] | None, tp: int) -> int:
    """Slots the cluster can give a job in whole TP groups, each inside one NVLink domain
    (only the ``online`` slots, when given)."""
    b = topo.bounds["nvlink"].tolist()
    total = 0
    for a, z in pairwise(b):
        n = z - a if online is None else sum(topo.slot_ids[i] in online for i in range(a, z))
        total += n // tp * tp
    return total


def _fits(topo: Topology, req: JobRequest, placement: str = "topology",
          online: set[Hashable] | None = None) -> bool:
    """Whether the job's minimum fits when every slot (every ``online`` one) is free. Only
    topology placement keeps TP groups inside NVLink domains; a submit is judged that way
    whatever the policy."""
    if placement != "topology":
        return req.min_slots <= (topo.n_slots if online is None else len(online))
    return req.min_slots <= _tp_capacity(topo, online, req.layout.tp)


# ---------------------------------------------------------------------------------- workloads
def _config(rng: random.Random, teams: list[str], seed: int) -> SchedulerConfig:
    return SchedulerConfig(
        order="fifo" if rng.random() < 0.2 else "priority",
        backfill=rng.random() < 0.8,
        preemption=rng.random() < 0.85,
        fair_share=rng.random() < 0.8,
        team_weights={t: rng.choice([0.5, 1.0, 2.0, 4.0]) for t in teams if rng.random() < 0.7},
        fair_share_half_life_s=rng.choice([600.0, 3600.0, 7 * 86400.0]),
        max_wait_s=rng.choice([None, 300.0, 12 * 3600.0]),
        preempt_grace_s=rng.choice([0.0, 30.0, 120.0]),
        restart_cost_s=rng.choice([0.0, 60.0]),
        placement=rng.choices(["topology", "first_fit", "random"], [7, 2, 1])[0],
        seed=seed,
        elastic_grow=rng.random() < 0.8,
        can_grow=rng.random() < 0.15,
        min_resize_interval_s=rng.choice([0.0, 0.0, 120.0]),
    )


def _request(rng: random.Random, job_id: str, topo: Topology, n_prio: int,
             teams: list[str]) -> JobRequest:
    n_slots = topo.n_slots
    tps = [1, 2, 4, 8] if rng.random() < 0.1 else [t for t in (1, 2, 4, 8)
                                                  if t <= topo.max_nvlink]
    tp = rng.choices(tps, [6, 3, 2, 1][: len(tps)])[0]  # wider than NVLink: now and then
    pp = 2 if rng.random() < 0.1 else 1
    cp = 2 if rng.random() < 0.05 else 1
    layout = Layout(tp=tp, pp=pp, cp=cp)
    r = layout.replica
    most = max(1, n_slots // r)
    if rng.random() < 0.08:
        k = most + rng.randint(1, 4)  # more than the cluster holds
    elif rng.random() < 0.15:
        k = most  # the whole cluster
    else:
        k = rng.randint(1, max(1, min(most, 2 ** rng.randint(0, 4))))
    min_size = r * rng.randint(1, k - 1) if k > 1 and rng.random() < 0.35 else None
    if min_size is None and rng.random() < 0.05:
        min_size = r * k  # min_size == size: has a floor, but is not elastic
    return JobRequest(
        job_id=job_id, size=r * k, layout=layout, min_size=min_size,
        priority=rng.randrange(n_prio), team=rng.choice(teams),
        preemptible=rng.random() < 0.85,
        est_duration_s=rng.uniform(30.0, 3600.0) if rng.random() < 0.6 else None,
        checkpoint_every_s=rng.choice([60.0, 600.0]) if rng.random() < 0.4 else None,
    )


@dataclasses.dataclass
class Workload:
    seed: int
    topo: Topology
    dynamic: bool
    config: SchedulerConfig
    jobs: list[JobRequest]
    shape: str


def make_workload(seed: int, *, big: bool = False) -> Workload:
    rng = random.Random(seed)
    if big:
        shape, n_jobs, n_prio = "4x8", 400, 3
    else:
        shape = rng.choices(list(SHAPES), SHAPE_WEIGHTS)[0]
        # 5 to 60 jobs, most workloads small: many of them in the time
        n_jobs, n_prio = 5 + int(55 * rng.random() ** 3), rng.randint(1, 4)
    build, dynamic = SHAPES[shape]
    topo = build(rng)
    teams = ["a", "b", "c"][: rng.randint(1, 3)]
    config = SchedulerConfig(team_weights={"a": 1.0, "b": 2.0, "c": 0.5}) if big else _config(
        rng, teams, seed)
    jobs = [_request(rng, f"j{i}", topo, n_prio, teams) for i in range(n_jobs)]
    return Workload(seed, topo, dynamic, config, jobs, shape)


# ---------------------------------------------------------------------------------- the run
class Run:
    """Drives one workload, carries the decisions out as the engine does and checks the
    guarantees after every event."""

    def __init__(self, w: Workload, log: TextIO | None = None) -> None:
        self.w = w
        self.rng = random.Random(w.seed * 7919 + 1)
        self.s = Scheduler(w.topo, w.config)
        self.log = log
        self.t = 0.0
        self.k = 0  # events handled
        self.jobs: dict[str, _Job] = {}
        self.live: set[str] = set()  # jobs not in a terminal state
        self.holder: dict[Hashable, str] = {}  # slot -> job holding it, as the engine sees it
        self.online: set[Hashable] = set(w.topo.slot_ids)
        self.offline: set[Hashable] = set()
        self.hosts = len(w.topo.host_names)
        self.next_job = 0
        self.seen: Counter[str] = Counter()  # what the run exercised, for the coverage check

    # ------------------------------------------------------------------ checks
    def fail(self, what: str, ev: Event | None = None) -> Violation:
        return Violation(
            f"seed={self.w.seed} event #{self.k} ({ev!r}) on {self.w.shape}: {what}\n"
            f"replay: python -m tests.test_scheduler_property {self.w.seed}"
            f"{' --big' if len(self.w.jobs) == 400 else ''}")

    def handle(self, ev: Event) -> list[Decision]:
        self.k += 1
        job_id = getattr(ev, "job_id", None)
        state = self.jobs[job_id].state if job_id in self.jobs else None
        self.seen[f"{type(ev).__name__}:{state}"] += 1
        asked = self.s.job(ev.job_id).request if isinstance(ev, ResizeRequested) else None
        try:
            out = self.s.handle(ev)
        except Exception as err:
            raise self.fail(f"handle raised {type(err).__name__}: {err}", ev) from err
        if self.log is not None:
            print(f"#{self.k} t={ev.now:.1f} {ev!r}", file=self.log)
            for d in out:
                print(f"    -> {d!r}", file=self.log)
        self.seen.update(type(d).__name__ for d in out)
        self._engine_applies(ev, out)
        if isinstance(ev, ResizeRequested):
            assert asked is not None
            self._check_resize(ev, out, asked)
        self._compare(ev)
        return out

    def _take(self, job: _Job, slots: tuple[Hashable, ...], d: Decision, ev: Event) -> None:
        """The engine puts ``job`` on ``slots`` (a start or a resize)."""
        req = self.s.job(job.req.job_id).request
        n = len(slots)
        if len(set(slots)) != n:
            raise self.fail(f"{d!r} places two ranks on one slot", ev)
        if not (req.min_slots <= n <= req.size and n % req.layout.replica == 0):
            raise self.fail(f"{d!r}: {n} ranks outside [{req.min_slots}, {req.size}] in "
                            f"whole replicas of {req.layout.replica}", ev)
        for slot in slots:
            other = self.holder.get(slot)
            if other is not None and other != job.req.job_id:
                raise self.fail(f"{d!r} puts {job.req.job_id} on slot {slot!r}, held by "
                                f"{other}", ev)
            if slot not in self.online:
                raise self.fail(f"{d!r} uses slot {slot!r}, which is offline", ev)
        for slot in job.slots:
            del self.holder[slot]
        for slot in slots:
            self.holder[slot] = job.req.job_id
        job.slots = slots
        job.state = RUNNING

    def _let_go(self, job: _Job, state: str) -> None:
        for slot in job.slots:
            del self.holder[slot]
        job.slots = ()
        job.state = state
        if state in (DONE, REJECTED, FORGOTTEN):
            self.live.discard(job.req.job_id)

    def _engine_applies(self, ev: Event, out: list[Decision]) -> None:
        """The event's own effect on the engine's view, then the decisions in order."""
        if isinstance(ev, Submit):
            self._submitted(ev, out)
        elif isinstance(ev, Finished | Cancelled | Failed | Released | Suspend | Resume):
            job = self.jobs[ev.job_id]
            holds = job.state in (RUNNING, STOPPING)
            if job.state in (DONE, REJECTED, FORGOTTEN):
                pass  # the scheduler ignores news of a job that has ended
            elif isinstance(ev, Finished | Cancelled):
                self._let_go(job, DONE)
            elif isinstance(ev, Failed) and holds:
                self._let_go(job, QUEUED if ev.requeue else DONE)
            elif isinstance(ev, Released) and holds:
                self._let_go(job, QUEUED)
            elif isinstance(ev, Suspend):
                self._let_go(job, HELD)
            elif isinstance(ev, Resume) and job.state == HELD:
                job.state = QUEUED
        elif isinstance(ev, WorkersRemoved):
            self.online.difference_update(ev.slots)
            self.offline.update(ev.slots)
        elif isinstance(ev, WorkersAdded):
            for slots in ev.hosts.values():
                self.online.update(slots)
                self.offline.difference_update(slots)
        elif isinstance(ev, WorkersForgotten):
            have = set(self.s.topo.slot_ids)
            for slot in ev.slots:
                if slot not in have:
                    if slot not in self.offline or slot in self.holder:
                        raise self.fail(f"forgot slot {slot!r}, online or held", ev)
                    self.offline.discard(slot)
                    self.seen["slot forgotten"] += 1
        for d in out:
            self._carry_out(d, ev)

    def _submitted(self, ev: Submit, out: list[Decision]) -> None:
        rid = ev.job.job_id
        rejected = [d for d in out if isinstance(d, RejectJob) and d.job_id == rid]
        if rid in self.jobs:  # a second submit under a live id
            if len(rejected) != 1:
                raise self.fail(f"duplicate id {rid} not refused", ev)
            return
        self.jobs[rid] = _Job(ev.job)
        self.live.add(rid)
        fits = self.w.config.can_grow or _fits(self.s.topo, ev.job)
        if bool(rejected) == fits:
            raise self.fail(f"{rid} (min {ev.job.min_slots}, tp {ev.job.layout.tp}) "
                            f"{'refused' if rejected else 'accepted'} on a cluster that "
                            f"{'could' if fits else 'could never'} hold it", ev)
        if rejected:
            self.jobs[rid].state = REJECTED
            self.live.discard(rid)

    def _carry_out(self, d: Decision, ev: Event) -> None:
        """One decision, as the engine carries it out (in order)."""
        if isinstance(d, RejectJob):
            return
        job = self.jobs.get(d.job_id)
        if job is None:
            raise self.fail(f"{d!r} for a job never submitted", ev)
        if isinstance(d, StartJob | ResizeJob):
            want = RUNNING if isinstance(d, ResizeJob) else QUEUED
            if job.state != want:
                raise self.fail(f"{d!r} for a job that is {job.state}", ev)
            p = d.placement
            if p.layout != job.req.layout or p.mesh_shape != p.layout.mesh_shape(p.world_size):
                raise self.fail(f"{d!r}: mesh or layout disagree with the request", ev)
            if isinstance(d, ResizeJob) and d.old_size != len(job.slots):
                raise self.fail(f"{d!r}: old_size, but it held {len(job.slots)}", ev)
            # Placements are on the topology the event left.
            if tuple(self.s.topo.slot_ids[i] for i in p.indices) != p.slots:
                raise self.fail(f"{d!r}: indices name other slots", ev)
            self._take(job, p.slots, d, ev)
        elif isinstance(d, PreemptJob):
            if job.state != RUNNING:
                raise self.fail(f"{d!r} for a job that is {job.state}", ev)
            if d.for_job is not None:
                by = self.jobs[d.for_job]
                if by.req.priority < job.req.priority or by.state != QUEUED:
                    raise self.fail(f"{d!r}: for a {by.state} job of priority "
                                    f"{by.req.priority}, above the victim's "
                                    f"{job.req.priority}", ev)
            job.state = STOPPING

    def _check_resize(self, ev: ResizeRequested, out: list[Decision],
                      asked: JobRequest) -> None:
        """A refused resize leaves the request as it was; a kept one is a size the cluster
        could hold (or may grow to)."""
        now = self.s.job(ev.job_id).request
        if any(isinstance(d, RejectJob) for d in out):
            if now != asked:
                raise self.fail(f"refused, but the request changed to {now!r}", ev)
        elif not (self.w.config.can_grow or _fits(self.s.topo, now, self.w.config.placement)):
            raise self.fail(f"{ev.job_id} resized to a minimum of {now.min_slots} (tp "
                            f"{now.layout.tp}) that the cluster can never hold, not refused",
                            ev)

    def _compare(self, ev: Event) -> None:
        """The scheduler's books agree with what its decisions told the engine."""
        s = self.s
        try:
            s.check_invariants()
        except AssertionError as err:
            raise self.fail(f"check_invariants: {err}", ev) from err
        queued = s.queued()
        expect_q = {k for k in self.live if self.jobs[k].state == QUEUED}
        if len(set(queued)) != len(queued) or set(queued) != expect_q:
            raise self.fail(f"queued {queued}, the engine expects {sorted(expect_q)}", ev)
        # Who holds which slot is compared below; here the states, and the gangs.
        states = {k: st for st in (QUEUED, RUNNING, STOPPING, HELD) for k in s.job_ids(st)}
        if states != {k: self.jobs[k].state for k in self.live}:
            wrong = sorted(k for k in states.keys() | self.live
                           if states.get(k, DONE) != self.jobs[k].state)
            raise self.fail(f"jobs {wrong} are {[states.get(k, DONE) for k in wrong]}, their "
                            f"decisions made them {[self.jobs[k].state for k in wrong]}", ev)
        for k, st in states.items():
            if st != RUNNING:
                continue
            view = s.job(k)
            req = view.request
            if not (req.min_slots <= view.size <= req.size
                    and view.size % req.layout.replica == 0
                    and all(x in self.online for x in view.slots)):
                raise self.fail(f"running {k} holds {view.slots}: not a whole gang in "
                                f"[{req.min_slots}, {req.size}] of online slots", ev)
        owners = s.owners()
        held: dict[Hashable, str] = {
            x: o for x, o in zip(s.topo.slot_ids, owners, strict=True) if o is not None}
        if held != self.holder:
            diff: list[Hashable] = sorted((x for x in held.keys() | self.holder.keys()
                                           if held.get(x) != self.holder.get(x)),
                                          key=lambda x: str(x))
            raise self.fail(f"slots {diff} held by {[held.get(x) for x in diff]}, the "
                            f"engine has {[self.holder.get(x) for x in diff]}", ev)
        if len(held) > s.topo.n_slots:
            raise self.fail(f"{len(held)} slots held of {s.topo.n_slots}", ev)
        free = len(self.online) - sum(x in self.online for x in self.holder)
        if s.n_free != free or s.n_online != len(self.online):
            raise self.fail(f"{s.n_free} free of {s.n_online} online; the engine has "
                            f"{free} of {len(self.online)}", ev)
        if not self.holder:
            self._check_idle(ev, queued)

    def _check_idle(self, ev: Event, queued: list[str]) -> None:
        """Nothing runs: no queued job may wait that the cluster could hold (behind one that
        it cannot hold, only with backfill)."""
        cfg = self.w.config
        for k in queued:
            req = self.s.job(k).request
            if not _fits(self.s.topo, req, cfg.placement, self.online):
                if not cfg.backfill:
                    return
                continue
            raise self.fail(f"the cluster is idle but {k} (min {req.min_slots}, tp "
                            f"{req.layout.tp}) waits: {queued}", ev)

    # ------------------------------------------------------------------ the engine's moves
    def _pick(self, *states: str) -> str | None:
        cands = sorted(k for k in self.live if self.jobs[k].state in states)
        return self.rng.choice(cands) if cands else None

    def _events(self) -> Iterator[Event]:
        """Random engine events until every job is submitted and a few more."""
        rng = self.rng
        budget = 2 * len(self.w.jobs) + 10
        while self.next_job < len(self.w.jobs) or budget > 0:
            budget -= 1
            self.t += 0.0 if rng.random() < 0.1 else rng.expovariate(1 / 60.0)
            ev = self._one_event(rng)
            if ev is not None:
                yield ev

    def _one_event(self, rng: random.Random) -> Event | None:
        t = self.t
        kinds = ["submit", "finish", "release", "fail", "cancel", "suspend", "resume", "ckpt",
                 "resize", "remove", "add", "tick", "stale", "dup", "forget"]
        weights = [5 if self.next_job < len(self.w.jobs) else 0, 3, 4, 1, 1, 0.3, 0.5, 1,
                   0.7, 0.4, 0.5, 0.5, 0.2, 0.05, 0.2]
        if self.w.dynamic:
            kinds += ["join", "forget-slots"]
            weights += [0.15, 0.2]
        kind = rng.choices(kinds, weights)[0]
        if kind == "submit":
            if self.next_job >= len(self.w.jobs):
                return None
            self.next_job += 1
            return Submit(t, self.w.jobs[self.next_job - 1])
        if kind in ("finish", "release", "fail", "cancel", "suspend", "resume", "ckpt",
                    "resize", "dup"):
            return self._job_event(kind, t, rng)
        if kind == "remove" and self.online:
            if rng.random() < 0.7:
                return WorkersRemoved(t, (rng.choice(sorted(self.online, key=str)),))
            hosts = self.s.topo.hosts()
            return WorkersRemoved(t, tuple(hosts[rng.choice(sorted(hosts))]))
        if kind == "add" and self.offline:
            back = set(rng.sample(sorted(self.offline, key=str),
                                  rng.randint(1, len(self.offline))))
            by_host = {h: tuple(x for x in ss if x in back)
                       for h, ss in self.s.topo.hosts().items()}
            return WorkersAdded(t, {h: ss for h, ss in by_host.items() if ss})
        if kind == "join":
            name = f"n{self.hosts}"
            self.hosts += 1
            slots = tuple(f"{name}/{k}" for k in range(rng.randint(1, 4)))
            nvl: dict[Hashable, str] = ({x: f"{name}-p{k // 2}" for k, x in enumerate(slots)}
                                        if rng.random() < 0.3 else {})
            leaf = {name: f"leaf{rng.randint(0, 1)}"} if rng.random() < 0.5 else {}
            return WorkersAdded(t, {name: slots}, nvlink_of=nvl, leaf_of=leaf)
        if kind == "forget-slots" and self.offline:
            return WorkersForgotten(t, tuple(rng.sample(sorted(self.offline, key=str),
                                                        rng.randint(1, len(self.offline)))))
        ended = sorted(k for k, j in self.jobs.items() if j.state == DONE)
        if kind == "stale" and ended:  # the engine repeats itself about a job that has ended
            j = rng.choice(ended)
            stale: list[Event] = [Finished(t, j), Released(t, j), Failed(t, j, requeue=True),
                                  Checkpointed(t, j), Cancelled(t, j), Resume(t, j)]
            return rng.choice(stale)
        if kind == "forget" and ended:
            j = rng.choice(ended)
            self.s.forget(j)
            self.jobs[j].state = FORGOTTEN
            if j in self.s.job_ids():
                raise self.fail(f"forget({j}) kept it", Tick(t))
        return Tick(t)

    def _job_event(self, kind: str, t: float, rng: random.Random) -> Event | None:
        """An event about one live job, picked among those the engine could send it for."""
        states = {"finish": (RUNNING, STOPPING), "release": (STOPPING,),
                  "fail": (RUNNING, STOPPING), "cancel": (QUEUED, RUNNING, STOPPING, HELD),
                  "suspend": (QUEUED, RUNNING), "resume": (HELD,), "ckpt": (RUNNING,),
                  "resize": (QUEUED, RUNNING, STOPPING, HELD),
                  "dup": (QUEUED, RUNNING, STOPPING, HELD)}[kind]
        j = self._pick(*states)
        if j is None and kind == "release" and rng.random() < 0.1:
            j = self._pick(RUNNING)  # the engine stopped it itself (a straggler's replacement)
        if j is None:
            return None
        if kind == "finish":
            return Finished(t, j)
        if kind == "release":
            return Released(t, j, avoid=self._avoid(j))
        if kind == "fail":
            return Failed(t, j, requeue=rng.random() < 0.6, avoid=self._avoid(j))
        if kind == "cancel":
            return Cancelled(t, j)
        if kind == "suspend":
            return Suspend(t, j)
        if kind == "resume":
            return Resume(t, j)
        if kind == "ckpt":
            return Checkpointed(t, j)
        if kind == "dup":
            return Submit(t, self.jobs[j].req)
        r = self.jobs[j].req.layout.replica
        size = r * rng.randint(1, max(1, 2 * self.s.topo.n_slots // r))
        return ResizeRequested(t, j, size if rng.random() < 0.9 else size + 1)

    def _avoid(self, j: str) -> frozenset[Hashable]:
        slots = self.jobs[j].slots
        if not slots or self.rng.random() < 0.6:
            return frozenset()
        return frozenset({self.rng.choice(slots)})

    def drain(self) -> None:
        """Bring the workers back, let everything run to its end, cancel what can never
        start; then every job must be in one terminal state and hold nothing.

        Running jobs end before stopping ones release: released first, two lower-priority
        victims of a later preemptor can take turns for ever (see
        ``test_scheduler_cases.test_the_victims_of_a_later_preemptor_do_not_take_turns``)."""
        if self.offline:
            hosts = self.s.topo.hosts()
            self.t += 1.0
            self.handle(WorkersAdded(self.t, {h: tuple(x for x in ss if x in self.offline)
                                              for h, ss in hosts.items()
                                              if any(x in self.offline for x in ss)}))
        for _ in range(10 * len(self.jobs) + 10):
            self.t += 10.0
            running = self._pick(RUNNING)
            stopping = self._pick(STOPPING)
            waiting = self._pick(QUEUED, HELD)
            if running is not None:
                self.handle(Finished(self.t, running))
            elif stopping is not None:
                self.handle(Released(self.t, stopping))
            elif waiting is not None:
                # Idle cluster: _check_idle has shown the queued ones can never start here.
                self.handle(Cancelled(self.t, waiting))
            else:
                break
        end = Tick(self.t)
        if self.live:
            raise self.fail(f"jobs never ended: {sorted(self.live)}", end)
        book = set(self.s.job_ids())
        for k, job in self.jobs.items():
            view = self.s.job(k) if job.state == DONE else None
            if job.slots or (view is None and k in book) or (view is not None and (
                    view.state != DONE or view.size)):
                raise self.fail(f"{k} ended {job.state} holding {job.slots}; the scheduler "
                                f"has {view}", end)
        if self.s.queued() or self.s.n_free != self.s.n_online or any(self.s.owners()):
            raise self.fail("slots still held at the end", end)

    def run(self) -> int:
        self.handle(Tick(0.0))
        for ev in self._events():
            self.handle(ev)
        self.drain()
        return self.k


def run_workload(seed: int, *, big: bool = False, log: TextIO | None = None,
                 seen: Counter[str] | None = None) -> int:
    """Run one seeded workload; returns the number of events handled."""
    run = Run(make_workload(seed, big=big), log)
    n = run.run()
    if seen is not None:
        seen.update(run.seen)
    return n


# ---------------------------------------------------------------------------------- tests
# What every chunk of workloads must have exercised, so a generator change cannot quietly
# stop testing something: decisions, and events by the state the job was in.
MUST_SEE = ("StartJob", "PreemptJob", "ResizeJob", "RejectJob", "Cancelled:queued",
            "Cancelled:running", "Cancelled:stopping", "Failed:running", "Released:stopping",
            "Suspend:running", "Resume:held", "ResizeRequested:running", "WorkersRemoved:None",
            "WorkersAdded:None", "slot forgotten", "Finished:done")


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_workloads_keep_every_guarantee(chunk: int) -> None:
    per = math.ceil(N_WORKLOADS / CHUNKS)
    seen: Counter[str] = Counter()
    events = sum(run_workload(seed, seen=seen)
                 for seed in range(chunk * per, (chunk + 1) * per))
    assert events > 40 * per, events
    assert not [k for k in MUST_SEE if not seen[k]], seen


@pytest.mark.parametrize("seed", BIG_SEEDS)
def test_400_jobs_three_priorities_on_4x8(seed: int) -> None:
    """The workload size that found the empty-victims crash (issue 24)."""
    seen: Counter[str] = Counter()
    assert run_workload(seed, big=True, seen=seen) > 1200
    assert seen["PreemptJob"] > 10, seen


@pytest.mark.parametrize("seed", REGRESSIONS)
def test_regression_seeds(seed: int) -> None:
    run_workload(seed)


def test_the_checks_catch_a_broken_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler that starts a gang on a held slot fails the run, naming seed and event."""
    real = Scheduler.handle

    def broken(self: Scheduler, event: Event) -> list[Decision]:
        out = real(self, event)
        return [dataclasses.replace(d, placement=dataclasses.replace(
            d.placement, slots=(self.topo.slot_ids[0],) * d.size, indices=(0,) * d.size))
            if isinstance(d, StartJob) and d.size > 1 else d for d in out]

    monkeypatch.setattr(Scheduler, "handle", broken)
    with pytest.raises(Violation, match=r"seed=\d+ event #\d+ .*two ranks on one slot"):
        for seed in range(50):
            run_workload(seed)


if __name__ == "__main__":  # replay one seed, printing every event and decision
    args = sys.argv[1:]
    _big = "--big" in args
    _seeds = [int(a) for a in args if a != "--big"] or [0]
    for _seed in _seeds:
        _t0 = time.perf_counter()
        _n = run_workload(_seed, big=_big, log=sys.stdout)
        print(f"seed {_seed}: {_n} events ok in {time.perf_counter() - _t0:.2f} s")
