"""Why each queued job waits, in words: the reason every QUEUED job shows.

The head of each device kind's queue waits for slots (how many it needs at once against the
free, online, restarting and offline ones, and which jobs are still releasing slots for it);
every job behind it waits behind that head. The job machine (:mod:`nbtrain.core.lifecycle`)
asks for these after any event that may have changed the queue, and sets each job's reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from nbtrain.core.explain import queue_head_reason, unit
from nbtrain.core.job import JobState
from nbtrain.core.jobrecord import LiveJob
from nbtrain.core.pools import DevicePools
from nbtrain.core.slotbook import SlotBook

__all__ = ["queue_reasons", "slot_counts"]


def slot_counts(sched: DevicePools | None, book: SlotBook, kind: str) -> tuple[int, int]:
    """(slots ever seen, slots restarting) of ``kind``; counted by kind only where kinds mix,
    so a one-kind cluster pays what it paid before."""
    by_kind = sched is not None and sched.kinds() not in ([], [kind])
    return book.counts(kind, by_kind)


def queue_reasons(sched: DevicePools, jobs: Mapping[str, LiveJob], live: Iterable[LiveJob],
                  book: SlotBook) -> Iterator[tuple[LiveJob, str]]:
    """Each QUEUED job in queue order, with why it waits (its queue note first, if any).
    ``live``: the jobs holding slots (some may be releasing them for a head)."""
    holders = list(live)
    heads: dict[str, tuple[str, str]] = {}  # device kind -> (head's name, why)
    for job_id in sched.queued():
        job = jobs.get(job_id)
        if job is None or job.state is not JobState.QUEUED:
            continue
        kind = sched.kind_of(job_id)
        head_name, head_why = heads.get(kind, ("", ""))
        if not head_name:
            why = _head_reason(sched, book, job, kind, holders)
            heads[kind] = (job.name, why)
        else:
            why = f"waiting behind job {head_name} ({head_why})"
        yield job, (f"{job.queue_note}: {why}" if job.queue_note else why)


def _head_reason(sched: DevicePools, book: SlotBook, job: LiveJob, kind: str,
                 holders: list[LiveJob]) -> str:
    online = sched.online_of(kind)
    total, restarting = slot_counts(sched, book, kind)
    return queue_head_reason(
        need=job.spec.world_size, unit=unit(kind, sched.kinds()), free=sched.free_of(kind),
        online=online, restarting=restarting, offline=total - online - restarting,
        releasing=(j.name for j in holders
                   if j.preempt is not None and j.preempt.for_job == job.id))
