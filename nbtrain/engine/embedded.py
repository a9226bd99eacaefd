"""The embedded cluster behind ``connect()``: a LocalCluster whose slots survive restarts.

``SpecCluster`` closes a worker's nanny for good when no worker of that name is back
``distributed.deploy.lost-worker-timeout`` (15 s) after *a* removal; a worker that nbtrain
restarts twice within that time (a kill, then a hang restart) was lost with its slot (seen
in the recovery tests and benchmark). nbtrain restarts workers on purpose and the nanny
brings each one back, so this cluster never closes a nanny on removal; ``scale()`` and
``close()`` still end workers as usual.
"""

from __future__ import annotations

from typing import Any

from distributed import LocalCluster
from distributed.deploy.cluster import Cluster as _BaseCluster


class EmbeddedCluster(LocalCluster):
    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op == "remove":
            # Bookkeeping only; skip SpecCluster's timer that closes the lost worker's nanny.
            _BaseCluster._update_worker_status(self, op, msg)
        else:
            super()._update_worker_status(op, msg)
