"""Schedules pinned by hash: work on the scheduler's speed must not change a single decision.

Each case replays a fixed trace (or a fixed random event stream) and hashes every decision.
The expected hashes were recorded from the scheduler before the history-independence work
(issue 18), which left every one unchanged. A change of policy is allowed to change them: then
rerun ``python -m tests.test_sched_hashes`` and write down in the commit why each case moved.

Moved since: the four decision fixes of issue 10 (later jobs may preempt when the head cannot
start; elastic jobs shrunk with preemptions on top rather than stopped whole; the cheapest
victims at any level; backfilled jobs that overran their estimate preemptible for the head).
With the four switched off every hash was the one recorded before them; each moved case
moves under at least one fix alone (the commit lists which), and the cases without
preemption (every ``fifo`` one) did not move. Then issue 11 (elastic resize) moved the four
``events-*`` cases that send ``ResizeRequested``: a request to grow that the cluster can hold
but the free slots cannot is kept (the job grows when slots free up) instead of refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np
import pytest

from nbtrain.core.placement import Layout
from nbtrain.core.sched_types import (
    Cancelled,
    Checkpointed,
    Event,
    Failed,
    Finished,
    JobRequest,
    Released,
    ResizeRequested,
    SchedulerConfig,
    Submit,
    Tick,
    WorkersAdded,
    WorkersRemoved,
)
from nbtrain.core.scheduler import Scheduler
from nbtrain.core.topology import Topology
from nbtrain.sim.gang import GANG_POLICIES, simulate_gang
from nbtrain.sim.trace import TraceJob, generate

SMALL = Topology.declare(16, 8, hosts_per_leaf=4, leaves_per_pod=2)
NVL = Topology.declare(16, 4, hosts_per_leaf=8, nvlink_hosts=4)  # 4 multi-host NVLink domains
PAIRS = Topology.declare(8, 8, hosts_per_leaf=4, nvlink_gpus=2)  # NVLink pairs inside a host
BIG = Topology.declare(1024, 8, hosts_per_leaf=32, leaves_per_pod=8)


def _sim(topo: Topology, trace: list[TraceJob], policy: str | SchedulerConfig = "nbtrain",
         **kw: object) -> str:
    return simulate_gang(topo, trace, policy, **kw).schedule_hash  # type: ignore[arg-type]


def _events(seed: int, topo: Topology, cfg: SchedulerConfig, n: int = 400) -> str:
    """A seeded random stream of every event kind, straight into ``Scheduler.handle``; the
    hash covers the full repr of every decision (placements, reasons, grace). On a topology
    built ``from_hosts``, an "add" with nothing removed brings a new host."""
    rng = np.random.default_rng(seed)
    s = Scheduler(topo, cfg)
    h = hashlib.sha256()
    t = 0.0
    removed: list[str] = []
    n_jobs = 0
    for _ in range(n):
        t += float(rng.exponential(30.0))
        live = s.job_ids("running") + s.job_ids("stopping")
        queued = s.job_ids("queued")
        kind = rng.choice(["submit"] * 4 + ["finish"] * 2 + ["release", "fail", "resize",
                                                               "remove", "add", "ckpt",
                                                               "cancel", "tick"])
        ev: Event
        if kind == "submit" or not live:
            tp = int(rng.choice([1, 2, 4]))
            size = tp * int(2 ** rng.integers(0, 4))
            elastic = bool(rng.random() < 0.3) and size > tp
            ev = Submit(t, JobRequest(
                job_id=f"j{n_jobs}", size=size, layout=Layout(tp=tp),
                min_size=tp if elastic else None, priority=int(rng.integers(0, 3)),
                team="abc"[n_jobs % 3], preemptible=bool(rng.random() < 0.9),
                est_duration_s=float(rng.uniform(60, 3600)) if rng.random() < 0.8 else None,
                checkpoint_every_s=600.0 if rng.random() < 0.5 else None,
            ))
            n_jobs += 1
        elif kind in ("finish", "release", "fail", "resize", "ckpt"):
            job = live[int(rng.integers(len(live)))]
            if kind == "finish":
                ev = Finished(t, job)
            elif kind == "release":
                ev = Released(t, job)
            elif kind == "fail":
                ev = Failed(t, job, requeue=bool(rng.random() < 0.5))
            elif kind == "ckpt":
                ev = Checkpointed(t, job)
            else:
                r = s.job(job).request.layout.replica
                ev = ResizeRequested(t, job, r * int(rng.integers(1, 4)))
        elif kind == "cancel" and queued:
            ev = Cancelled(t, queued[int(rng.integers(len(queued)))])
        elif kind == "remove":
            slot = str(s.topo.slot_ids[int(rng.integers(s.topo.n_slots))])
            removed.append(slot)
            ev = WorkersRemoved(t, (slot,))
        elif kind == "add" and removed:
            slot = removed.pop(int(rng.integers(len(removed))))
            ev = WorkersAdded(t, {slot.split(":")[0].split("/")[0]: (slot,)})
        elif kind == "add" and ":" not in str(topo.slot_ids[0]):
            host = f"new{t:.0f}"
            ev = WorkersAdded(t, {host: tuple(f"{host}/{k}" for k in range(4))})
        else:
            ev = Tick(t)
        out = s.handle(ev)
        h.update(repr((round(t, 6), type(ev).__name__, out)).encode())
    s.check_invariants()
    return h.hexdigest()


def _small(seed: int, **kw: object) -> list[TraceJob]:
    return generate(400, SMALL.n_slots, load=1.2, seed=seed, max_size=64, **kw)  # type: ignore[arg-type]


def _preempt_heavy() -> list[TraceJob]:
    base = generate(300, SMALL.n_slots, load=2.0, seed=12, max_size=32,
                    priorities=((0, 0.5), (1, 0.3), (2, 0.2)))
    end = base[-1].submit_s
    urgent = [TraceJob(job_id=f"u{i}", submit_s=end * f, size=64, tp=8, duration_s=1800.0,
                       priority=3) for i, f in enumerate((0.2, 0.4, 0.6, 0.8))]
    return sorted(base + urgent, key=lambda j: j.submit_s)


def _backlog(n: int, topo: Topology, seed: int) -> list[TraceJob]:
    trace = generate(n, topo.n_slots, load=0.9, seed=seed, size_alpha=0.5,
                     max_size=min(1024, topo.n_slots // 4))
    return [dataclasses.replace(j, submit_s=0.0) for j in trace]


CASES: dict[str, Callable[[], str]] = {}
for _seed in (0, 1, 2):
    for _policy in GANG_POLICIES:
        CASES[f"small-{_policy}-s{_seed}"] = (
            lambda s=_seed, p=_policy: _sim(SMALL, _small(s), p, seed=s))
CASES.update({
    "small-elastic": lambda: _sim(SMALL, _small(11, elastic_fraction=0.7)),
    "small-elastic-fifo": lambda: _sim(SMALL, _small(11, elastic_fraction=0.7), "fifo"),
    "small-sweeps": lambda: _sim(SMALL, _small(13, sweep_mean=6.0)),
    "small-preempt": lambda: _sim(SMALL, _preempt_heavy(), checkpoint_write_s=10.0),
    "small-preempt-kill": lambda: _sim(SMALL, _preempt_heavy(), checkpoint_write_s=300.0),
    "small-aging": lambda: _sim(SMALL, _small(14), SchedulerConfig(max_wait_s=3600.0)),
    "small-horizon": lambda: _sim(SMALL, _small(15), horizon_s=_small(15)[200].submit_s),
    "small-backlog": lambda: _sim(SMALL, _backlog(300, SMALL, 16)),
    "nvl-multihost": lambda: _sim(NVL, generate(300, NVL.n_slots, load=1.2, seed=17,
                                                max_size=32, gpus_per_host=4)),
    "nvl-multihost-ff": lambda: _sim(NVL, generate(300, NVL.n_slots, load=1.2, seed=17,
                                                   max_size=32, gpus_per_host=4), "first_fit"),
    "nvl-pairs": lambda: _sim(PAIRS, generate(300, PAIRS.n_slots, load=1.2, seed=18,
                                              max_size=32, gpus_per_host=2)),
    "events-topology": lambda: _events(21, Topology.declare(4, 4, hosts_per_leaf=2),
                                       SchedulerConfig(team_weights={"a": 1.0, "b": 3.0})),
    "events-first-fit": lambda: _events(22, Topology.declare(4, 4, hosts_per_leaf=2),
                                        SchedulerConfig(placement="first_fit")),
    "events-no-backfill": lambda: _events(23, Topology.declare(8, 4, hosts_per_leaf=4),
                                          SchedulerConfig(backfill=False, max_wait_s=600.0)),
    "events-fifo": lambda: _events(24, Topology.declare(4, 4, hosts_per_leaf=2),
                                   GANG_POLICIES["fifo"]),
    "events-new-hosts": lambda: _events(26, Topology.from_hosts(
        {f"10.0.0.{h}": [f"10.0.0.{h}/{k}" for k in range(4)] for h in range(3)}),
        SchedulerConfig(), n=250),
    "events-random": lambda: _events(25, Topology.declare(4, 4, hosts_per_leaf=2),
                                     SchedulerConfig(placement="random", seed=3)),
})
SLOW_CASES: dict[str, Callable[[], str]] = {
    "big-load-3000": lambda: _sim(BIG, generate(3000, BIG.n_slots, load=0.9, seed=1,
                                                size_alpha=0.5), seed=1),
    "big-backlog-1000": lambda: _sim(BIG, _backlog(1000, BIG, 1), seed=1, window_end=1.0),
}

EXPECTED: dict[str, str] = {
    'small-nbtrain-s0': 'dda07b077868dff7dc60d2c3300bf6f80b14d5117b4cdf8e1f3672003ca31a01',
    'small-fifo-s0': '83b9309ec27e6ea243250ecd9c160a4b6ddd44f4beeaaf30d1dd4a7ae61a50b8',
    'small-first_fit-s0': '3f13a5c3c9d941e24cc11a10d39b23699f7894cd4c8030e71f51579f3afff725',
    'small-random-s0': '6e80c1fd643be071d0780fda60dcc6b7d0ea35068acc36c178269d06ad32a711',
    'small-nbtrain-s1': 'e1b41851ee9f8958823e86b64f7c09dbfbc8baf26b3d8ed6eea0d304cafeadeb',
    'small-fifo-s1': '079f7035e2551cb391357cb38f0ef5b15f40290ea384dbde9204f69608c052eb',
    'small-first_fit-s1': 'd3b6521102003a1f4461163e1a4f01741d10b9b399d90d3cd8e4308fb17e9224',
    'small-random-s1': '39ca5526216777025de6ad41425f9f3ccff5c25623b433c7016cb43ee18268eb',
    'small-nbtrain-s2': 'c2ed0e6750b1de005c1bf93210db996d115485a013e05441b024b7bae363504c',
    'small-fifo-s2': 'c6771eb26325a9521f34032df98ee86b1095b70b1b4c2ac055592e262921bfb9',
    'small-first_fit-s2': '308a421b408550c8875b6f357854797b7cbb6669adb83e24086d7a4988653837',
    'small-random-s2': '335d98b07d773c9cfdf0950b9d8b241c8116ee8524c21ac5926f55e4edb15a37',
    'small-elastic': '48167edd14b7327cdff0efa32c7bfd8deda6432f8ac47c8b45d360fc05dd7696',
    'small-elastic-fifo': '40c801a4449e10eb871cd87d045bbde3f4df882f2638ce26477fe3cec8a8f941',
    'small-sweeps': '52977c1aa418f7399ceb37c7c4a477ed2de1745b53b7166e4b892e4fa62fb711',
    'small-preempt': '03ceaa2aa9889e39d0a02c768f9919f8f431cfc3e98fbae1363f768f85ef7ee3',
    'small-preempt-kill': 'bbfb1a96d048d667d203319bf75a2204cea4644a44ee1d69784bcaee85590391',
    'small-aging': '307102b985420267ab87a0757188e153da256e4053189368e84ecff5470edce7',
    'small-horizon': 'e9600cd0c58263aa45c2e19d41c287ac5e8e33002cf1b3e9740ba42f0cdd9fa2',
    'small-backlog': '694c6ada952011956d54e33c638972df06b6937c881a9451ca042b957cb4ed06',
    'nvl-multihost': '7d1fe9cf20c799a849a893baa38e354b1fa2449bbd1e828abb4f1d4f863c1786',
    'nvl-multihost-ff': 'ea130ba8ab34ef67526eb2ac537c90fd1090c1ce210abe9762d263af7b97f8da',
    'nvl-pairs': '74c7497e5d8f82d322cb6f74bda9ed2c74e9cbe9a6e2c366beedaecc8c854ada',
    'events-topology': '0d1dc22c5decd2e0f6d1770e0bce5245ee0b2a1a26fa38e96d59235d6a76f7f6',
    'events-first-fit': '19792756835806ea2970beb01aea5fe68de00fb23cef14538963885a63c12571',
    'events-no-backfill': '1230f39787eb6b026179032c32bfef49f020c375116bb1050edc3690e22a9c48',
    'events-fifo': '825b9a07c621e5f38ee0029ce184ca967a49164cab7b386e585fac2c494b96d4',
    'events-new-hosts': '0fe522fc222e6f38e9bd1d96bfda099a80b54f218df8fdbcde215f66d58b82f2',
    'events-random': '4444781eeb0a5d7666d86021cc6198b7dd73bf086833f62225def28cc26207ab',
    'big-load-3000': '4cf743a7527fbf056bdc71c925e4d955209717978b5f8918cdfdaa93b437d62e',
    'big-backlog-1000': 'e7bbe7366b5f2a371c950ab644f7611dcb9632c9bca464eabd5eae60163d5bd0',
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_hash_unchanged(name: str) -> None:
    assert CASES[name]() == EXPECTED[name], f"schedule of {name!r} changed"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_CASES))
def test_schedule_hash_unchanged_at_8192_gpus(name: str) -> None:
    assert SLOW_CASES[name]() == EXPECTED[name], f"schedule of {name!r} changed"


if __name__ == "__main__":  # print the table to paste above after a justified change
    import time

    for _name, _case in {**CASES, **SLOW_CASES}.items():
        _t0 = time.perf_counter()
        _got = _case()
        print(f"    {_name!r}: {_got!r},  # {time.perf_counter() - _t0:.1f} s")
