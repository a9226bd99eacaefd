"""Command line: ``nbtrain demo``, ``nbtrain simulate``, ``nbtrain cluster``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="nbtrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a small model on an embedded local cluster", add_help=False)
    sub.add_parser("simulate", help="replay a cluster trace through the gang scheduler",
                   add_help=False)
    sub.add_parser("cluster", help="run a local Dask cluster with nbtrain's controller that "
                                   "outlives notebooks", add_help=False)
    args, rest = parser.parse_known_args(argv[:1])
    rest = argv[1:]
    if args.command == "demo":
        from nbtrain.demo import main as demo_main

        return demo_main(rest)
    if args.command == "cluster":
        from nbtrain.engine.standalone import main as cluster_main

        return cluster_main(rest)
    from nbtrain.sim.cli import main as sim_main

    return sim_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
