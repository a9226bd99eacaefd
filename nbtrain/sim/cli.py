"""``nbtrain simulate``: replay a generated or CSV trace under several policies, print a table.

Example::

    nbtrain simulate                                  # 64 hosts x 8 GPUs, 2,000 jobs, load 0.9
    nbtrain simulate --hosts 1024 --hosts-per-leaf 32 --leaves-per-pod 8 --jobs 4000
    nbtrain simulate --trace jobs.csv --plot report.html
    nbtrain simulate --hosts 1024 --hosts-per-leaf 32 --leaves-per-pod 8 --policies nbtrain \
        --jobs 100000 --stream jobs.jsonl --profile
    nbtrain simulate --policy nbtrain,goodput --load 1.4  # elastic jobs sized by goodput

A replay longer than ``--progress`` seconds (default 5) prints a progress line to stderr that
often: jobs done, simulated time, decisions per second.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import sys
from collections.abc import Mapping
from typing import IO

from nbtrain.core.topology import Topology
from nbtrain.sim.compare import ALL_POLICIES, format_table, run_policies
from nbtrain.sim.ledger import SimResult
from nbtrain.sim.profile import format_phases, phase_times
from nbtrain.sim.progress import JobEnd, Progress
from nbtrain.sim.speedups import with_speedups
from nbtrain.sim.trace import generate, load_csv, save_csv

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nbtrain simulate",
        description="Replay a cluster trace through nbtrain's gang scheduler and baselines.",
    )
    g = p.add_argument_group("cluster")
    g.add_argument("--hosts", type=int, default=64, help="hosts (default 64)")
    g.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host (default 8)")
    g.add_argument("--hosts-per-leaf", type=int, default=8, help="hosts per leaf switch")
    g.add_argument("--leaves-per-pod", type=int, default=4, help="leaf switches per pod")
    g.add_argument("--nvlink-gpus", type=int, default=None,
                   help="GPUs per NVLink group inside a host (default: the whole host)")
    g.add_argument("--nvlink-hosts", type=int, default=1,
                   help="hosts per multi-host NVLink domain (NVL72: 18 with 4 GPUs each)")
    t = p.add_argument_group("trace")
    t.add_argument("--jobs", type=int, default=2000, help="jobs to generate (default 2000)")
    t.add_argument("--load", type=float, default=0.9, help="offered load (default 0.9)")
    t.add_argument("--seed", type=int, default=0, help="trace and scheduler seed")
    t.add_argument("--max-size", type=int, default=None,
                   help="largest job in GPUs (default: a quarter of the cluster, at most 1024)")
    t.add_argument("--sweep", type=float, default=1.0,
                   help="mean jobs per submission burst (default 1: Poisson arrivals)")
    t.add_argument("--elastic", type=float, default=None, metavar="F",
                   help="share of jobs that are elastic (default 0.15; with a speedup curve, "
                        "elastic from one replica to twice their size)")
    t.add_argument("--speedups", action="store_true",
                   help="give every job a speedup curve (nbtrain.sim.speedups); on by "
                        "itself when the goodput policy runs")
    t.add_argument("--trace", default=None, help="read jobs from this CSV instead")
    t.add_argument("--save-trace", default=None, help="write the generated trace to this CSV")
    t.add_argument("--no-slowdown", action="store_true",
                   help="placement does not change job speed (default: TP off NVLink and "
                        "needless network hops slow a job, see nbtrain.sim.ledger)")
    o = p.add_argument_group("output")
    o.add_argument("--policies", "--policy", default="nbtrain,fifo,first_fit,greedy",
                   help=f"comma-separated, from {','.join(ALL_POLICIES)}")
    o.add_argument("--plot", default=None, help="write Bokeh plots to this HTML file")
    o.add_argument("--json", action="store_true", help="end with one JSON line of metrics")
    o.add_argument("--progress", type=float, default=5.0, metavar="S",
                   help="on a long replay, a progress line on stderr every S seconds "
                        "(default 5; 0 turns it off)")
    o.add_argument("--stream", default=None, metavar="FILE",
                   help="write one JSON line per job as it ends (finished or rejected), then "
                        "one per policy with its metrics; '-' for stdout")
    o.add_argument("--profile", action="store_true",
                   help="run each replay under cProfile and print where the scheduler's "
                        "decision time goes, by phase (the replay runs about 2x slower)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        topo = Topology.declare(
            args.hosts, args.gpus_per_host, hosts_per_leaf=args.hosts_per_leaf,
            leaves_per_pod=args.leaves_per_pod, nvlink_gpus=args.nvlink_gpus,
            nvlink_hosts=args.nvlink_hosts,
        )
        policies = [s.strip() for s in args.policies.split(",") if s.strip()]
        unknown = [s for s in policies if s not in ALL_POLICIES]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; choose from {list(ALL_POLICIES)}")
        if args.trace:
            trace = load_csv(args.trace)
            source = f"trace {args.trace}"
        else:
            max_size = args.max_size or min(1024, max(1, topo.n_slots // 4))
            trace = generate(args.jobs, topo.n_slots, load=args.load, seed=args.seed,
                             max_size=max_size, gpus_per_host=args.gpus_per_host,
                             sweep_mean=args.sweep)
            source = f"{len(trace)} generated jobs, load {args.load}, seed {args.seed}"
        if args.speedups or "goodput" in policies or args.elastic is not None:
            trace = with_speedups(trace, seed=args.seed, elastic_fraction=args.elastic,
                                  max_size=topo.n_slots)
            source += ", with speedup curves (nbtrain.sim.speedups)"
        if args.save_trace:
            save_csv(trace, args.save_trace)
        stream = _stream(args.stream)
    except (ValueError, OSError) as err:
        print(f"nbtrain simulate: {err}", file=sys.stderr)
        return 2
    print(f"cluster: {topo.describe()}")
    print(f"jobs: {source}")
    results: dict[str, SimResult] = {}
    profiles: dict[str, pstats.Stats] = {}
    with stream as out:

        def job_end(end: JobEnd) -> None:
            if out is not None:
                out.write(json.dumps(end.as_dict()) + "\n")

        def progress(p: Progress) -> None:
            print(p.line(), file=sys.stderr, flush=True)

        for name in policies:
            # greedy does not run nbtrain's scheduler: nothing to break down
            prof = cProfile.Profile() if args.profile and name != "greedy" else None
            if prof is not None:
                prof.enable()
            res = run_policies(topo, trace, [name], seed=args.seed,
                               exposed={} if args.no_slowdown else None,
                               progress=progress if args.progress > 0 else None,
                               progress_every_s=args.progress,
                               on_job_end=job_end if out is not None else None)[name]
            if prof is not None:
                prof.disable()
                profiles[name] = pstats.Stats(prof)
            results[name] = res
            if out is not None:
                out.write(json.dumps({"policy": name, "metrics": res.metrics,
                                      "schedule_hash": res.schedule_hash}, default=float) + "\n")
                out.flush()
    print(format_table(results))
    print("util: slot-time in complete gangs over the arrival window (first 20% = warm-up); "
          "goodput: the same at ideal speed (a poorly placed job is busy but slow); "
          "uplink: traffic leaving a leaf switch per slot-hour (relative units)")
    for name, stats in profiles.items():
        _print_profile(name, results[name], stats)
    if args.plot:
        path = _plot(results, topo.n_slots, args.plot)
        print(f"plots: {path}")
    if args.json:
        print(json.dumps({k: r.metrics | {"schedule_hash": r.schedule_hash}
                          for k, r in results.items()}, default=float))
    return 0


def _stream(path: str | None) -> contextlib.AbstractContextManager[IO[str] | None]:
    """Where ``--stream`` writes: nothing, stdout, or a file opened now (so a bad path is
    reported before the replay, not after)."""
    if path is None:
        return contextlib.nullcontext(None)
    if path == "-":
        return contextlib.nullcontext(sys.stdout)
    return open(path, "w")  # closed by the with block in main


def _print_profile(name: str, res: SimResult, stats: pstats.Stats) -> None:
    m = res.metrics
    print(f"\nprofile of {name}: {res.decision_ms.shape[0]:,} decisions, p50 "
          f"{m['decision_p50_ms']:.2f} ms, p99 {m['decision_p99_ms']:.2f} ms (profiled)")
    print(format_phases(phase_times(stats)))
    if res.work:
        n = max(1, res.work.get("events", 1))
        per = ", ".join(f"{k} {v / n:,.1f}" for k, v in res.work.items() if k != "events")
        print(f"work per decision: {per}")


def _plot(results: Mapping[str, SimResult], capacity: int, path: str) -> str:
    from nbtrain.sim.plots import save_report

    return str(save_report(results, capacity, path))
