"""What happens to one job: requests, launches, resizes, preemptions, a generation's end (pure).

The job machine (:mod:`nbtrain.core.lifecycle`) calls these with the job, the time and its
:class:`nbtrain.core.outbox.Outbox`; they change the job, write its events and state, and
return what the machine must do next, typed (:data:`Next`): end the job, launch its next
generation on a decided placement, admit it to the gang scheduler, or tell the scheduler an
event (``Suspend``, ``Resume``, ``Released``, ``Failed``). What needs the cluster (slots,
workers, the scheduler's decisions) stays with the machine. How a generation ended decides what
comes next, in this order: a stop request wins (CANCELLED, also while a preemption or a
straggler's replacement is in flight), then failures (recovery within the restart budget,
else FAILED), then preemptions (by the user: PREEMPTED until ``resume``; for a resize: the
next generation at the new size; by the scheduler or for a straggler's replacement: queued
again), then a halt on a non-finite metric (FAILED), then completion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbtrain.core.clusterevents import job_line_event
from nbtrain.core.explain import (
    checkpoint_rejected,
    fault_list,
    repeated_exception,
    restart_budget,
    resume_rejected,
)
from nbtrain.core.faults import Fault
from nbtrain.core.job import JobState, user_actions
from nbtrain.core.jobevents import preemption_event, resize_event, uncommitted_event
from nbtrain.core.jobrecord import CONTROLLER_RESTARTED, Generation, LiveJob, Preemption
from nbtrain.core.lifecycle_types import CarriedHistory, Deliver, Rejected
from nbtrain.core.machine_events import (
    CheckpointRequested,
    FaultInjectionRequested,
    PreemptRequested,
    ResumeRequested,
    StopRequested,
    StragglerTuningRequested,
    UserRequest,
)
from nbtrain.core.outbox import Outbox
from nbtrain.core.placement import Placement
from nbtrain.core.resizeplan import PendingResize
from nbtrain.core.sched_types import Failed, Released, Resume, Suspend
from nbtrain.core.straggler import StragglerSettings

__all__ = ["Admit", "EndJob", "Next", "Relaunch", "generation_ended", "generation_failed",
           "launched", "preempted_for", "refused_when_ended", "request", "resize_decided",
           "restore"]


@dataclass(frozen=True)
class EndJob:
    """End the job in ``state``; the scheduler hears ``Finished`` (the job ran its course)
    or ``Cancelled``."""

    state: JobState
    reason: str
    finished: bool = False


@dataclass(frozen=True)
class Relaunch:
    """Launch the job's next generation on ``placement`` (a resize the scheduler decided)."""

    placement: Placement


@dataclass(frozen=True)
class Admit:
    """Submit the job to the gang scheduler again (a restored held job that resumes)."""


#: What the machine does next for the job (None: nothing).
Next = EndJob | Relaunch | Admit | Suspend | Resume | Released | Failed | None


# ====================================================================== submission
def restore(job: LiveJob, carried: CarriedHistory, *, now: float, out: Outbox) -> None:
    """A job an earlier controller ran: its history continues, a fault records the restart
    (no restart-budget charge); a job its user was stopping ends CANCELLED; a held job stays
    PREEMPTED (``parked``: out of the gang
    scheduler until ``resume()``), any other waits for slots to resume from its newest
    committed checkpoint."""
    fault = job.restore(carried, now, out.wall)
    out.publish(job, {k: v for k, v in fault.items() if not k.startswith("_")})
    if carried.stopping:  # the user's stop stands: no new generation
        job.ledger.enter("ended", now)
        job.ended = out.wall
        out.set_state(job, JobState.CANCELLED,
                      f"stopped by user at step {job.committed_step}: the "
                      f"{CONTROLLER_RESTARTED} while it was stopping, so it ends at its newest "
                      "committed checkpoint")
        return
    if carried.held:
        job.parked = True
        job.ledger.enter("queued", now)
        out.set_state(job, JobState.PREEMPTED, f"preempted (restored after a "
                                               f"{CONTROLLER_RESTARTED}); resume() queues it "
                                               "again")
        return
    if carried.generation >= 0:
        job.recovering = CONTROLLER_RESTARTED
        job.queue_note = CONTROLLER_RESTARTED
        job.ledger.enter("recovery", now)
    job.reason = f"{CONTROLLER_RESTARTED}: waiting for slots"


