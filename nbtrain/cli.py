"""Command line: ``nbtrain demo``, ``nbtrain run``, ``nbtrain simulate``, ``nbtrain cluster``.

Also ``python -m nbtrain``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand -> (module whose ``main(argv) -> int`` runs it, help line).
COMMANDS = {
    "demo": ("nbtrain.demo", "train a small model on an embedded local cluster"),
    "run": ("nbtrain.run", "run a training function train(ctx, config) or a torchrun script"),
    "simulate": ("nbtrain.sim.cli", "replay a cluster trace through the gang scheduler"),
    "cluster": ("nbtrain.engine.standalone",
                "run a local Dask cluster with nbtrain's controller that outlives notebooks"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from nbtrain import __version__

    parser = argparse.ArgumentParser(prog="nbtrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"nbtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    args = parser.parse_args(argv[:1])
    module = importlib.import_module(COMMANDS[args.command][0])
    code: int = module.main(argv[1:])
    return code


if __name__ == "__main__":
    raise SystemExit(main())
