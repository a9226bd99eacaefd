"""GPUs on this machine: one embedded worker per GPU, and a worker's GPU labels.

``connect()`` on a CUDA machine starts one worker process per visible GPU, each with
``CUDA_VISIBLE_DEVICES`` naming only its own GPU (so ``cuda:0`` in every rank is a different
device) and a Dask resource ``GPU=1``. Worker names are the GPU ids, so a worker restarted by
its nanny comes back on the same GPU and takes its slot back. This is what dask-cuda's
``LocalCUDACluster`` does for the device mapping; nbtrain keeps its own ``EmbeddedCluster``
because its nannies must survive nbtrain's restarts (see ``engine/embedded.py``).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Sequence

from nbtrain.config import Settings

__all__ = ["embedded_gpus", "gpu_labels", "local_gpus", "nvidia_driver_present",
           "parse_visible_devices"]


def nvidia_driver_present() -> bool:
    """Whether this machine may have NVIDIA GPUs at all: the driver's control device on Linux
    (present in GPU containers too), else an ``nvidia-smi`` on the PATH. Checked before
    anything else, so CPU workers pay nothing for GPU discovery: a worker's labels are read
    while it joins, when it is busy importing torch and every import competes for the GIL
    (measured: importing the discovery modules there delayed a join by ~0.3 s)."""
    if sys.platform.startswith("linux"):
        return os.path.exists("/dev/nvidiactl")
    return shutil.which("nvidia-smi") is not None


def parse_visible_devices(value: str) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: comma-separated ids, up to the first empty
    or invalid entry (``-1`` hides every later one)."""
    out: list[str] = []
    for part in value.split(","):
        entry = part.strip()
        if not entry or entry == "-1" or entry == "NoDevFiles":
            break
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        out.append(entry)
    return out


def local_gpus() -> list[str]:
    """The GPUs this process may hand to workers, one id each (an index or a UUID).

    The kernel's own ``CUDA_VISIBLE_DEVICES`` is respected (a user who limited the notebook
    to two GPUs gets two workers); otherwise every GPU NVML or ``nvidia-smi`` lists, by
    UUID. Empty on a machine without GPUs (or without the NVIDIA driver).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return parse_visible_devices(visible)
    if not nvidia_driver_present():
        return []
    from nbtrain.runtime.nvml import discover

    found = discover(socket.gethostname())
    return [] if found is None else [g.uuid for g in sorted(found.gpus, key=lambda g: g.index)]


def embedded_gpus(gpus: bool | Sequence[str] | None, n_workers: int | None) -> list[str]:
    """The GPU ids an embedded cluster gives its workers, one worker each (empty: CPU
    workers). ``gpus``: None (every local GPU, if any), True (the same, but there must be
    one), False (none) or the ids themselves; ``n_workers`` takes the first that many."""
    if gpus is False:
        return []
    if gpus is None or gpus is True:
        ids = local_gpus()
        if gpus is True and not ids:
            raise ValueError(
                "connect(gpus=True) found no GPU on this machine (no NVIDIA driver, or "
                "CUDA_VISIBLE_DEVICES hides them all); connect(gpus=False) starts CPU workers")
    else:
        ids = [str(g) for g in gpus]
        if len(set(ids)) != len(ids):
            raise ValueError(f"gpus={ids} names a GPU twice: one worker per GPU")
    if n_workers is not None and ids:
        if not 1 <= n_workers <= len(ids):
            raise ValueError(
                f"n_workers={n_workers} but this cluster has {len(ids)} GPU(s) ({', '.join(ids)})"
                ": one worker per GPU, so n_workers may be 1 to that; connect(gpus=False) "
                "starts CPU workers")
        ids = ids[:n_workers]
    return ids


def gpu_labels(settings: Settings) -> dict[str, str]:
    """Runs on a worker: the labels of the GPU it runs on (empty on a CPU worker)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible == "" or not nvidia_driver_present():
        return {}
    # Imported here: a CPU worker imports this module for nvidia_driver_present() alone.
    from nbtrain.core.gpu_topology import worker_gpu_labels
    from nbtrain.runtime.nvml import discover

    host = settings.worker_host or socket.gethostname()
    found = discover(host)
    if found is None:
        # An NVIDIA driver but neither nvidia-ml-py nor nvidia-smi: still a GPU slot (or its
        # ranks would train on the CPU), with the NVLink domain left to labels.
        return _labels_from_torch(settings.worker_nvlink)
    return worker_gpu_labels(found, visible, settings.worker_nvlink)


def _labels_from_torch(declared_nvlink: str) -> dict[str, str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        props = torch.cuda.get_device_properties(0)
    except Exception:
        return {}
    uuid = str(props.uuid)
    return {"gpu": uuid if uuid.startswith("GPU-") else f"GPU-{uuid}", "gpu_name": props.name,
            "nvlink": declared_nvlink,
            "nvlink_source": "declared" if declared_nvlink else
            "unknown: install nvidia-ml-py (pip install nbtrain[gpu]) or nvidia-smi"}