# ====================================================================== generations
def launched(job: LiveJob, gen: Generation, placement: Placement, *, now: float, unit: str,
             out: Outbox) -> None:
    """``gen`` launches on ``placement`` (the machine sends the ``Launch``); ``unit``: what
    the job's slots are called, for its growth note."""
    size = gen.size
    if job.plan.launch(placement, now, job.recovering):
        # Rows of the new ranks may arrive before rank 0 says it started (which resets the
        # detector again, at the step it restored).
        for event in job.stragglers.restart(size, job.committed_step):
            out.publish(job, event)
    job.gen = gen
    job.plan.update_note(size, unit)
    job.generation = gen.number
    job.checkpoint_seq = 0
    job.queue_note = ""
    if job.started is None:
        job.started = out.wall
    resizing = job.plan.launched
    job.ledger.enter("recovery" if job.recovering or resizing else "startup", now)
    what = (f"recovering ({job.recovering})" if job.recovering else
            f"resized from {resizing.old_size} ranks" if resizing else "starting")
    if resizing is not None:
        out.publish(job, resize_event(out.wall, phase="started", old=resizing.old_size,
                                      new=size, reason=resizing.reason, generation=gen.number))
    out.set_state(job, JobState.STARTING, f"generation {gen.number}: {what}, {size} ranks")


def resize_decided(job: LiveJob, placement: Placement, reason: str, *, now: float,
                   grace_s: float, unit: str, out: Outbox) -> None:
    """The scheduler gave the running job a new placement (a resize it was asked for, growth
    into idle slots, a shrink for a waiting job): end the generation at the next step
    boundary, through the preemption path (checkpoint, commit), and start the next one
    there. A generation already failing or stopping ends by itself, and the job is then
    requeued (and restarted at the largest size that fits) or ended."""
    gen = job.gen
    new = placement.world_size
    if gen is None or gen.failing or job.stop_requested or (
            job.preempt is not None and job.preempt.cause != "resize"):
        return
    job.plan.decided = PendingResize(placement=placement, old_size=gen.size, reason=reason,
                                     asked=now)
    out.publish_cluster(job_line_event("resize", job.id,
                                       f"{job.name} resized {gen.size} -> {new} ranks: {reason}"))
    job.plan.update_note(gen.size, unit)
    out.publish(job, resize_event(out.wall, phase="requested", old=gen.size, new=new,
                                  reason=reason, generation=gen.number))
    if job.preempt is None:
        job.preempt = Preemption(cause="resize", reason=reason, deadline=now + grace_s)
        out.set_control(job, preempt=1)
    out.set_state(job, JobState.STOPPING, f"resizing from {gen.size} to {new} ranks ({reason}): "
                                          "checkpoint at the next step boundary")


def preempted_for(job: LiveJob, reason: str, *, for_job: str | None, grace_s: float,
                  now: float, out: Outbox, by: LiveJob | None = None) -> None:
    """The scheduler preempts the running job (for ``for_job``): it checkpoints at the next
    step boundary and releases its slots within ``grace_s``. A generation ending anyway (a
    lost worker, a failure, a stop or another preemption) is left to end; the scheduler
    hears about it when it has."""
    gen = job.gen
    if gen is None or gen.failing or job.preempt is not None or job.stop_requested:
        return
    job.preempt = Preemption(cause="scheduler", reason=reason, deadline=now + grace_s,
                             for_job=for_job)
    out.publish_cluster(job_line_event(
        "preemption", job.id, f"{job.name} preempted: {reason}", name=job.name, by=for_job,
        by_name=None if by is None else by.name, priority=job.spec.priority,
        by_priority=None if by is None else by.spec.priority))
    out.set_control(job, preempt=1)
    out.set_state(job, JobState.STOPPING, f"{reason}: checkpointing at the next step boundary, "
                                          f"then releasing its slots (grace {grace_s:.0f} s)")


def leaving(job: LiveJob, *, slot: str, reason: str, rank: int, grace_s: float, now: float,
            out: Outbox) -> None:
    """The worker of ``rank`` is about to leave (walltime, SIGTERM, retirement): the job
    checkpoints at the next step boundary and is queued again on other slots, as for a
    straggler's replacement; no committed step is lost. A generation ending anyway is left
    to end."""
    gen = job.gen
    if gen is None or gen.failing or job.preempt is not None or job.stop_requested:
        return
    why = f"the worker of rank {rank} is leaving ({reason})"
    job.preempt = Preemption(cause="leaving", reason=why, deadline=now + grace_s, slot=slot)
    out.publish_cluster(job_line_event("preemption", job.id, f"{job.name} preempted: {why}"))
    out.set_control(job, preempt=1)
    out.set_state(job, JobState.STOPPING, f"{why}: checkpointing at the next step boundary, "
                                          f"then queued again on other slots (grace "
                                          f"{grace_s:.0f} s)")


