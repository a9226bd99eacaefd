"""Start nbtrain's controller with the Dask scheduler: ``dask scheduler --preload
nbtrain.engine.preload``.

Then the controller runs with the scheduler process's settings (its ``NBTRAIN_*`` environment
and Dask config ``nbtrain.*``), e.g. the operator's token and the teams' fair-share weights,
rather than those of whichever client connects first. Clients' ``connect()`` finds it there.
"""

from __future__ import annotations

from typing import Any

from nbtrain.config import Settings
from nbtrain.engine import pages
from nbtrain.engine.controller import PLUGIN_NAME, ClusterController

# Imported while the scheduler starts, before its dashboard does: the pages join Dask's own
# dashboard applications (and so dask-labextension's list).
pages.install()


async def dask_setup(scheduler: Any) -> None:
    await scheduler.register_scheduler_plugin(ClusterController(Settings.load()),
                                              name=PLUGIN_NAME, idempotent=True)
