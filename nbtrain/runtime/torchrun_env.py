"""Make a rank look like one that ``torchrun`` started, so code written for torchrun joins
nbtrain's process group instead of making its own.

Each nbtrain rank is one process with one device (a Dask worker; on a GPU worker
``CUDA_VISIBLE_DEVICES`` names only its GPU, so the device is always ``cuda:0``). The closest
torchrun launch is therefore ``torchrun --nnodes=N --nproc-per-node=1``: every rank is node
``RANK`` of ``WORLD_SIZE`` with ``LOCAL_RANK`` 0 and ``LOCAL_WORLD_SIZE`` 1. A library that
picks its device as ``cuda:LOCAL_RANK`` (accelerate, HF ``Trainer``, Lightning) then picks
the worker's own GPU. ``TORCHELASTIC_RUN_ID`` is the job's id, so
``torch.distributed.is_torchelastic_launched()`` is true, and
``TORCHELASTIC_RESTART_COUNT`` is the generation (torchrun counts every restart of the worker
group, membership changes included; nbtrain starts a new generation for each).

nbtrain has already initialised the default process group when user code runs. Libraries
check ``torch.distributed.is_initialized()`` and use it. A script that calls
``init_process_group()`` unconditionally (as torchrun scripts do) would get torch's "trying
to initialize the default process group twice"; while the rank runs,
``torch.distributed.init_process_group`` joins the existing group instead (arguments that
contradict it are refused with the values), and ``destroy_process_group()`` of the default
group is left to nbtrain, which destroys it when the rank ends.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

__all__ = ["as_torchrun", "torchrun_env"]


def torchrun_env(*, rank: int, world_size: int, master_addr: str, master_port: int,
                 generation: int, run_id: str) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` (``--nproc-per-node=1``)."""
    values: dict[str, int | str] = {
        "RANK": rank, "WORLD_SIZE": world_size,
        "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1,
        "GROUP_RANK": rank, "GROUP_WORLD_SIZE": world_size,
        "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world_size, "ROLE_NAME": "default",
        "NODE_RANK": rank,
        "MASTER_ADDR": master_addr, "MASTER_PORT": master_port,
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": generation,
        # The store behind MASTER_PORT is nbtrain's: nobody else may serve it.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    return {k: str(v) for k, v in values.items()}


@contextmanager
def as_torchrun(env: Mapping[str, str]) -> Iterator[None]:
    """Export ``env`` and let ``init_process_group`` join the initialised default group,
    for the duration of the block; everything is put back after it (the worker process
    outlives the rank and runs other jobs' ranks)."""
    saved = {k: os.environ.get(k) for k in env}
    original_init, original_destroy = dist.init_process_group, dist.destroy_process_group
    os.environ.update(env)
    dist.init_process_group = _joining(original_init)
    dist.destroy_process_group = _sparing(original_destroy)
    try:
        yield
    finally:
        dist.init_process_group = original_init
        dist.destroy_process_group = original_destroy
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _joining(original: Any) -> Any:
    def init_process_group(backend: str | None = None, init_method: str | None = None,
                           timeout: Any = None, world_size: int = -1, rank: int = -1,
                           *args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            original(backend, init_method, timeout, world_size, rank, *args, **kwargs)
            return
        have = dist.get_backend()
        wrong = []
        if world_size not in (-1, None) and int(world_size) != dist.get_world_size():
            wrong.append(f"world_size={world_size} (the job has {dist.get_world_size()})")
        if rank not in (-1, None) and int(rank) != dist.get_rank():
            wrong.append(f"rank={rank} (this rank is {dist.get_rank()})")
        if backend and have not in str(backend).lower():
            wrong.append(f"backend={backend!r} (nbtrain's group uses {have!r}: gloo on CPU "
                         "slots, nccl on GPU slots)")
        if wrong:
            raise ValueError(
                "init_process_group() inside an nbtrain rank joins the job's process group, "
                f"which nbtrain has already initialised; these arguments contradict it: "
                f"{', '.join(wrong)}. Drop them (the torchrun variables RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT are set), or submit with the size you meant.")

    return init_process_group


def _sparing(original: Any) -> Any:
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.GroupMember.WORLD:
            return  # nbtrain's: destroyed when the rank ends
        original(group)

    return destroy_process_group
