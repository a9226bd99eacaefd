"""Workers that leave on purpose, seen by the controller before they are gone.

Every planned departure of a Dask worker goes through the scheduler's ``retire_workers``:
a worker whose ``lifetime`` ends (dask-jobqueue's ``--lifetime``, set below the batch job's
walltime) calls it from ``Worker.close_gracefully``, and so does a worker that nbtrain's
worker plugin closes on SIGTERM; a cluster manager scaling down (``cluster.scale(n)``,
``adapt()``) and ``client.retire_workers`` call it too. Dask's own ``retire_workers`` only
waits for a worker's unique data to be copied elsewhere, not for the tasks it runs, and a
rank task holds no data, so on its own a retired worker's rank would simply be lost.

:func:`install` puts a wrapper in front of it (the ``retire_workers`` handler and the method,
like nbtrain's own handlers): for each worker a rank runs on, the controller is told the
worker is leaving (``WorkerLeaving``: the job is preempted, checkpoint first, and queued
again on other slots), and the retirement goes on once no rank runs there any more, or
after ``Settings.retire_wait_s``. Workers without ranks retire at once. The wrapper never
raises into Dask's handler: what it cannot resolve it passes on unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = ["Departures", "install", "memory_cause", "memory_high"]

#: How often the wrapper looks whether a leaving worker's ranks are out.
POLL_S = 0.05


class Departures(Protocol):
    """What the wrapper needs of the controller."""

    def worker_leaving(self, address: str, reason: str) -> None: ...

    def slot_busy(self, address: str) -> bool: ...


def install(ctl: Departures, scheduler: Any, *, wait_s: float) -> None:
    """Wrap the scheduler's ``retire_workers`` (once; a later controller replaces the
    controller the wrapper asks, not the wrapper)."""
    original = getattr(scheduler, "_nbtrain_retire_original", None)
    if original is None:
        original = scheduler.retire_workers
        scheduler._nbtrain_retire_original = original

    async def retire_workers(workers: Iterable[str] | None = None, **kwargs: Any) -> Any:
        try:
            chosen = _resolve(scheduler, workers, kwargs)
        except Exception:  # what Dask's own would choose: let it choose
            logger.exception("nbtrain: resolving the workers to retire failed")
            chosen = None
        if chosen is not None:
            await _release(ctl, scheduler, chosen, wait_s, kwargs.get("stimulus_id"))
            kwargs.pop("names", None)
            kwargs.pop("n", None)
            return await original(workers=chosen, **kwargs)
        return await original(workers=workers, **kwargs)

    scheduler.retire_workers = retire_workers
    scheduler.handlers["retire_workers"] = retire_workers


def _resolve(scheduler: Any, workers: Iterable[str] | None, kwargs: dict[str, Any]
             ) -> list[str] | None:
    """The addresses a ``retire_workers`` call names (None: let Dask choose, e.g. by
    ``n=``/``memory_ratio=`` through ``workers_to_close``)."""
    names = kwargs.get("names")
    if workers is not None:
        return [w for w in workers if w in scheduler.workers]
    if names is not None:
        wanted = {str(n) for n in names}
        return [a for a, ws in scheduler.workers.items() if str(ws.name) in wanted]
    return None


async def _release(ctl: Departures, scheduler: Any, addresses: list[str], wait_s: float,
                   stimulus_id: Any) -> None:
    reason = _reason(str(stimulus_id or ""))
    busy = [a for a in addresses if ctl.slot_busy(a)]
    for address in addresses:
        ctl.worker_leaving(address, reason)
    deadline = time.monotonic() + wait_s
    while busy and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        busy = [a for a in busy if a in scheduler.workers and ctl.slot_busy(a)]
    if busy:
        logger.warning("nbtrain: workers %s still run ranks after %.0f s (retire_wait_s); "
                       "retiring them anyway", busy, wait_s)


def _reason(stimulus_id: str) -> str:
    """Why a worker leaves, from the stimulus Dask names the retirement with."""
    if stimulus_id.startswith("worker-close-gracefully-sigterm"):
        return "its process got SIGTERM (a pod stopped, a batch job cancelled)"
    if stimulus_id.startswith("worker-close-gracefully"):
        return "the worker is closing: its lifetime (the batch job's walltime) ended"
    return "retired by its cluster manager or a client (retire_workers)"


def memory_cause(address: str, rss: Any, limit: Any, fraction: Any) -> str:
    """What a fault says when Dask's nanny killed a worker for its memory, with the fix."""
    def gib(n: Any) -> str:
        return f"{float(n) / 2**30:.2f} GiB" if isinstance(n, int | float) else "?"

    pct = f"{float(fraction) * 100:.0f}%" if isinstance(fraction, int | float) else "95%"
    return (f"Dask's nanny killed worker {address} for memory: its process used {gib(rss)}, "
            f"past {pct} of the worker's memory limit {gib(limit)}; give each worker more "
            "memory (connect(memory_limit=...), the cluster manager's memory=), run fewer "
            "workers per machine, or make the rank use less (a smaller batch or model)")




def memory_high(workers: Mapping[str, Any], share: float = 0.5) -> set[str]:
    """Workers whose last heartbeat reported process memory of at least ``share`` of their
    Dask memory limit: if one leaves, the nanny may be killing it for memory."""
    out = set()
    for address, ws in workers.items():
        limit = getattr(ws, "memory_limit", 0) or 0
        try:
            used = ws.memory.process
        except Exception:  # no heartbeat yet
            continue
        if limit and used >= share * limit:
            out.add(address)
    return out
