"""The embedded cluster behind ``connect()``: a LocalCluster whose slots survive restarts.

Two differences from a plain ``LocalCluster``:

- **Nannies are kept.** ``SpecCluster`` closes a worker's nanny for good when no worker of
  that name is back ``distributed.deploy.lost-worker-timeout`` (15 s) after *a* removal; a
  worker that nbtrain restarts twice within that time (a kill, then a hang restart) was lost
  with its slot (seen in the recovery tests and benchmark). nbtrain restarts workers on
  purpose and the nanny brings each one back, so this cluster never closes a nanny on removal;
  ``scale()`` and ``close()`` still end workers as usual.
- **Workers warm up.** A fresh worker process (a new cluster, or one a nanny replaced) spends
  about 3 s importing torch and, at the first optimizer, ``torch._dynamo``. A worker plugin
  does that in a background thread as soon as the worker starts, so a rank scheduled onto a
  replacement worker starts nearly as fast as on a warm one.
"""

from __future__ import annotations

import threading
from typing import Any

from distributed import LocalCluster, WorkerPlugin
from distributed.deploy.cluster import Cluster as _BaseCluster


class EmbeddedCluster(LocalCluster):
    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op == "remove":
            # Bookkeeping only; skip SpecCluster's timer that closes the lost worker's nanny.
            _BaseCluster._update_worker_status(self, op, msg)
        else:
            super()._update_worker_status(op, msg)


def _warm_up() -> None:
    import torch
    import torch.distributed
    import torch.nn.parallel

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param])
    param.grad = torch.zeros(1)
    opt.step()  # the first step imports torch._dynamo and friends


class WarmUp(WorkerPlugin):
    """Import what every rank needs, in the background, when a worker starts."""

    name = "nbtrain-warm-up"

    def setup(self, worker: Any) -> None:
        threading.Thread(target=_warm_up, name="nbtrain-warm-up", daemon=True).start()
