"""Build the API reference (HTML, from the docstrings) into ``docs/api`` or a given folder.

    python docs/build_api.py [OUTPUT_DIR]

The public API is what ``nbtrain`` exports (``nbtrain.__all__``) plus the modules users
reach into: the recipe and context, settings, checkpoints, the cluster and job handles,
trackers, and the pure scheduler for simulations.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pdoc

MODULES = [
    "nbtrain",
    "nbtrain.config",
    "nbtrain.checkpoints",
    "nbtrain.engine.cluster",
    "nbtrain.engine.job",
    "nbtrain.engine.standalone",
    "nbtrain.engine.trackers",
    "nbtrain.runtime.context",
    "nbtrain.runtime.recipe",
    "nbtrain.core.faults",
    "nbtrain.core.scheduler",
    "nbtrain.core.sched_types",
    "nbtrain.core.topology",
    "nbtrain.run",
]


def build(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    pdoc.pdoc(*MODULES, output_directory=out)
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "api"
    print(build(target))
