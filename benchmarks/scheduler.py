"""Gang scheduler benchmark at 8,192 and 65,536 GPUs: decision latency and its aging over a long
replay, utilization, placement quality.

Cluster: 1,024 hosts x 8 GPUs (one NVSwitch per host), 32 hosts per leaf switch, 8 leaves per
pod (4 pods). Jobs from ``nbtrain.sim.trace.generate``: sizes 1-1,024 GPUs, powers of two with
P(2^k) ~ 2^(-k/2) (most jobs small, large jobs carry much of the work), log-normal durations
(median 30 min), 4 teams weighted 1:1:2:4, 80/15/5% at priority 0/1/2, 15% elastic, jobs of a
whole host or more with tp=8 (and pp=2/4 from 8 hosts up).

(a) Backlog: 2,000 jobs queued at once. nbtrain's scheduler replays it to the end; each
    ``Scheduler.handle`` call (2,000 submits, then every finish, release, resize) is timed:
    ``decision_p50_ms`` / ``decision_p99_ms``. ``jobs_replayed_per_s`` is 2,000 over the wall
    time of that replay. The greedy per-rank baseline replays the same backlog (deadlocks).
(b) Load 0.9: Poisson arrivals offering 90% of the cluster, long enough for queues to reach a
    steady state (``--quick``: 4,000 jobs, about 18 simulated hours; full: 10,000). Policies in
    the same run: nbtrain; greedy per-rank (no gang admission); nbtrain's queueing with naive
    first-fit placement (and, full run only, FIFO gang without backfill and random placement).
    ``util_*`` counts only slot-time of complete gangs, over the arrival window less a 20%
    warm-up. A job placed worse than it could be on an empty cluster runs slower (TP off
    NVLink: 3.4x; see ``nbtrain.sim.ledger``), so ``goodput_*`` counts work at ideal speed.
    ``uplink_ratio_vs_firstfit`` is nbtrain's traffic leaving a leaf switch per slot-hour over
    first fit's; ``tp_in_nvlink_fraction`` is the fraction of TP groups nbtrain placed inside
    one NVLink domain; ``jain`` is Jain's index of per-team use / weight.
(c) nbtrain and greedy again on the load trace, with placement not changing job speed
    (``*_no_slowdown``), so the utilization gain does not rest on the slowdown model.
(d) Aging (full run only): 100,000 jobs at load 0.9 (440 simulated hours of arrivals), nbtrain
    only. ``replay_100k_s`` is the wall time of the replay; ``decision_p99_ms_first_10k`` and
    ``decision_p99_ms_last_10k`` are the p99 of the decisions made while the first and the
    last 10,000 jobs arrive (the drain after the last arrival is left out). A scheduler whose
    decisions cost more as finished jobs pile up shows it in the ratio of the two. The same
    figures over the first and last 10,000 *decisions* are reported as ``*_events``: the first
    10,000 decisions come mostly before the cluster first fills up, when a head job is rarely
    blocked, so that ratio compares an idle cluster with a busy one rather than a young
    controller with an old one. ``work_per_decision_first_10k`` / ``_last_10k`` compare the
    same windows in the scheduler's work units (``Scheduler.work``): exact, and free of the
    noise a shared machine adds to wall-clock percentiles.
(e) 65,536 GPUs: 8,192 hosts x 8 GPUs in NVL72-like NVLink domains of 9 hosts (72 GPUs), 36
    hosts per leaf, 16 leaves per pod. 14,000 jobs are submitted at once (the cluster takes
    about 2,000, the rest queue) and replayed for one simulated hour;
    ``decision_p99_ms_65k`` is the p99 of the decisions made while at least 10,000 jobs wait.

Run: ``python benchmarks/scheduler.py --quick`` (about a minute on two cores; skips (d)). The
last stdout line is one JSON object of the figures measured in this run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from nbtrain.core.topology import Topology
from nbtrain.sim.compare import format_table, run_policies
from nbtrain.sim.gang import simulate_gang
from nbtrain.sim.greedy import simulate_greedy
from nbtrain.sim.ledger import SimResult
from nbtrain.sim.progress import Progress
from nbtrain.sim.trace import TraceJob, generate

SIZE_ALPHA = 0.5
AGING_JOBS = 100_000
WINDOW = 10_000
QUEUED_65K = 10_000


def _progress(p: Progress) -> None:
    print(f"  ... {p.line()}", file=sys.stderr, flush=True)


def _p99(ms: np.ndarray) -> float:
    return round(float(np.percentile(ms, 99)), 3) if ms.size else float("nan")


def _aging(topo: Topology, seed: int) -> dict[str, Any]:
    trace = generate(AGING_JOBS, topo.n_slots, load=0.9, seed=seed, size_alpha=SIZE_ALPHA)
    print(f"  arrival window {trace[-1].submit_s / 3600:.1f} simulated hours")
    res = simulate_gang(topo, trace, "nbtrain", seed=seed, progress=_progress,
                        progress_every_s=30.0)
    ms = res.decision_ms
    first, last = _arrival_windows(res, trace)
    figures = {
        "replay_100k_s": round(res.metrics["wall_s"], 1),
        "replay_100k_decisions": int(ms.shape[0]),
        "decision_p99_ms_first_10k": _p99(ms[first]),
        "decision_p99_ms_last_10k": _p99(ms[last]),
        "decision_p99_ms_first_10k_events": _p99(ms[:WINDOW]),
        "decision_p99_ms_last_10k_events": _p99(ms[-WINDOW:]),
        # the same comparison in work units (exact, the same on any machine): mean per decision
        "work_per_decision_first_10k": round(float(res.decision_work[first].mean()), 1),
        "work_per_decision_last_10k": round(float(res.decision_work[last].mean()), 1),
        "replay_100k_schedule_hash": res.schedule_hash,
    }
    # p99 per tenth of the replay: flat when decisions do not age
    tenths = [_p99(part) for part in np.array_split(ms, 10)]
    print(f"  replay {figures['replay_100k_s']} s, {ms.shape[0]:,} decisions; p99 ms per tenth: "
          f"{', '.join(f'{x:.2f}' for x in tenths)}")
    print(f"  p99 while the first / last {WINDOW:,} jobs arrive: "
          f"{figures['decision_p99_ms_first_10k']:.2f} / "
          f"{figures['decision_p99_ms_last_10k']:.2f} ms; over the first / last {WINDOW:,} "
          f"decisions: {figures['decision_p99_ms_first_10k_events']:.2f} / "
          f"{figures['decision_p99_ms_last_10k_events']:.2f} ms")
    print(f"  work units per decision while the first / last {WINDOW:,} jobs arrive: "
          f"{figures['work_per_decision_first_10k']:,.0f} / "
          f"{figures['work_per_decision_last_10k']:,.0f}")
    return figures


def _arrival_windows(res: SimResult, trace: Sequence[TraceJob]) -> tuple[slice, slice]:
    """Decisions made while the first and while the last ``WINDOW`` jobs arrived (one timeline
    point per decision, in order)."""
    times = np.asarray([p[0] for p in res.timeline])
    first_end = int(np.searchsorted(times, trace[WINDOW - 1].submit_s, side="right"))
    last_start = int(np.searchsorted(times, trace[-WINDOW - 1].submit_s, side="right"))
    last_end = int(np.searchsorted(times, trace[-1].submit_s, side="right"))
    return slice(0, first_end), slice(last_start, last_end)


def _big_cluster(seed: int) -> dict[str, Any]:
    topo = Topology.declare(8192, 8, hosts_per_leaf=36, leaves_per_pod=16, nvlink_hosts=9)
    print(f"  cluster: {topo.describe()}")
    trace = generate(QUEUED_65K + 4000, topo.n_slots, load=0.9, seed=seed,
                     size_alpha=SIZE_ALPHA, max_size=1024)
    queued = [dataclasses.replace(j, submit_s=0.0) for j in trace]
    res = simulate_gang(topo, queued, "nbtrain", seed=seed, horizon_s=3600.0, window_end=3600.0)
    waiting = np.asarray([p[3] for p in res.timeline])
    ms = res.decision_ms[waiting >= QUEUED_65K]
    figures = {
        "gpus_65k": topo.n_slots,
        "decision_p99_ms_65k": _p99(ms),
        "decision_p50_ms_65k": round(float(np.percentile(ms, 50)), 3) if ms.size else None,
        "decisions_65k": int(ms.shape[0]),
        "max_queued_65k": int(waiting.max()),
    }
    print(f"  {ms.shape[0]:,} decisions with >= {QUEUED_65K:,} jobs waiting (at most "
          f"{figures['max_queued_65k']:,}): p50 {figures['decision_p50_ms_65k']} ms, p99 "
          f"{figures['decision_p99_ms_65k']} ms; replay {res.metrics['wall_s']:.1f} s")
    return figures


def _backlog(topo: Topology, n_jobs: int, seed: int) -> dict[str, SimResult]:
    trace = generate(n_jobs, topo.n_slots, load=0.9, seed=seed, size_alpha=SIZE_ALPHA)
    queued = [dataclasses.replace(j, submit_s=0.0) for j in trace]
    ours = simulate_gang(topo, queued, "nbtrain", seed=seed, window_end=1.0)
    greedy = simulate_greedy(topo, queued, window_end=1.0)
    return {"nbtrain": ours, "greedy": greedy}


def _makespan_h(res: SimResult) -> float:
    ends = [j["finish"] for j in res.jobs.values() if "finish" in j]
    return max(ends) / 3600 if ends else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="4,000-job load run, no 100,000-job replay (about a minute)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--queued", type=int, default=2000, help="jobs in the backlog replay")
    ap.add_argument("--load-jobs", type=int, default=None,
                    help="jobs in the load-0.9 run (default 4,000 with --quick, else 10,000)")
    args = ap.parse_args()
    load_jobs = args.load_jobs or (4000 if args.quick else 10000)
    topo = Topology.declare(1024, 8, hosts_per_leaf=32, leaves_per_pod=8)
    print(f"cluster: {topo.describe()}")
    t_all = time.perf_counter()

    print(f"\n(a) backlog: {args.queued} jobs queued at t=0, replayed to the end")
    backlog = _backlog(topo, args.queued, args.seed)
    ours_b = backlog["nbtrain"]
    greedy_b = backlog["greedy"]
    for name, res in backlog.items():
        m = res.metrics
        print(f"  {name:8s} makespan {_makespan_h(res):7.2f} h  mean JCT {m['jct_mean_h']:6.2f} h"
              f"  deadlocks {m['deadlocks']:.0f}  preemptions {m['preemptions']:.0f}  "
              f"decisions p50 {m['decision_p50_ms']:.2f} ms p99 {m['decision_p99_ms']:.2f} ms"
              f"  replay {m['wall_s']:.1f} s")

    policies = ["nbtrain", "greedy", "first_fit"] + ([] if args.quick else ["fifo", "random"])
    print(f"\n(b) load 0.9: {load_jobs} jobs, Poisson arrivals; policies {', '.join(policies)}")
    trace = generate(load_jobs, topo.n_slots, load=0.9, seed=args.seed, size_alpha=SIZE_ALPHA)
    print(f"  arrival window {trace[-1].submit_s / 3600:.1f} simulated hours")
    load = run_policies(topo, trace, policies, seed=args.seed)
    print(format_table(load))
    ours, greedy, ff = load["nbtrain"].metrics, load["greedy"].metrics, load["first_fit"].metrics
    print("\n(c) the same load run with placement not changing job speed (--no-slowdown)")
    plain = run_policies(topo, trace, ["nbtrain", "greedy"], seed=args.seed, exposed={})
    print(format_table(plain))

    print(f"\n(e) 65,536 GPUs, {QUEUED_65K:,}+ jobs queued")
    big = _big_cluster(args.seed)
    aging: dict[str, Any] = {}
    if not args.quick:
        print(f"\n(d) aging: {AGING_JOBS:,} jobs at load 0.9, nbtrain only")
        aging = _aging(topo, args.seed)

    figures: dict[str, Any] = {
        "hosts": 1024,
        "gpus": topo.n_slots,
        "queued_jobs": args.queued,
        "decision_p50_ms": round(ours_b.metrics["decision_p50_ms"], 3),
        "decision_p99_ms": round(ours_b.metrics["decision_p99_ms"], 3),
        "decision_max_ms": round(float(ours_b.decision_ms.max()), 3),
        "decision_p99_ms_load": round(ours["decision_p99_ms"], 3),
        "jobs_replayed_per_s": round(args.queued / ours_b.metrics["wall_s"], 1),
        "backlog_makespan_h": round(_makespan_h(ours_b), 2),
        "backlog_makespan_h_greedy": round(_makespan_h(greedy_b), 2),
        "load": 0.9,
        "load_jobs": load_jobs,
        "util_gang": round(ours["util"], 4),
        "util_greedy": round(greedy["util"], 4),
        "util_first_fit": round(ff["util"], 4),
        "util_gain_pts": round(100 * (ours["util"] - greedy["util"]), 2),
        "goodput_gang": round(ours["goodput"], 4),
        "goodput_greedy": round(greedy["goodput"], 4),
        "goodput_first_fit": round(ff["goodput"], 4),
        "util_gang_no_slowdown": round(plain["nbtrain"].metrics["util"], 4),
        "util_greedy_no_slowdown": round(plain["greedy"].metrics["util"], 4),
        "util_gain_pts_no_slowdown": round(
            100 * (plain["nbtrain"].metrics["util"] - plain["greedy"].metrics["util"]), 2),
        "deadlocks": int(ours["deadlocks"] + ours_b.metrics["deadlocks"]),
        "deadlocks_greedy": int(greedy["deadlocks"] + greedy_b.metrics["deadlocks"]),
        "uplink_ratio_vs_firstfit": round(ours["uplink_per_slot_h"] / ff["uplink_per_slot_h"], 4),
        "tp_in_nvlink_fraction": round(ours["tp_in_nvlink"], 4),
        "tp_in_nvlink_fraction_first_fit": round(ff["tp_in_nvlink"], 4),
        "jain": round(ours["jain"], 4),
        "jain_greedy": round(greedy["jain"], 4),
        "wait_mean_h": round(ours["wait_mean_h"], 3),
        "wait_mean_h_greedy": round(greedy["wait_mean_h"], 3),
        "large_wait_mean_h": round(ours["large_wait_mean_h"], 3),
        "preemptions": int(ours["preemptions"]),
        "fragmentation": round(ours["fragmentation"], 4),
    }
    if "fifo" in load:
        figures["util_fifo"] = round(load["fifo"].metrics["util"], 4)
        figures["wait_mean_h_fifo"] = round(load["fifo"].metrics["wait_mean_h"], 3)
    figures |= big | aging
    if aging:
        figures["aging_ratio_p99"] = round(
            aging["decision_p99_ms_last_10k"] / aging["decision_p99_ms_first_10k"], 3)
        figures["aging_ratio_work"] = round(
            aging["work_per_decision_last_10k"] / aging["work_per_decision_first_10k"], 3)
    figures["wall_s"] = round(time.perf_counter() - t_all, 1)
    print()
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
