"""What nbtrain sets up on every Dask worker, embedded or not: quiet monitors, malloc tuned
for training, warm imports, and the worker's labels (host, NVLink domain, leaf switch).

``connect()`` registers :class:`NbtrainWorker` on any cluster (idempotently), so a cluster
started with ``dask scheduler`` and ``dask worker`` gets the same treatment as the embedded
one. The controller reads each joining worker's labels with :func:`worker_labels`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from distributed import WorkerPlugin
from distributed.diagnostics.plugin import NannyPlugin

from nbtrain.config import Settings

logger = logging.getLogger(__name__)

#: How long a rank waits for its worker's warm-up before it starts anyway (with a warning).
WARM_UP_WAIT_S = 300.0
#: The warm-up threads this process started (one per worker set up in it). A rank task
#: waits for them: two threads importing torch's modules at once can deadlock on Python's
#: import locks (seen under load: the warm-up importing ``torch._dynamo`` while a rank on a
#: just-restarted worker imported FSDP; Python broke the deadlock with an error, and the job
#: restarted once more).
_warm_ups: list[threading.Thread] = []

__all__ = ["SLOT_ABOUT", "NbtrainNanny", "NbtrainWorker", "worker_labels"]

#: What the views show of a worker's labels besides its place (host, NVLink domain, leaf,
#: GPU): they travel into the machine's slot records with the worker's join.
SLOT_ABOUT = ("pci_bus_id", "gpu_name", "nvlink_source", "gpu_note")
#: The stimulus a SIGTERM's retirement carries (``nbtrain.engine.departures`` reads it).
SIGTERM_STIMULUS = "worker-close-gracefully-sigterm"

#: Period of Dask's statistical profiler on quiet workers: a day, i.e. off (default 10 ms).
QUIET_PROFILE_MS = 86_400_000
#: Period of Dask's system monitor on quiet workers (Dask's default is 0.5 s).
QUIET_MONITOR_MS = 2000
#: Period of Dask's memory monitor on quiet workers (Dask's default is 0.1 s).
QUIET_MEMORY_MONITOR_MS = 1000
#: Period of Dask's event-loop tick on quiet workers (Dask's default is 20 ms). The tick only
#: measures how late the loop runs (a log line past ``distributed.admin.tick.limit``, 3 s);
#: at 20 ms it wakes the worker's loop thread 50 times a second, and in a rank's process
#: every wake-up asks the training thread for the GIL.
QUIET_TICK_MS = 1000
#: glibc malloc on quiet workers: blocks up to this size come from the heap and are reused
#: (glibc's own dynamic threshold grows to this too, unless MALLOC_TRIM_THRESHOLD_ is set)...
MALLOC_MMAP_THRESHOLD = 32 << 20
#: ... and free memory above this at the top of the heap goes back to the system.
MALLOC_TRIM_THRESHOLD = 64 << 20
#: Whether this process's malloc was tuned by :func:`tune_malloc` (read by tests).
malloc_tuned = False


def worker_labels() -> dict[str, str]:
    """Runs on a worker: its declared labels (``NBTRAIN_WORKER_HOST`` etc., or the Dask config
    keys ``nbtrain.worker-host``...), the nbtrain version it has, and on a GPU worker its GPU
    and discovered NVLink domain (``nbtrain.core.gpu_topology.worker_gpu_labels``; a declared
    ``NBTRAIN_WORKER_NVLINK`` wins)."""
    import nbtrain

    s = Settings.load()
    labels = {"host": s.worker_host, "nvlink": s.worker_nvlink, "leaf": s.worker_leaf,
              "nbtrain": nbtrain.__version__}
    from nbtrain.engine.gpus import gpu_labels, nvidia_driver_present

    if nvidia_driver_present():
        labels.update(gpu_labels(s))
    return labels


def _warm_up() -> None:
    import torch
    import torch.distributed
    import torch.nn.parallel

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param])
    param.grad = torch.zeros(1)
    opt.step()  # the first step imports torch._dynamo and friends


class NbtrainWorker(WorkerPlugin):
    """Quiet Dask's own background work, give PyTorch a malloc that reuses memory
    (:func:`tune_malloc`), and import torch in the background.

    On two cores Dask's statistical profiler (every 10 ms) and its monitors compete with the
    ranks for CPU (measured: ~0.89 of torchrun's step rate with the defaults, ~0.97 quiet).
    A fresh worker spends about 3 s importing torch and, at the first optimizer step,
    ``torch._dynamo``; doing that as soon as it starts makes a rank scheduled onto a
    replacement worker start nearly as fast as on a warm one.
    """

    name = "nbtrain-worker"
    idempotent = True

    def __init__(self, quiet: bool = True, warm_up: bool = True,
                 sessions: bool = True) -> None:
        self.quiet = quiet
        self.warm_up = warm_up
        self.sessions = sessions

    def setup(self, worker: Any) -> None:
        # A plugin pickled by an older nbtrain has no ``sessions``: the default then.
        if getattr(self, "sessions", True) and _spawned_by_nanny(worker):
            own_session()
        if self.quiet:
            quiet(worker)
            tune_malloc()
        if self.warm_up:
            thread = threading.Thread(target=_try_warm_up, name="nbtrain-warm-up", daemon=True)
            _warm_ups.append(thread)
            thread.start()
        if getattr(worker, "nanny", None) is None:  # ``dask worker --no-nanny`` (a pod's)
            _on_sigterm(lambda: worker.close_gracefully(reason="SIGTERM"))


class NbtrainNanny(NannyPlugin):
    """A ``dask worker`` process that gets SIGTERM (a pod being stopped, ``scancel``)
    retires its worker through the scheduler instead of killing it, so a rank there
    checkpoints and its job moves to other slots first (``nbtrain.engine.departures``);
    a second SIGTERM is Dask's own (the process ends at once). Only Dask's own CLI
    handler is replaced: a nanny inside a notebook's process (``LocalCluster``) is left
    alone. Keep the pod's ``terminationGracePeriodSeconds`` above ``retire_wait_s``."""

    name = "nbtrain-nanny"
    idempotent = True

    def setup(self, nanny: Any) -> None:
        async def retire() -> None:
            nanny.close_gracefully(reason="SIGTERM")  # no restart of the worker
            await nanny.scheduler.retire_workers(
                workers=[nanny.worker_address], close_workers=True, remove=True,
                stimulus_id=SIGTERM_STIMULUS)

        _on_sigterm(retire)


def _on_sigterm(close: Any) -> bool:
    """Replace the Dask CLI's SIGTERM handler in this process with one that runs
    ``close()`` (a coroutine function) on the running loop; returns whether it did."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "__module__", "") != "distributed._signals":
        return False
    loop = asyncio.get_running_loop()

    def handle(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, previous)  # a second SIGTERM is Dask's own
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(close()))

    signal.signal(signal.SIGTERM, handle)
    return True


def quiet(worker: Any) -> None:
    """Slow Dask's profiler, monitors and event-loop tick down on ``worker``.

    A worker that joins after the plugin was registered sets plugins up *before* it starts
    its periodic callbacks, so stopping them here would be undone; changing their period is
    not (tornado reads it when it schedules each next call).
    """
    callbacks = getattr(worker, "periodic_callbacks", {})
    for name, ms in (("profile", QUIET_PROFILE_MS), ("profile-cycle", QUIET_PROFILE_MS),
                     ("monitor", QUIET_MONITOR_MS), ("tick", QUIET_TICK_MS),
                     ("memory_monitor", QUIET_MEMORY_MONITOR_MS)):
        pc = callbacks.get(name)
        if pc is not None and pc.callback_time < ms:
            pc.callback_time = ms


def _spawned_by_nanny(worker: Any) -> bool:
    """Whether ``worker`` runs in a process its nanny started (Dask's nannies start workers
    with ``multiprocessing``): not a ``--no-nanny`` worker, and not a test calling ``setup``
    in its own process."""
    import multiprocessing

    return (isinstance(getattr(worker, "nanny", None), str)
            and multiprocessing.parent_process() is not None)


def own_session() -> bool:
    """Move this process into a new session and process group (POSIX ``setsid``); returns
    whether it did. Called in a worker process that has a nanny, so that:

    - a signal sent to the group it was started in does not reach it. Jupyter interrupts a
      kernel by sending SIGINT to the kernel's process group, which holds the embedded
      cluster's workers (the kernel spawned them): each worker's event loop then raised
      ``KeyboardInterrupt`` and ended, and its nanny did not start it again, so an interrupted
      cell left the cluster with no workers and its jobs without ranks. The nanny, in the
      kernel's process, still stops and restarts its worker, and a worker still exits at
      once when its nanny's process dies (Dask watches a pipe from its parent);
    - Linux's autogroup scheduler (``kernel.sched_autogroup_enabled``, on by default) shares
      the cores out between sessions first, then between the threads of each. In the
      notebook's session the ranks' threads were weighed together with the embedded
      scheduler's and the notebook's; outside it they get the cores as a ``torchrun``
      launch's ranks do (a launch started from a notebook or a benchmark is a session of its
      own; its ranks share that one session, while each worker here has its own).
      Measured on a 2-core machine, an HF ``Trainer`` as two plain Dask tasks against the
      same under torchrun, in turns: 0.95, 0.93 and 0.95 of torchrun's step rate in the
      notebook's session, 0.99, 1.02 and 0.95 in their own.

    A process that already leads a process group (one started by a shell, or one this
    already moved) is left as it is. A worker that a cell interrupts before nbtrain's worker
    plugin is set up on it (while ``connect()`` starts the cluster) still gets the signal.
    """
    if not hasattr(os, "setsid"):
        return False
    try:
        if os.getpgid(0) == os.getpid():
            return False
        os.setsid()
    except OSError:
        return False
    return True


def tune_malloc() -> bool:
    """Undo what Dask's ``MALLOC_TRIM_THRESHOLD_=65536`` does to training (glibc only;
    returns whether it did).

    Dask's nanny starts workers with that variable (to return freed memory to the system
    sooner), and setting it also turns off glibc's dynamic mmap threshold: every block over
    128 KB is then a fresh ``mmap`` whose pages fault in zeroed, and PyTorch's CPU allocator
    asks for such blocks many times a step (activations, gradients, optimizer temporaries).
    Measured on a 2-core machine: one process's training step of a 512-wide 3-layer MLP
    (batch 128, one thread) took 11.1-12.1 ms of CPU with the variable, 6.6-7.4 ms without
    it and 6.4-7.8 ms with it and this tuning; a 2-rank job on a busy machine ran 2.7x and
    3.5x as many steps per second tuned. The thresholds are set to where glibc's dynamic
    threshold settles (32 MB, trim at 64 MB), so blocks up to 32 MB are reused from the heap;
    a worker may keep up to 64 MB of freed memory that Dask's setting would give back.
    """
    global malloc_tuned
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    malloc_tuned = bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)
                        and mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))
    return malloc_tuned


def _try_warm_up() -> None:
    try:
        _warm_up()
    except Exception:  # a worker without torch cannot run ranks; the controller says so
        logger.warning("nbtrain: warming up torch failed on this worker", exc_info=True)


def wait_for_warm_up(timeout: float = WARM_UP_WAIT_S) -> bool:
    """Block until this worker's warm-up imports are done (at once where none runs); False
    if ``timeout`` passed first (then the caller goes on, and a warning says so)."""
    deadline = time.monotonic() + timeout
    for thread in list(_warm_ups):
        thread.join(max(0.0, deadline - time.monotonic()))
    if not any(thread.is_alive() for thread in _warm_ups):
        return True
    logger.warning("nbtrain: this worker's torch warm-up still runs after %.0f s; the rank "
                   "starts anyway", timeout)
    return False
