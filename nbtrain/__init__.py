"""nbtrain: run and steer distributed PyTorch training from a notebook, on Dask.

>>> cluster = nbtrain.connect()                       # embedded local cluster
>>> job = cluster.submit(MyRecipe(), world_size=2, steps=100)
>>> job.status, job.metrics, job.stop()

Names are imported on first use: the controller runs inside the Dask scheduler process, which
imports ``nbtrain.engine`` and must not pay for (or even have) torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbtrain.checkpoints import Checkpoint, export_checkpoint, load_checkpoint
    from nbtrain.config import Settings
    from nbtrain.core.faults import Fault
    from nbtrain.core.job import JobSpec, JobState
    from nbtrain.engine.cluster import Cluster, connect
    from nbtrain.engine.job import JobFailedError, JobHandle
    from nbtrain.engine.runrecord import RunRecord, load_run
    from nbtrain.engine.safeload import UntrustedResultError
    from nbtrain.runtime.context import RankContext
    from nbtrain.runtime.errors import RankFailure
    from nbtrain.runtime.recipe import Recipe

_WHERE = {
    "Checkpoint": "nbtrain.checkpoints",
    "Cluster": "nbtrain.engine.cluster",
    "Fault": "nbtrain.core.faults",
    "JobFailedError": "nbtrain.engine.job",
    "JobHandle": "nbtrain.engine.job",
    "JobSpec": "nbtrain.core.job",
    "JobState": "nbtrain.core.job",
    "RankContext": "nbtrain.runtime.context",
    "RankFailure": "nbtrain.runtime.errors",
    "Recipe": "nbtrain.runtime.recipe",
    "RunRecord": "nbtrain.engine.runrecord",
    "Settings": "nbtrain.config",
    "Tracker": "nbtrain.engine.trackers",
    "TrackerSpec": "nbtrain.engine.trackers",
    "UntrustedResultError": "nbtrain.engine.safeload",
    "connect": "nbtrain.engine.cluster",
    "export_checkpoint": "nbtrain.checkpoints",
    "load_checkpoint": "nbtrain.checkpoints",
    "load_run": "nbtrain.engine.runrecord",
}

__all__ = [
    "Checkpoint",
    "Cluster",
    "Fault",
    "JobFailedError",
    "JobHandle",
    "JobSpec",
    "JobState",
    "RankContext",
    "RankFailure",
    "Recipe",
    "RunRecord",
    "Settings",
    "Tracker",
    "TrackerSpec",
    "UntrustedResultError",
    "connect",
    "export_checkpoint",
    "load_checkpoint",
    "load_run",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbtrain``: the ``%nbtrain`` line magic (see :mod:`nbtrain.magics`)."""
    from nbtrain.magics import load_ipython_extension as load

    load(ipython)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'nbtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
