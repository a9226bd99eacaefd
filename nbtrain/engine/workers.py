"""What nbtrain sets up on every Dask worker, embedded or not: quiet monitors, warm imports,
and the worker's labels (host, NVLink domain, leaf switch).

``connect()`` registers :class:`NbtrainWorker` on any cluster (idempotently), so a cluster
started with ``dask scheduler`` and ``dask worker`` gets the same treatment as the embedded
one. The controller reads each joining worker's labels with :func:`worker_labels`.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from typing import Any

from distributed import WorkerPlugin

from nbtrain.config import Settings

logger = logging.getLogger(__name__)

__all__ = ["NbtrainWorker", "worker_labels"]

#: Period of Dask's statistical profiler on quiet workers: a day, i.e. off (default 10 ms).
QUIET_PROFILE_MS = 86_400_000
#: Period of Dask's system monitor on quiet workers (Dask's default is 0.5 s).
QUIET_MONITOR_MS = 2000
#: Period of Dask's memory monitor on quiet workers (Dask's default is 0.1 s).
QUIET_MEMORY_MONITOR_MS = 1000


def worker_labels() -> dict[str, str]:
    """Runs on a worker: its declared labels (``NBTRAIN_WORKER_HOST`` etc., or the Dask config
    keys ``nbtrain.worker-host``...), the nbtrain version it has, and on a GPU worker its GPU
    and discovered NVLink domain (``nbtrain.core.gpu_topology.worker_gpu_labels``; a declared
    ``NBTRAIN_WORKER_NVLINK`` wins)."""
    import nbtrain

    s = Settings.load()
    labels = {"host": s.worker_host, "nvlink": s.worker_nvlink, "leaf": s.worker_leaf,
              "nbtrain": nbtrain.__version__}
    if nvidia_driver_present():
        from nbtrain.engine.gpus import gpu_labels

        labels.update(gpu_labels(s))
    return labels


def nvidia_driver_present() -> bool:
    """Whether this machine may have NVIDIA GPUs at all: the driver's control device on Linux
    (present in GPU containers too), else an ``nvidia-smi`` on the PATH. Checked before
    anything else, so CPU workers pay nothing for GPU discovery: a worker's labels are read
    while it joins, when it is busy importing torch and every import competes for the GIL
    (measured: importing the discovery modules there delayed a join by ~0.3 s)."""
    if sys.platform.startswith("linux"):
        return os.path.exists("/dev/nvidiactl")
    return shutil.which("nvidia-smi") is not None


def _warm_up() -> None:
    import torch
    import torch.distributed
    import torch.nn.parallel

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param])
    param.grad = torch.zeros(1)
    opt.step()  # the first step imports torch._dynamo and friends


class NbtrainWorker(WorkerPlugin):
    """Quiet Dask's own background work, and import torch in the background.

    On two cores Dask's statistical profiler (every 10 ms) and its monitors compete with the
    ranks for CPU (measured: ~0.89 of torchrun's step rate with the defaults, ~0.97 quiet).
    A fresh worker spends about 3 s importing torch and, at the first optimizer step,
    ``torch._dynamo``; doing that as soon as it starts makes a rank scheduled onto a
    replacement worker start nearly as fast as on a warm one.
    """

    name = "nbtrain-worker"
    idempotent = True

    def __init__(self, quiet: bool = True, warm_up: bool = True) -> None:
        self.quiet = quiet
        self.warm_up = warm_up

    def setup(self, worker: Any) -> None:
        if self.quiet:
            quiet(worker)
        if self.warm_up:
            threading.Thread(target=_try_warm_up, name="nbtrain-warm-up", daemon=True).start()


def quiet(worker: Any) -> None:
    """Slow Dask's profiler and monitors down on ``worker``.

    A worker that joins after the plugin was registered sets plugins up *before* it starts
    its periodic callbacks, so stopping them here would be undone; changing their period is
    not (tornado reads it when it schedules each next call).
    """
    callbacks = getattr(worker, "periodic_callbacks", {})
    for name, ms in (("profile", QUIET_PROFILE_MS), ("profile-cycle", QUIET_PROFILE_MS),
                     ("monitor", QUIET_MONITOR_MS),
                     ("memory_monitor", QUIET_MEMORY_MONITOR_MS)):
        pc = callbacks.get(name)
        if pc is not None and pc.callback_time < ms:
            pc.callback_time = ms


def _try_warm_up() -> None:
    try:
        _warm_up()
    except Exception:  # a worker without torch cannot run ranks; the controller says so
        logger.warning("nbtrain: warming up torch failed on this worker", exc_info=True)