# ====================================================================== requests
def request(job: LiveJob, ev: UserRequest, *, now: float, grace_s: float, scheduled: bool,
            out: Outbox) -> Next:
    """A user's request other than a size (the machine asks the scheduler about that) or a
    knob change (:mod:`nbtrain.core.knobflow`'s): stop, preempt, resume, checkpoint, detector
    settings or a fault to inject. ``grace_s``: a preemption's time to checkpoint;
    ``scheduled``: the gang scheduler exists (a worker has joined)."""
    if isinstance(ev, StopRequested):
        return _stop(job, now, out)
    if isinstance(ev, PreemptRequested):
        return _preempt(job, now, grace_s, scheduled, out)
    if isinstance(ev, ResumeRequested):
        return _resume(job, now, scheduled, out)
    if isinstance(ev, CheckpointRequested):
        if job.spec.extra.get("kind") == "script":
            out.add(Rejected(job.id, checkpoint_rejected(job.name)))
        elif job.gen is not None:
            job.checkpoint_seq += 1
            out.set_control(job, checkpoint=job.checkpoint_seq)
    elif isinstance(ev, StragglerTuningRequested):
        _tune_stragglers(job, ev.changes, out)
    elif isinstance(ev, FaultInjectionRequested):
        _inject(job, ev.fault, out)
    else:
        raise TypeError(f"no request handler for {type(ev).__name__}")
    return None


def refused_when_ended(job: LiveJob, ev: UserRequest) -> str:
    """Why an ended job refuses ``ev`` ("" for requests with nothing to do, said nothing)."""
    if isinstance(ev, ResumeRequested):
        return resume_rejected(job.name, job.state)
    if isinstance(ev, FaultInjectionRequested):
        return inject_rejected(job, ev.fault.rank)
    return ""


def _tune_stragglers(job: LiveJob, changes: Mapping[str, Any], out: Outbox) -> None:
    known = {f.name for f in dataclasses.fields(StragglerSettings)}
    unknown = sorted(map(str, set(changes) - known))
    if unknown:
        out.add(Rejected(job.id, f"unknown straggler settings {unknown}; the settings "
                                 f"are {', '.join(sorted(known))}"))
        return
    try:  # settings a client sent: refused in words, never a failed job
        events = job.stragglers.update(**changes)
    except (TypeError, ValueError) as exc:
        out.add(Rejected(job.id, str(exc)))
        return
    for event in events:
        out.publish(job, event)


def _inject(job: LiveJob, fault: Fault, out: Outbox) -> None:
    refused = inject_rejected(job, fault.rank)
    if refused:
        out.add(Rejected(job.id, refused))
        return
    gen = job.gen
    job.planned.append(fault)
    if gen is not None:
        out.add(Deliver(job.id, gen.addresses[fault.rank], fault))


def _stop(job: LiveJob, now: float, out: Outbox) -> Next:
    if job.gen is not None:
        if not job.stop_requested:
            job.stop_deadline = now + job.sub.policy.stop_grace_s
        job.stop_requested = True
        out.set_control(job, stop=1)
        out.set_state(job, JobState.STOPPING, "stop requested: ending at the next step boundary")
        return None
    if job.state is JobState.PREEMPTED:
        return EndJob(JobState.CANCELLED, "stopped by user while preempted")
    return EndJob(JobState.CANCELLED, "stopped by user while queued")


def _preempt(job: LiveJob, now: float, grace_s: float, scheduled: bool, out: Outbox) -> Next:
    if job.gen is not None:
        if job.stop_requested:
            return None
        if job.preempt is None:
            out.set_control(job, preempt=1)
        job.preempt = Preemption(cause="user", reason="preempted by its user",
                                 deadline=now + grace_s)
        out.set_state(job, JobState.STOPPING, "preempting: checkpoint at the next step "
                                              "boundary, then release the slots")
    elif job.state is JobState.QUEUED and scheduled:
        job.ledger.enter("queued", now)
        out.set_state(job, JobState.PREEMPTED, "preempted while queued; resume() queues it "
                                               "again")
        return Suspend(now, job.id)
    return None


def _resume(job: LiveJob, now: float, scheduled: bool, out: Outbox) -> Next:
    if job.parked:
        job.parked = False
        job.queue_note = "resuming"
        out.set_state(job, JobState.QUEUED, "resuming: waiting for slots")
        return Admit()
    if not user_actions(job.state.value)["resume"]:
        out.add(Rejected(job.id, resume_rejected(job.name, job.state)))
    elif scheduled:
        job.queue_note = "resuming"
        out.set_state(job, JobState.QUEUED, "resuming: waiting for slots")
        return Resume(now, job.id)
    return None


