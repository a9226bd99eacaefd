"""``nbtrain simulate``: replay a generated or CSV trace under several policies, print a table.

Example::

    nbtrain simulate                                  # 64 hosts x 8 GPUs, 2,000 jobs, load 0.9
    nbtrain simulate --hosts 1024 --hosts-per-leaf 32 --leaves-per-pod 8 --jobs 4000
    nbtrain simulate --trace jobs.csv --plot report.html
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

from nbtrain.core.topology import Topology
from nbtrain.sim.compare import ALL_POLICIES, format_table, run_policies
from nbtrain.sim.ledger import SimResult
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
    t.add_argument("--trace", default=None, help="read jobs from this CSV instead")
    t.add_argument("--save-trace", default=None, help="write the generated trace to this CSV")
    t.add_argument("--no-slowdown", action="store_true",
                   help="placement does not change job speed (default: TP off NVLink and "
                        "needless network hops slow a job, see nbtrain.sim.ledger)")
    o = p.add_argument_group("output")
    o.add_argument("--policies", default="nbtrain,fifo,first_fit,greedy",
                   help=f"comma-separated, from {','.join(ALL_POLICIES)}")
    o.add_argument("--plot", default=None, help="write Bokeh plots to this HTML file")
    o.add_argument("--json", action="store_true", help="end with one JSON line of metrics")
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
        if args.save_trace:
            save_csv(trace, args.save_trace)
    except (ValueError, OSError) as err:
        print(f"nbtrain simulate: {err}", file=sys.stderr)
        return 2
    print(f"cluster: {topo.describe()}")
    print(f"jobs: {source}")
    results = run_policies(topo, trace, policies, seed=args.seed,
                           exposed={} if args.no_slowdown else None)
    print(format_table(results))
    print("util: slot-time in complete gangs over the arrival window (first 20% = warm-up); "
          "goodput: the same at ideal speed (a poorly placed job is busy but slow); "
          "uplink: traffic leaving a leaf switch per slot-hour (relative units)")
    if args.plot:
        path = _plot(results, topo.n_slots, args.plot)
        print(f"plots: {path}")
    if args.json:
        print(json.dumps({k: r.metrics | {"schedule_hash": r.schedule_hash}
                          for k, r in results.items()}, default=float))
    return 0


def _plot(results: Mapping[str, SimResult], capacity: int, path: str) -> str:
    from nbtrain.sim.plots import save_report

    return str(save_report(results, capacity, path))
