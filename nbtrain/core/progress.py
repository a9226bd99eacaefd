"""What a generation's ranks report, for their job (pure): step rows, checkpoints, startup.

The job machine (:mod:`nbtrain.core.lifecycle`) hands the current generation's rank
messages here. Step rows feed the watchdog (progress, the median step), the goodput ledger,
the straggler detector and the non-finite check (an alert, or with ``on_nonfinite="halt"`` a
stop without a checkpoint); the generation's first rows end a recovery or a resize and make
the job RUNNING. A straggler's replacement goes through the preemption path. Commands go to
the :class:`nbtrain.core.outbox.Outbox`; nothing here reads a clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

from nbtrain.core import knobflow
from nbtrain.core.job import JobState
from nbtrain.core.jobevents import nonfinite_event, recovery_event, resize_event
from nbtrain.core.jobrecord import Generation, LiveJob, Preemption
from nbtrain.core.machine_events import (
    RankCheckpoint,
    RankDevice,
    RankEvent,
    RankFaultInjected,
    RankGradNoise,
    RankKnobApplied,
    RankKnobs,
    RankPhase,
    RankStarted,
    RankSteps,
)
from nbtrain.core.mitigation import ActionKind, SlotInfo
from nbtrain.core.outbox import Outbox
from nbtrain.core.records import ROW_COLUMNS
from nbtrain.core.sched_types import StepTimes
from nbtrain.core.stragglerwatch import mitigation_event

__all__ = ["METRICS_AT", "WARMUP_STEPS", "After", "message", "mitigate", "step_times"]

#: Position of the metrics dict in a rank's step row.
METRICS_AT = len(ROW_COLUMNS)


class After(enum.Enum):
    """What the machine does after a rank message."""

    NOTHING = "nothing"
    COMMITTED = "committed"  # a newer checkpoint committed: tell the scheduler
    MITIGATE = "mitigate"  # rank 0's rows of a RUNNING job: the straggler policy decides


def message(job: LiveJob, ev: RankEvent, now: float, out: Outbox) -> After:
    """A message from one of the job's ranks; one of an ended generation only counts where
    it says what was committed or which knob changes were applied. Step rows, startup phases
    and GPU readings are too frequent for the job's log; every other kind is logged."""
    gen = job.gen if job.gen is not None and ev.generation == job.gen.number else None
    if isinstance(ev, RankSteps | RankPhase | RankDevice):
        return After.NOTHING if gen is None else _progress(job, gen, ev, now, out)
    if isinstance(ev, RankGradNoise):  # goes to the scheduler with the next step times
        if gen is not None and ev.rank == 0:
            job.noise_scale = ev.noise_scale
        return After.NOTHING
    out.publish(job, ev.logged())
    handler = _REPORTS.get(type(ev))
    return After.NOTHING if handler is None else handler(job, gen, ev, now, out)


#: Rank 0's first step rows of each generation that goodput sizing does not time: a
#: generation's first steps pay for warm-up (allocator, autograd graph, DDP buckets, a
#: restored checkpoint's pages), which would make the size it runs at look slower than it is.
WARMUP_STEPS = 2


def step_times(job: LiveJob, ev: RankEvent, now: float) -> StepTimes | None:
    """Rank 0's step rows of a goodput-sized job's current generation as the scheduler's
    ``StepTimes`` (their mean step, compute and all-reduce times at the generation's size;
    ``GoodputModel`` ignores a split that is not finite), past the generation's
    first ``WARMUP_STEPS`` rows, with the steps the job has left when it has ``steps``; None
    for other jobs and for rows all within the warm-up."""
    gen = job.gen
    if (job.spec.sizing != "goodput" or not isinstance(ev, RankSteps) or ev.rank != 0
            or gen is None or ev.generation != gen.number):
        return None
    skip = max(0, WARMUP_STEPS - gen.timed_rows)
    gen.timed_rows += len(ev.rows)
    rows = [(float(row[_STEP_S]), float(row[_COMPUTE_S]), float(row[_COMM_S]))
            for row in ev.rows[skip:]]
    rows = [r for r in rows if r[0] > 0 and math.isfinite(r[0])]
    if not rows:
        return None
    n = len(rows)
    step, compute, comm = (sum(col) / n for col in zip(*rows, strict=True))
    left = None
    last = float(ev.rows[-1][_STEP])
    if job.spec.steps is not None and math.isfinite(last):
        left = max(0.0, job.spec.steps - last)
    return StepTimes(now, job.id, gen.size, step, float(n), noise_scale=job.noise_scale,
                     compute_s=compute, comm_s=comm, steps_left=left)