def inject_rejected(job: LiveJob, rank: int) -> str:
    """Why a fault cannot go to ``rank`` ("" when it can): the ranks the job runs with now,
    else as many as it may have."""
    ranks = job.gen.size if job.gen is not None else job.spec.bounds[1]
    return "" if 0 <= rank < ranks else f"rank must be in 0..{ranks - 1}, got {rank}"


# ====================================================================== a generation ended
def generation_ended(job: LiveJob, gen: Generation, *, now: float, avoid: frozenset[str],
                     name_of: Callable[[str | None], str], out: Outbox) -> Next:
    """``gen`` (not failing) has no rank left running. ``avoid``: slots a requeued job
    should stay off; ``name_of``: a job's name from its id."""
    outcomes = {str(o.get("outcome")) for o in gen.outcomes.values()}
    step = max((int(o.get("step", 0)) for o in gen.outcomes.values()), default=job.step)
    if job.stop_requested:
        job.preempt = None
        return EndJob(JobState.CANCELLED, f"stopped by user at step {step}{_stop_forced(job, gen)}")
    if "preempted" in outcomes and job.preempt is not None:
        return _preempted(job, gen, step, now, avoid, name_of, out)
    if "halted" in outcomes:
        job.preempt = None
        last = (f"the newest committed checkpoint is step {job.committed_step} (resubmit "
                "with resume='latest' to continue from it)"
                if job.committed_step else "no checkpoint was committed before it")
        return EndJob(JobState.FAILED, f"halted at step {step}: {job.halt_reason}"
                                       f"{_stop_forced(job, gen, 'halt')}; {last}")
    if outcomes == {"completed"}:
        return EndJob(JobState.SUCCEEDED, f"completed {step} steps", finished=True)
    return EndJob(JobState.CANCELLED, f"stopped at step {step} (outcomes: {sorted(outcomes)})",
                  finished=True)


def _stop_forced(job: LiveJob, gen: Generation, what: str = "stop request") -> str:
    """What the reason of a stop (or a halt) adds when its grace ran out ("" when every
    rank ended); a halt's reason names the checkpoint itself."""
    if not gen.stop_forced:
        return ""
    ranks = ", ".join(str(r) for r in gen.stop_forced)
    forced = (f"; rank(s) {ranks} had not ended {job.sub.policy.stop_grace_s:g} s after the "
              f"{what} (stop_grace_s), so they were stopped and their workers restarted")
    if what != "stop request":
        return forced
    last = (f"the newest committed checkpoint is step {job.committed_step}"
            if job.committed_step else "no checkpoint was committed")
    return f"{forced}; {last}"


def _preempted(job: LiveJob, gen: Generation, step: int, now: float, avoid: frozenset[str],
               name_of: Callable[[str | None], str], out: Outbox) -> Next:
    pre = job.preempt
    assert pre is not None
    job.preempt = None
    lost = 0
    uncommitted = _uncommitted_checkpoint(gen)
    if gen.forced or uncommitted:
        # Back to the last committed checkpoint: only the steps after it are lost, and a
        # preemption's checkpoint that did not commit is no failure (no restart is charged).
        lost = job.ledger.rollback(job.committed_step)
        step = job.committed_step
    if uncommitted:
        out.publish(job, uncommitted_event(out.wall, cause=pre.cause, generation=gen.number,
                                           step=step, lost_steps=lost, error=uncommitted))
    if pre.cause != "resize":
        out.publish(job, preemption_event(
            out.wall, cause=pre.cause, reason=pre.reason, for_job=pre.for_job,
            generation=gen.number, step=step, forced=gen.forced, lost_steps=lost))
    pending = job.plan.decided
    if pre.cause == "resize" and pending is not None:
        job.plan.decided, job.plan.launched = None, pending
        return Relaunch(pending.placement)
    if pre.cause == "user":
        out.publish_cluster(job_line_event("preemption", job.id,
                                           f"{job.name} preempted by its owner at step {step}"))
        job.ledger.enter("queued", now)
        done = (f"released its slots; its checkpoint did not commit, so it resumes from step "
                f"{step}" if uncommitted else f"checkpointed at step {step} and released its slots")
        out.set_state(job, JobState.PREEMPTED, f"{done}; resume() to continue")
        return Suspend(now, job.id)
    if pre.cause == "leaving":
        job.queue_note = f"moved off a leaving worker at step {step}"
        job.ledger.enter("queued", now)
        out.set_state(job, JobState.QUEUED, f"{job.queue_note}: waiting for slots")
        gone = {pre.slot} if pre.slot else set()
        return Released(now, job.id, avoid=frozenset(gone | avoid))
    if pre.cause == "replace":
        job.recovering = f"replacing a straggler ({pre.reason})"
        job.queue_note = job.recovering
        job.ledger.enter("recovery", now)
        out.set_state(job, JobState.QUEUED, f"{job.recovering}: waiting for slots")
        slow = {pre.slot} if pre.slot else set()
        return Released(now, job.id, avoid=frozenset(slow | avoid))
    forced = (f" (forced: {lost} uncommitted steps lost)" if gen.forced
              else f" (its checkpoint did not commit: {lost} steps lost)" if uncommitted else "")
    job.queue_note = f"preempted for job {name_of(pre.for_job)} at step {step}{forced}"
    job.ledger.enter("queued", now)
    out.set_state(job, JobState.QUEUED, f"{job.queue_note}: waiting for slots")
    return Released(now, job.id, avoid=avoid)


