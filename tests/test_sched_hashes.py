"""Schedules pinned by hash: work on the scheduler's speed must not change a single decision.

Each case replays a fixed trace (or a fixed random event stream) and hashes every decision.
The expected hashes were recorded from the scheduler before the history-independence work
(issue 18). A change of policy is allowed to change them: then rerun
``python -m tests.test_sched_hashes`` and write down in the commit why each case moved.
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
    'small-nbtrain-s0': '0541b0767a33556358a5ae77cc338cc2b4046ea2c77c86e618acacd2f0cb26ad',
    'small-fifo-s0': '83b9309ec27e6ea243250ecd9c160a4b6ddd44f4beeaaf30d1dd4a7ae61a50b8',
    'small-first_fit-s0': 'fa9c29a376608e9da56f7e78f768436d9a69b7c5ebd97201ffebaeca70eafc27',
    'small-random-s0': '50de1a5e5700b16b2d868d279f851a096e922b26ae765f08bd6640bc49dea0ff',
    'small-nbtrain-s1': '7191102673f96fb2fd79c0281a57cb01f4dc1324fb81e2960bc54ba9e2a03d87',
    'small-fifo-s1': '079f7035e2551cb391357cb38f0ef5b15f40290ea384dbde9204f69608c052eb',
    'small-first_fit-s1': 'b3f2be561d4adefc7a295dcd858bd14e0b10cb29fc75019407763febe7f9b18c',
    'small-random-s1': '6f4602aab3be9cf4e7b5901b88a4a6cdb01095fb960a0f663f3f7676d03228f0',
    'small-nbtrain-s2': '98c45728e7957941499847f77f10618bf419163f32773a98c36290045beefdd3',
    'small-fifo-s2': 'c6771eb26325a9521f34032df98ee86b1095b70b1b4c2ac055592e262921bfb9',
    'small-first_fit-s2': '9b3255a395338ec73a873887063d806493aa7782f8adf2c4c459833f6af76074',
    'small-random-s2': 'e4622ef2e7db4003f59be2d0b3e79f1e62c6fd610d672783537365606ab8a2c0',
    'small-elastic': 'd4b69ec8e75717a52f050aee00e4d526d9052f88ef78e58a4a1859a0b57dabd0',
    'small-elastic-fifo': '40c801a4449e10eb871cd87d045bbde3f4df882f2638ce26477fe3cec8a8f941',
    'small-sweeps': 'f203097bd2b6da15cef66728fe3831a3452d8eef58381839a7443b7e67ef2251',
    'small-preempt': '8ba49379d8ff268dcf861bceb197ed6b154464674f7ecd0c82e0986b204aa894',
    'small-preempt-kill': '85c59fc52d617bc88b332e8351daaa1e808611b12ddaccd5f899d6524797072f',
    'small-aging': '807de217a726646d4198502baeecd4d6f45239c2e136cc649bd246251fb3a01c',
    'small-horizon': '52fbc982f6f447d036b2ca9c4678471fffa0e2bbdb35040e8560fc9f11f8d8de',
    'small-backlog': 'ec5f994a3ea363398907801ddf4598991af9eadf3c531b5273f5eac2faaec373',
    'nvl-multihost': 'd1c0084c5d780c64096110bfd1c9cf1c90dce45644f419e9d1e21bce47f4f426',
    'nvl-multihost-ff': '87979706417a27974309a173ef9e146db454ce83c82ec12b9c3704d3d0ad0105',
    'nvl-pairs': '9a768d1b9ea64228cf6c206f1148324324f49aeea0345eb337cad1adcfbdc0d8',
    'events-topology': '1103af2efd126b89ffd7d3c47b71a428da196c3ce6c0b4dc29870ccb7408c10b',
    'events-first-fit': 'fd55703da0549fd0708f35c481b44993ecf869d4255c9335b373e756bb520f45',
    'events-no-backfill': '1230f39787eb6b026179032c32bfef49f020c375116bb1050edc3690e22a9c48',
    'events-fifo': '471b366f03aaf68be103744bb5aebff8b1c7c425b9ad93048b35eb1c7db04729',
    'events-new-hosts': '4a3c2380e247fb8853be98f2ff0be5c97e56e561ff4cb3909f533e9c6443ed40',
    'events-random': '2e00386e32ddfdb91ff046012db97d0a273b32d7bdff95a2a2b0bf0e5d25bcc3',
    'big-load-3000': '0d8ad58ff5184d8b74c727b8cb29d39c839f4a13df22582d76f64360f106176f',
    'big-backlog-1000': '48e429b3feab9174025332320f09f7425c50d0724a1292dc21aaeeaa72dbc13f',
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