_STEP = ROW_COLUMNS.index("step")
_STEP_S = ROW_COLUMNS.index("step_s")
_COMPUTE_S = ROW_COLUMNS.index("compute_s")
_COMM_S = ROW_COLUMNS.index("comm_s")


def _progress(job: LiveJob, gen: Generation, ev: RankSteps | RankPhase | RankDevice,
              now: float, out: Outbox) -> After:
    """Step rows; a rank's startup phase (for the startup watchdog); a rank's GPU readings
    (for straggler verdicts)."""
    if isinstance(ev, RankSteps):
        _steps(job, gen, ev.rank, ev.rows, now, out)
        if ev.rank == 0 and job.state is JobState.RUNNING:
            return After.MITIGATE
    elif isinstance(ev, RankPhase):
        gen.watch.entered(ev.rank, ev.phase, now)
    else:
        job.stragglers.device(ev.rank, dict(ev.readings))
    return After.NOTHING


def _steps(job: LiveJob, gen: Generation, rank: int, rows: Sequence[Sequence[Any]],
           now: float, out: Outbox) -> None:
    """Step rows of ``rank`` of the current generation ``gen``."""
    gen.watch.progressed(now)
    _check_finite(job, gen, rank, rows, now, out)
    if rank == 0 and rows:
        for row in rows:
            job.ledger.step(int(row[0]), float(row[2]))
        job.longest_step = max(job.longest_step,
                               gen.watch.record_steps(float(row[2]) for row in rows))
        job.step = max(job.step, int(rows[-1][0]))
    try:
        events = job.stragglers.observe(rank, rows)
    except ValueError:  # malformed timing (e.g. clock jumps): skip, never break the job
        events = []
    for event in events:
        out.publish(job, event)
    if not gen.running:
        _first_step(job, gen, rows, now, out)


def _first_step(job: LiveJob, gen: Generation, rows: Sequence[Sequence[Any]], now: float,
                out: Outbox) -> None:
    """The generation's first step rows: it trains (a recovery or a resize is done)."""
    gen.running = True
    job.ledger.enter("training", now)
    if job.recovering:
        _finish_recovery(job, gen, rows, now, out)
    done = job.plan.launched
    if done is not None:
        job.plan.launched = None
        out.publish(job, resize_event(out.wall, phase="done", old=done.old_size, new=gen.size,
                                      reason=done.reason, generation=gen.number,
                                      duration_s=now - done.asked))
    if job.state is JobState.STARTING:
        out.set_state(job, JobState.RUNNING, f"training (generation {gen.number})")


def _finish_recovery(job: LiveJob, gen: Generation, rows: Sequence[Sequence[Any]], now: float,
                     out: Outbox) -> None:
    fault = job.fault_log[-1] if job.fault_log else {}
    start = fault.get("_detected_mono")
    recovery_s = now - start if start is not None else None
    if fault:
        fault["recovery_s"] = recovery_s
    job.recovering = ""
    out.publish(job, recovery_event(
        out.wall, generation=gen.number, recovery_s=recovery_s,
        resumed_step=int(rows[0][0]) - 1 if rows else None,
        lost_steps=fault.get("lost_steps"), fault=fault.get("what")))


def _check_finite(job: LiveJob, gen: Generation, rank: int, rows: Sequence[Sequence[Any]],
                  now: float, out: Outbox) -> None:
    """A NaN or infinite metric is news at once; with ``on_nonfinite="halt"`` the job
    stops without checkpointing the bad state. A halt gets ``stop_grace_s`` as a stop
    does: ranks still running then are stopped (``JobMachine._tick_job``)."""
    for row in rows:
        metrics = row[METRICS_AT] if len(row) > METRICS_AT else None
        if not isinstance(metrics, dict):
            continue
        for name, value in metrics.items():
            if math.isfinite(value) or name in gen.nonfinite:
                continue
            gen.nonfinite.add(name)
            halting = job.spec.on_nonfinite == "halt" and not job.stop_requested
            out.publish(job, nonfinite_event(
                out.wall, rank=rank, step=int(row[0]), metric=name, value=value,
                generation=gen.number, halting=halting))
            if halting and gen.control.get("halt", 0) == 0:
                job.halt_reason = f"{name} was {value} at step {int(row[0])} on rank {rank}"
                if job.stop_deadline is None:
                    job.stop_deadline = now + job.sub.policy.stop_grace_s
                out.set_control(job, halt=1)
                out.set_state(job, JobState.STOPPING,
                              f"halting: {job.halt_reason}; stopping without a checkpoint, "
                              "so the newest one stays the last good state")


