"""Workers that announce they will leave, and the queue a cluster manager is sized from.

A worker about to leave (its batch job's walltime through Dask's ``lifetime``, a pod's
SIGTERM, a ``retire_workers``) is not a failure: every job with a rank on it is preempted
through the checkpoint-first path (:func:`nbtrain.core.jobflow.leaving`: checkpoint at the
next step boundary, then queued again off that slot), and the machine takes the slot out of
the schedule so no new rank is placed there. The machine's shell holds the worker back until
its ranks are out (``nbtrain.engine.departures``).
"""

from __future__ import annotations

from collections.abc import Iterable

from nbtrain.core import jobflow
from nbtrain.core.job import JobState
from nbtrain.core.jobrecord import LiveJob
from nbtrain.core.outbox import Outbox

__all__ = ["leaving", "ranks_on", "waiting"]


def ranks_on(live: Iterable[LiveJob], slot: str) -> list[tuple[LiveJob, int]]:
    """``(job, rank)`` for every rank of a live generation still running on ``slot`` (one
    that exited or failed does not count)."""
    out = []
    for job in live:
        gen = job.gen
        if gen is None or slot not in gen.slots:
            continue
        rank = gen.slots.index(slot)
        if rank not in gen.outcomes and rank not in gen.failures:
            out.append((job, rank))
    return out


def leaving(live: Iterable[LiveJob], slot: str, reason: str, *, now: float, grace_s: float,
            out: Outbox) -> None:
    """``slot``'s worker is leaving: preempt each job running a rank there (the caller then
    takes the slot offline; the scheduler, told after the preemption began, leaves it to
    end)."""
    for job, rank in ranks_on(list(live), slot):
        jobflow.leaving(job, slot=slot, reason=reason, rank=rank, grace_s=grace_s, now=now,
                        out=out)


def waiting(queued: Iterable[tuple[str, JobState, str, int]], kind: str
            ) -> list[tuple[str, int]]:
    """``(job id, smallest gang)`` of the jobs that wait for slots of ``kind``, from
    ``(job id, state, device kind, smallest gang)`` in queue order; a job of kind "auto"
    (submitted before any slot existed) waits for whichever kind comes."""
    return [(job_id, need) for job_id, state, k, need in queued
            if state is JobState.QUEUED and k in (kind, "auto")]
