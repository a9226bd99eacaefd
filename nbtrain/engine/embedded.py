"""The embedded cluster behind ``connect()``: a LocalCluster whose slots survive restarts.

``SpecCluster`` closes a worker's nanny for good when no worker of that name is back
``distributed.deploy.lost-worker-timeout`` (15 s) after *a* removal; a worker that nbtrain
restarts twice within that time (a kill, then a hang restart) was lost with its slot (seen
in the recovery tests and benchmark). nbtrain restarts workers on purpose and the nanny
brings each one back, so this cluster never closes a nanny on removal; ``scale()`` and
``close()`` still end workers as usual.

With ``gpus`` (ids for ``CUDA_VISIBLE_DEVICES``: indices or UUIDs) there is one worker per
GPU, named by its GPU id, seeing only that GPU and holding a Dask resource ``GPU=1``; start
it with ``n_workers=0`` and ``scale(len(gpus))``, as dask-cuda's ``LocalCUDACluster`` does.

With ``per_host`` (CPU workers) the workers are declared hosts of that many slots each, in
the order they are added (``node0``, ``node1``, ...; each host one NVLink domain), through
the same labels a worker of a real cluster reads (``NBTRAIN_WORKER_HOST``): a topology on
one machine for teaching, without a scheduler and ``dask worker`` processes of its own.
Started the same way (``n_workers=0``, then ``scale``); a restarted worker keeps its host.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from distributed import LocalCluster
from distributed.deploy.cluster import Cluster as _BaseCluster


class EmbeddedCluster(LocalCluster):
    def __init__(self, *args: Any, gpus: Sequence[str] = (), per_host: int = 0,
                 **kwargs: Any) -> None:
        self.gpus = tuple(gpus)
        self.per_host = per_host
        super().__init__(*args, **kwargs)

    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op == "remove":
            # Bookkeeping only; skip SpecCluster's timer that closes the lost worker's nanny.
            _BaseCluster._update_worker_status(self, op, msg)
        else:
            super()._update_worker_status(op, msg)

    def new_worker_spec(self) -> dict[Any, Any]:
        if not self.gpus:
            specs = dict(super().new_worker_spec())
            if self.per_host:
                host = f"node{len(self.worker_spec) // self.per_host}"
                specs = {name: _with_env(spec, NBTRAIN_WORKER_HOST=host)
                         for name, spec in specs.items()}
            return specs
        free = [g for g in self.gpus if g not in self.worker_spec]
        if not free:
            raise ValueError(
                f"every GPU of this cluster ({', '.join(self.gpus)}) has its worker already: "
                "one worker per GPU; connect(gpus=False) starts CPU workers instead")
        gpu = free[0]
        # Indices are PCI bus order for NVML; make CUDA number the GPUs the same way.
        spec = _with_env(self.new_spec, CUDA_VISIBLE_DEVICES=gpu, CUDA_DEVICE_ORDER="PCI_BUS_ID")
        options = spec["options"]
        options["resources"] = {**(options.get("resources") or {}), "GPU": 1}
        return {gpu: spec}


def _with_env(spec: dict[str, Any], **env: str) -> dict[str, Any]:
    """A copy of a worker spec whose worker process also gets ``env``."""
    out = copy.deepcopy(spec)
    options = out.setdefault("options", {})
    options["env"] = {**(options.get("env") or {}), **env}
    return out