def _uncommitted_checkpoint(gen: Generation) -> str:
    """Why the committer's final checkpoint of a preempted generation did not commit ("" if
    it did, or the job takes no checkpoints)."""
    summary = gen.outcomes.get(0, {})
    if (summary.get("checkpoint_committed") is not False or summary.get("forced")
            or summary.get("checkpoint_step") is None):
        return ""
    return str(summary.get("checkpoint_error") or "no commit")


def generation_failed(job: LiveJob, gen: Generation, fault: dict[str, Any], *, now: float,
                      avoid: frozenset[str], out: Outbox) -> Next:
    """``gen`` failed (``fault``: what ended it, see ``explain.describe_fault``): the job is
    restarted from its newest committed checkpoint off the failed slot, within its restart
    budget, else FAILED; a stop request ends it CANCELLED."""
    job.fault_log.append(fault)
    if fault["rank"] is not None:
        job.consume_faults(int(fault["rank"]), int(fault["step"]))
    out.publish(job, {k: v for k, v in fault.items() if not k.startswith("_")})
    job.error = fault["_report"]
    spec = job.spec
    if job.stop_requested:
        job.preempt = None
        return EndJob(JobState.CANCELLED,
                      f"stopped by user; a rank failed meanwhile: {fault['error']}")
    repeated = repeated_exception(job.fault_log) if spec.fail_fast else None
    if repeated is not None:
        job.preempt = None
        job.error = f"{repeated}; faults: {fault_list(job.fault_log)}\n\n{fault['_report']}"
        return EndJob(JobState.FAILED, repeated)
    recent = [t for t in job.restarts if now - t < spec.restart_window_s]
    if len(recent) >= spec.max_restarts:
        job.preempt = None
        budget = restart_budget(spec.max_restarts, spec.restart_window_s)
        job.error = f"{budget}; faults: {fault_list(job.fault_log)}\n\n{fault['_report']}"
        return EndJob(JobState.FAILED, f"{fault['what']} on rank {fault['rank']} at step "
                                       f"{fault['step']}: {fault['error']} ({budget})")
    return _recover(job, gen, fault, len(recent), now, avoid, out)


def _recover(job: LiveJob, gen: Generation, fault: dict[str, Any], recent: int, now: float,
             avoid: frozenset[str], out: Outbox) -> Next:
    """Restart a failed job from its newest committed checkpoint, off the failed slot."""
    job.restarts.append(now)
    resume_step = job.committed_step
    fault["lost_steps"] = job.ledger.rollback(resume_step)
    fault["resume_step"] = resume_step
    off = set(avoid)
    if fault["rank"] is not None:
        off.add(gen.slots[int(fault["rank"])])
    if job.preempt is not None and job.preempt.cause == "user":
        job.preempt = None
        job.ledger.enter("queued", now)
        out.set_state(job, JobState.PREEMPTED,
                      f"preempted; a rank failed while it checkpointed ({fault['what']}), so "
                      f"it resumes from step {resume_step}: resume() to continue")
        return Suspend(now, job.id)
    job.preempt = None
    job.recovering = (f"restart {recent + 1}/{job.spec.max_restarts} after {fault['what']} "
                      f"on rank {fault['rank']}")
    job.queue_note = job.recovering
    job.ledger.enter("recovery", now)
    out.set_state(job, JobState.QUEUED, f"{job.recovering}: waiting for slots")
    return Failed(now, job.id, requeue=True, avoid=frozenset(off))
