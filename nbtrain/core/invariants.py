"""The job machine's invariants: what holds after every event it handles (pure).

:meth:`nbtrain.core.lifecycle.JobMachine.validate` hands its parts here; the machine's test
harness calls it after every event, as the scheduler's tests call ``check_invariants``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from nbtrain.core.job import JobState
from nbtrain.core.jobrecord import LiveJob

__all__ = ["machine_problems"]


def machine_problems(jobs: Mapping[str, LiveJob], live: Mapping[str, LiveJob],
                     pending: Iterable[str], owners: Mapping[Hashable, str | None] | None
                     ) -> list[str]:
    """Every broken invariant, one line each ([] when all hold). ``jobs``: every known job;
    ``live``: the jobs with a generation; ``pending``: jobs submitted before any worker
    joined; ``owners``: the gang scheduler's slot -> holder (None before it exists)."""
    problems: list[str] = []
    with_gen = {j.id for j in jobs.values() if j.gen is not None}
    if set(live) != with_gen or any(jobs.get(k) is not j for k, j in live.items()):
        problems.append(f"the live jobs {sorted(live)} are not the jobs with a generation "
                        f"{sorted(with_gen)}")
    for job in jobs.values():
        problems += _job_problems(job)
    problems += _pending_problems(jobs, list(pending), owners is not None)
    problems += _slot_problems(jobs, owners)
    return problems


def _job_problems(job: LiveJob) -> list[str]:
    """One job's state agrees with its generation and its deferred launch."""
    out = []
    state, gen, deferred = job.state, job.gen, job.plan.deferred
    if gen is not None and not state.holds_slots:
        out.append(f"job {job.id} is {state.value} with generation {gen.number} running")
    if gen is not None and (gen.number != job.generation or len(set(gen.slots)) != gen.size
                            or len(gen.addresses) != gen.size):
        out.append(f"job {job.id}'s generation {gen.number} disagrees with itself")
    if state in (JobState.RUNNING, JobState.STOPPING) and gen is None:
        out.append(f"job {job.id} is {state.value} without a generation")
    if state is JobState.RUNNING and gen is not None and not gen.running:
        out.append(f"job {job.id} is RUNNING before its generation's first step")
    if state is JobState.STARTING and gen is None and deferred is None:
        out.append(f"job {job.id} is STARTING with neither a generation nor a deferred launch")
    if deferred is not None and (gen is not None or state is not JobState.STARTING):
        out.append(f"job {job.id} has a deferred launch but is {state.value} "
                   f"({'with' if gen is not None else 'without'} a generation)")
    return out


def _pending_problems(jobs: Mapping[str, LiveJob], pending: list[str],
                      scheduled: bool) -> list[str]:
    """Jobs wait for the first worker only while there is none, queued."""
    if scheduled and pending:
        return [f"jobs {pending} wait for a first worker, but the scheduler exists"]
    return [f"job {k} waits for a first worker but is "
            f"{jobs[k].state.value if k in jobs else 'unknown'}"
            for k in pending if k not in jobs or jobs[k].state is not JobState.QUEUED]


def _slot_problems(jobs: Mapping[str, LiveJob],
                   owners: Mapping[Hashable, str | None] | None) -> list[str]:
    """A slot runs at most one rank; slots are held only by jobs that run or are about to."""
    out = []
    running: dict[str, str] = {}  # slot -> the job whose unfinished rank runs there
    for job in jobs.values():
        gen = job.gen
        if gen is None:
            continue
        for rank in gen.unfinished():
            slot = gen.slots[rank]
            if slot in running:
                out.append(f"slot {slot} runs ranks of jobs {running[slot]} and {job.id}")
            running[slot] = job.id
    for where, holder in (owners or {}).items():
        if holder is None:
            continue
        owner = jobs.get(holder)
        if owner is None or owner.state.terminal or (
                owner.gen is None and owner.plan.deferred is None):
            state = "unknown" if owner is None else owner.state.value
            out.append(f"slot {where} is held by job {holder}, which is {state} and neither "
                       "runs nor waits to launch")
    return out
