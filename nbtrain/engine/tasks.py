"""The function Dask runs for each rank (torch-free to import).

The controller submits this function from the Dask scheduler's process, which must not import
torch; the worker imports the rank runtime when the task starts, after its warm-up thread has
imported torch (``nbtrain.engine.workers.wait_for_warm_up``: two threads importing torch's
modules at once can deadlock).
"""

from __future__ import annotations

from typing import Any

from nbtrain.runtime.launch import RankLaunch

__all__ = ["run_rank_task"]


def run_rank_task(launch: RankLaunch) -> dict[str, Any]:
    from nbtrain.engine.workers import wait_for_warm_up

    wait_for_warm_up()
    from nbtrain.runtime.loop import run_rank

    return run_rank(launch)
