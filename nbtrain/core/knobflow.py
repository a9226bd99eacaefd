"""What happens to one job's live knobs in the job machine (pure).

A user's ``set`` request becomes a pending change (validated by the job's
:class:`~nbtrain.core.knobs.KnobBook`: declared knobs, bounds, bounded counts; an ended job
refuses) and reaches the current generation's ranks with the control flags; rank 0 reports
the knobs it declared (``knobs``) and the step every rank applied a change at
(``knob_applied``), which moves it into the history that restarts and replays apply again.
The controller's own knobs (the straggler detector's settings) are checked whole here and
judged with from the step after it (:mod:`nbtrain.core.stragglerwatch`).
"""

from __future__ import annotations

from nbtrain.core.jobevents import knob_set_event
from nbtrain.core.jobrecord import LiveJob
from nbtrain.core.knobs import KnobError
from nbtrain.core.lifecycle_types import Rejected
from nbtrain.core.machine_events import KnobChangeRequested, RankKnobApplied, RankKnobs
from nbtrain.core.outbox import Outbox

__all__ = ["applied", "declared", "request_set"]


def request_set(job: LiveJob, ev: KnobChangeRequested, out: Outbox) -> None:
    """``job.set(...)``: a pending change when the job's ``KnobBook`` takes it."""
    if job.state.terminal:
        out.add(Rejected(job.id, (
            f"job {job.name} has ended ({job.state.value}): its knobs can no longer change; "
            f"cluster.submit(..., replay=job) runs it again with the changes it had")))
        return
    problem = job.stragglers.knobs.problem(job.stragglers.detector.settings, job.knobs.pending,
                                           ev.values)
    if problem:
        out.add(Rejected(job.id, f"cannot set the knobs of job {job.name}: {problem}"))
        return
    try:
        change = job.knobs.request(ev.values, ramp=ev.ramp, shape=ev.shape, who=ev.who,
                                   wall=out.wall, job=f"job {job.name}")
    except KnobError as exc:
        out.add(Rejected(job.id, str(exc)))
        return
    out.publish(job, knob_set_event(out.wall, change.to_dict()))
    out.set_control(job)  # the pending changes reach the ranks (no generation: at launch)


def declared(job: LiveJob, ev: RankKnobs) -> None:
    """Rank 0's ``knobs``: its declarations (the caller passes the current generation's
    only)."""
    if ev.specs is not None:
        job.knobs.declare(list(ev.specs))


def applied(job: LiveJob, ev: RankKnobApplied, out: Outbox) -> None:
    """Rank 0's ``knob_applied`` (from any generation: its ranks did apply the change at
    that step, and a checkpoint taken after it holds it)."""
    if ev.step is None:
        return
    moved = job.knobs.applied(ev.changes, ev.step)
    if moved:
        out.set_control(job)  # no longer pending for the ranks
        # The controller's own knobs (straggler settings) judge the steps after it.
        for event in job.stragglers.follow(moved):
            out.publish(job, event)