def mitigate(job: LiveJob, now: float, placement: dict[int, SlotInfo],
             spares: list[SlotInfo], grace_s: float, out: Outbox) -> None:
    """The straggler policy's actions after rank 0's rows (``placement``: where the ranks
    run; ``spares``: free slots of the job's kind); a replacement gets ``grace_s`` to
    checkpoint."""
    for action in job.stragglers.decide(now, job.step, placement, spares):
        event = mitigation_event(action)
        event["time"] = out.wall
        out.publish(job, event)
        if (action.kind is ActionKind.REPLACE and action.slot is not None
                and job.preempt is None and not job.stop_requested):
            # Through the preemption path: checkpoint, end the generation, start again
            # without the slow slot. No committed step is lost.
            job.preempt = Preemption(cause="replace", reason=action.reason,
                                     deadline=now + grace_s, slot=action.slot.slot)
            out.set_control(job, preempt=1)
            out.set_state(job, JobState.STOPPING, f"replacing slow rank {action.rank}: "
                                                  "checkpoint at the next step boundary")


def _checkpoint(job: LiveJob, gen: Generation | None, ev: RankCheckpoint, now: float,
                out: Outbox) -> After:
    """A checkpoint's phase (any generation's): a newer committed step than the job had is
    news for the scheduler (its preemption costs); rank 0's snapshot blocked the loop."""
    if ev.phase == "committed" and ev.step is not None:
        job.ledger.committed(ev.step)
        if ev.step > job.committed_step:
            job.committed_step = ev.step
            return After.COMMITTED if job.gen is not None else After.NOTHING
    elif ev.phase == "snapshot" and ev.rank == 0:
        job.ledger.checkpoint_blocked((ev.blocking_ms + ev.wait_ms) / 1e3)
    return After.NOTHING


def _rank_started(job: LiveJob, gen: Generation | None, ev: RankStarted, now: float,
                  out: Outbox) -> After:
    """A rank of ``gen`` restored and starts its first step; rank 0 says where from."""
    if gen is None:
        return After.NOTHING
    gen.watch.entered(ev.rank, "first step", now)
    if ev.rank == 0:
        for event in job.stragglers.restart(gen.size, ev.start_step):
            out.publish(job, event)
        _resumed_at(job, ev.start_step)
    return After.NOTHING


def _fault_injected(job: LiveJob, gen: Generation | None, ev: RankFaultInjected, now: float,
                    out: Outbox) -> After:
    if gen is not None:
        job.fired.add(ev.fault_id)
        gen.injected = ev.logged()
    return After.NOTHING


def _knobs(job: LiveJob, gen: Generation | None, ev: RankKnobs, now: float,
           out: Outbox) -> After:
    if gen is not None and ev.rank == 0:
        knobflow.declared(job, ev)
    return After.NOTHING


def _knob_applied(job: LiveJob, gen: Generation | None, ev: RankKnobApplied, now: float,
                  out: Outbox) -> After:
    if ev.rank == 0:
        knobflow.applied(job, ev, out)
    return After.NOTHING


#: What the machine does with the logged kinds of rank messages (the others only log).
_REPORTS: dict[type[RankEvent], Callable[[LiveJob, Generation | None, Any, float, Outbox],
                                         After]] = {
    RankCheckpoint: _checkpoint, RankStarted: _rank_started, RankFaultInjected: _fault_injected,
    RankKnobs: _knobs, RankKnobApplied: _knob_applied}


def _resumed_at(job: LiveJob, start: int) -> None:
    """The ranks restored step ``start``. Where that is not the step the controller rolled
    back to (a checkpoint committed after the controller last heard, because a rank or the
    controller died right after its commit; or the newest checkpoint was unreadable and the
    ranks fell back to an older one), the fault being recovered from says where the job
    really resumed, and it and the goodput say what it really lost. The job's committed step
    is the restored one from now on in either case: a later restart resumes from it, not
    from a newer checkpoint the ranks could not read."""
    job.committed_step = start
    lost = job.ledger.resumed_at(start)
    fault = job.fault_log[-1] if job.recovering and job.fault_log else None
    if fault is None or fault.get("resume_step") is None or fault["resume_step"] == start:
        return
    fault["resume_step"] = start
    if fault.get("lost_steps") is not None:
        fault["lost_steps"] = lost
