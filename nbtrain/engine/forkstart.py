"""How CPU worker processes start: Dask's spawn, or (opt-in) forked from one that imported torch.

Dask's nannies start each worker with ``spawn``: a fresh interpreter that imports torch, Dask
and nbtrain's runtime again. That costs every worker about 170 MB of private memory (the
modules' Python objects; the shared libraries are shared anyway) and seconds of CPU at each
start and restart. On a Binder-sized box (2 CPUs, ~2 GB for everything) four workers' copies
are a third of the memory. Forked from a forkserver that imported them once, the workers
share those pages copy-on-write, and a restarted worker is up in a fraction of the time.

The forkserver is a fresh process of its own (not a fork of the notebook's kernel, whose
threads and locks a fork would copy), started at the first worker's start, after the nanny
put its pre-spawn environment (``OMP_NUM_THREADS``, ``PYTHONHASHSEED``) in place, so the
workers see what spawned ones would. Dask reads the start method each time a nanny (re)starts
a worker, so the setting stays in this process's Dask config, as the daemon setting does.

It is opt-in (``NBTRAIN_WORKER_START=fork``), not the default: in one CI run of the whole
suite a worker forked this way, restarted after a kill under an FSDP job, died of SIGSEGV two
seconds after it started; the cause is not known (preloading torch's distributed and FSDP
modules in the forkserver is the first suspect). Only CPU clusters use it: a GPU worker's
``CUDA_VISIBLE_DEVICES`` must be in place before torch touches CUDA, which a shared
preloaded torch makes a matter of import order. ``benchmarks/worker_start.py`` compares it
with spawn.
"""

from __future__ import annotations

import multiprocessing
import os

import dask.config

__all__ = ["PRELOAD", "fork_workers"]

#: Imported once in the forkserver, shared by every worker it forks.
PRELOAD = ("distributed", "numpy", "torch", "nbtrain.runtime.launch")


def fork_workers() -> bool:
    """With ``NBTRAIN_WORKER_START=fork``, make this process's Dask nannies fork their workers
    from a preloaded forkserver and return True; else (the default, or no forkserver on this
    platform) they spawn them, as Dask does, and False."""
    if (os.environ.get("NBTRAIN_WORKER_START", "spawn") != "fork"
            or "forkserver" not in multiprocessing.get_all_start_methods()):
        return False  # Dask's own setting stands (spawn unless configured otherwise)
    from distributed.utils import get_mp_context

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    # Dask sets its own preload list on first use, once; ours (a superset) replaces it. It
    # takes effect if this process's forkserver has not started yet, else the running one
    # (preloading Dask's list) is used as it is.
    get_mp_context()
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return True


def dask_setup(nanny: object) -> None:
    """``dask worker --preload-nanny nbtrain.engine.forkstart``: the nannies of a standalone
    cluster's ``dask worker`` fork their workers the same way (before the first starts)."""
    fork_workers()
