"""The step boundary: everything nbtrain does on a rank between two training steps.

Both ways of writing training drive the same object, so both get the same timing, control,
checkpoints and fault injection:

- a ``Recipe``: nbtrain's loop calls ``begin()``, ``recipe.next_batch``, ``batch_ready()``,
  ``recipe.step``, ``end(metrics)``;
- a training function: iterating ``ctx.batches(...)`` (or ``ctx.steps()``) calls the same
  methods around each ``yield``.

``begin()`` fires planned faults and starts the step's clock; ``batch_ready()`` ends the data
wait; ``end(metrics)`` counts the step, acts on the control requests the ranks agreed on
(stop, preempt, checkpoint, halt; offered at the boundary before, see
``nbtrain.runtime.control``), takes a checkpoint when due, offers the next agreement at the
agreed steps, and emits the step's row. The loop ends when ``begin()`` says the step budget
is spent ("completed") or ``end()`` says a request ends it ("stopped", "preempted",
"halted"); ``outcome`` says which.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from nbtrain.runtime.checkpointing import RankCheckpointing
from nbtrain.runtime.control import ControlChannel
from nbtrain.runtime.events import EventEmitter
from nbtrain.runtime.faults import FaultInjector
from nbtrain.runtime.knobs import RankKnobs
from nbtrain.runtime.noiseprobe import NoiseProbe
from nbtrain.runtime.timing import PhaseTimer

__all__ = ["KILL_NOTICE_S", "StepPace", "Stepper"]

#: Seconds between announcing an injected kill and doing it (so the event leaves first).
KILL_NOTICE_S = 0.2


class StepPace:
    """A rank's running mean step time, which spaces the control agreements about
    ``interval_s`` of training apart (``steps_between``).

    A step longer than ``clamp`` times the mean (a checkpoint save, an evaluation, a pause
    in the user's code) counts as a step ``clamp`` times the mean. With a plain mean, one
    2 s step among 25 ms steps made each rank wish for an agreement at every step for the
    next ten steps: 12 agreements in the 40 steps after it instead of 5. A lasting slowdown
    still comes through: the mean grows by up to ``1 + weight * (clamp - 1)`` (1.3 at the
    defaults) a step.
    """

    __slots__ = ("clamp", "mean_s", "weight")

    def __init__(self, *, weight: float = 0.1, clamp: float = 4.0) -> None:
        self.weight, self.clamp = weight, clamp
        self.mean_s = 0.0  # 0: no step yet

    def add(self, step_s: float) -> None:
        """One step's wall time (seconds)."""
        if self.mean_s == 0.0:
            self.mean_s = step_s
            return
        sample = min(step_s, self.clamp * self.mean_s)
        self.mean_s += self.weight * (sample - self.mean_s)

    def steps_between(self, interval_s: float) -> int:
        """Steps to the next agreement this rank wishes for (``ControlChannel.offer``
        clamps it to 1..``MAX_INTERVAL_STEPS``)."""
        return int(interval_s / self.mean_s) if self.mean_s > 0 else 1


class Stepper:
    """Per-step mechanics of one rank (see the module docstring)."""

    def __init__(self, *, timer: PhaseTimer, steps: int | None, control: ControlChannel,
                 emitter: EventEmitter, checkpointing: RankCheckpointing | None,
                 injector: FaultInjector, interval_s: float,
                 halt_on_nonfinite: bool = False) -> None:
        self.timer = timer
        self.steps = steps
        self.control = control
        self.emitter = emitter
        self.ckpt = checkpointing
        self.injector = injector
        self.interval_s = interval_s
        self.step = 0
        self.outcome: str | None = None
        self.in_step = False
        self._next_agreement = 1
        self._pace = StepPace()
        self._last_compute = 0.0
        self._checkpoint_seq = 0
        self._t0 = self._t1 = 0.0
        self.halt_on_nonfinite = halt_on_nonfinite
        #: A reported metric was NaN/inf: under halt_on_nonfinite nothing is saved from then
        #: on (the controller's halt arrives at the next agreement, a few steps later).
        self.tainted = False
        #: Measures the rank's state after the generation's first step (the ``memory``
        #: event); called once.
        self.memory_probe: Callable[[], dict[str, Any]] | None = None
        #: The rank's live knobs (applied at step boundaries) and whether this rank reports
        #: their changes (rank 0).
        self.knobs: RankKnobs | None = None
        self.is_main = False
        #: Rank 0 of a goodput-sized job: the gradient noise scale from each step's norms.
        self.noise: NoiseProbe | None = None

    def start(self, step: int) -> None:
        """The loop starts at ``step`` (0, or the restored checkpoint's step)."""
        self.step = step
        self._next_agreement = step + 1

    def begin(self) -> bool:
        """Start the next step; False (outcome "completed") when the step budget is spent."""
        if self.steps is not None and self.step >= self.steps:
            self.outcome = "completed"
            return False
        for fault in self.injector.poll(self.step + 1):
            delay = KILL_NOTICE_S if fault.kind == "kill" else 0.0
            # ``when`` is the moment of the kill, for the controller's detection latency.
            self.emitter.emit("fault_injected", fault=fault.to_dict(), step=self.step,
                              when=time.time() + delay)
            if delay:
                time.sleep(delay)
            self.injector.fire(fault)
        self._t0 = time.perf_counter()
        self.timer.reset()
        self.in_step = True
        return True

    def batch_ready(self) -> None:
        """The step's batch is here: the data wait ends, the compute begins."""
        self._t1 = time.perf_counter()
        if self.injector.slow_factor > 1.0:
            self.injector.stretch(self._last_compute)  # inside the compute window

    def end(self, metrics: dict[str, Any] | None = None) -> bool:
        """The step's work is done. True when the loop must end (``outcome`` says why)."""
        perf = time.perf_counter
        t2 = perf()
        self.in_step = False
        self.step += 1
        step = self.step
        ckpt = self.ckpt
        requests = None
        want_checkpoint = ckpt is not None and ckpt.deterministic_due(step)
        control = self.control
        if control.in_flight:  # offered at the last boundary: every rank acts on it now
            requests, interval = control.agreed()
            self._next_agreement = step + interval - 1  # offered then, acted on a step later
            if requests["due"] or requests["checkpoint"] > self._checkpoint_seq:
                want_checkpoint = True
                self._checkpoint_seq = requests["checkpoint"]
        knobs = self.knobs
        if knobs is not None:  # before a checkpoint at this step, which then holds them
            agreed = self.control.agreed_knobs if requests is not None else []
            if agreed:
                applied = knobs.apply(agreed, step)
                if applied and self.is_main:
                    self.emitter.emit("knob_applied", step=step, changes=applied,
                                      values=dict(knobs.values))
            else:
                knobs.at_step(step)
        ending = requests is not None and bool(
            requests["stop"] or requests["preempt"] or requests["halt"])
        if self.halt_on_nonfinite and metrics and not self.tainted:
            self.tainted = not all(math.isfinite(float(v)) for v in metrics.values())
        if want_checkpoint and ckpt is not None and not ending and not self.tainted:
            ckpt.save(step)
        if not ending and step >= self._next_agreement:  # after the save: its step is not due
            control.offer(self._pace.steps_between(self.interval_s),
                          ckpt is not None and ckpt.locally_due(step))
        t3 = perf()
        step_s = t3 - self._t0
        self._pace.add(step_s)
        comm = self.timer.comm_s
        opt = self.timer.opt_s
        compute = max(0.0, (t2 - self._t1) - comm - opt)
        if self.injector.slow_factor <= 1.0:
            self._last_compute = compute
        row: list[Any] = [step, time.time(), step_s, self._t1 - self._t0, compute, comm, opt]
        if metrics:
            row.append({k: float(v) for k, v in metrics.items()})
        self.emitter.step(row)
        if self.noise is not None:
            self.noise.after_step(step)
        if self.memory_probe is not None:
            probe, self.memory_probe = self.memory_probe, None
            try:
                info = probe()
            except Exception:  # a figure for the dashboard must never fail the step
                info = None
            if info is not None:
                self.emitter.emit_aside("memory", step=step, **info)
        if ending:
            assert requests is not None
            self.outcome = ("halted" if requests["halt"] else
                            "preempted" if requests["preempt"] else "stopped")
            return True
        return False
