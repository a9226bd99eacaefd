"""NCCL in a rank: error handling that keeps the process warm, and the abort that frees peers.

A rank blocked in an NCCL collective whose peer died does not notice by itself: the kernel
waits for data that never comes, until the collective timeout. Restarting the worker (what
gloo needs, see ARCHITECTURE.md) would free it, but throws away the process, its CUDA context
and its warm caches. NCCL has the better tool: aborting a communicator makes every collective
on it fail at once, from any thread. So:

- the rank that fails aborts its own process group (a plain destroy may wait on collectives
  that will never finish);
- the controller aborts the process groups of the failed generation's other ranks
  (:func:`abort_generation`, run on their workers), and those ranks raise, report a peer
  failure and return; their workers stay up for the next generation;
- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only) makes torch's watchdog abort a
  communicator whose collective exceeded its timeout and raise in the rank, instead of
  killing the process (torch's default, 3). A value the user set is kept.

This module must not import torch at import time: the controller (in the Dask scheduler,
which never imports torch) names :func:`abort_generation` to run it on workers.
"""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["abort_generation", "abort_process_group", "bind", "configure_env", "was_aborted"]

#: torch's ErrorHandlingMode CleanUpOnly: abort the communicator on error or timeout, raise in
#: the waiting thread, leave the process alone.
ASYNC_ERROR_HANDLING_CLEAN_UP_ONLY = "2"

_lock = threading.Lock()
_current: tuple[str, int] | None = None  # (job, generation) of this process's group
_aborted: set[tuple[str, int]] = set()


def configure_env() -> None:
    """Before an NCCL process group is made: error handling that keeps the process."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", ASYNC_ERROR_HANDLING_CLEAN_UP_ONLY)


def bind(job_id: str, generation: int | None) -> None:
    """Record which generation's process group this process holds (None: none)."""
    global _current
    with _lock:
        _current = None if generation is None else (job_id, generation)


def was_aborted(job_id: str, generation: int) -> bool:
    """Whether the controller aborted this generation's process group here (a rank's failure
    after that is its peer's consequence, not a cause)."""
    with _lock:
        return (job_id, generation) in _aborted


def abort_generation(job_id: str, generation: int) -> str:
    """Runs on a worker (``client.run``): abort the process group of ``generation`` of
    ``job_id`` if this process holds it. Returns at once; the abort runs on a thread, so
    the worker's event loop is not held while NCCL tears its communicators down."""
    with _lock:
        if _current != (job_id, generation):
            return f"no process group of job {job_id} generation {generation} here"
        _aborted.add((job_id, generation))
    threading.Thread(target=abort_process_group, name="nbtrain-nccl-abort", daemon=True).start()
    return "aborting"


def abort_process_group() -> None:
    """End this process's default process group now: NCCL groups are aborted (collectives in
    flight fail at once), others destroyed."""
    import torch.distributed as dist

    with _lock:
        if not dist.is_initialized():
            return
        backend = str(dist.get_backend())
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        with contextlib.suppress(Exception):
            if "nccl" in backend and abort is not None:
                abort()
            elif "nccl" in backend:
                dist.distributed_c10d._get_default_group().abort()
            if dist.is_initialized():
                dist.destroy_process_group()
