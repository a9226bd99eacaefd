"""Rank 0's estimate of the gradient noise scale, sent to the controller for goodput sizing.

Each step of a data-parallel (DDP) job, the all-reduce hook (``runtime.timing``) sums the
squared norms of this rank's local gradient (its share of the batch) and of the reduced one
(the whole global batch). :class:`NoiseProbe` feeds them to the smoothed estimator of
``core.gradnoise`` and every ``every`` steps sends its value (a ``gradnoise`` event). Rank 0
alone measures: its local norm stands in for the mean over ranks, an unbiased estimate that
the smoothing makes usable. A step whose batch is not nbtrain's (no global batch known) or
that was not reduced by DDP (FSDP, a single rank) is skipped.
"""

from __future__ import annotations

from nbtrain.core.gradnoise import NoiseScale
from nbtrain.runtime.events import EventEmitter
from nbtrain.runtime.timing import PhaseTimer

__all__ = ["NoiseProbe"]


class NoiseProbe:
    """Gradient norms of rank 0's steps to a noise-scale estimate, sent every ``every``."""

    def __init__(self, timer: PhaseTimer, emitter: EventEmitter, world_size: int,
                 every: int = 20) -> None:
        self.timer = timer
        self.emitter = emitter
        self.world_size = world_size
        self.every = every
        self.estimate = NoiseScale()
        self.observed = 0
        timer.grad_norms = True

    def after_step(self, step: int) -> None:
        norms = self.timer.take_grad_norms()
        batch = self.timer.global_batch
        if norms is None or batch is None or self.world_size < 2:
            return
        share = self.timer.grad_weight  # None: an even split
        local_batch = batch / self.world_size if share is None else share * batch
        if not 0 < local_batch < batch:
            return
        try:
            self.estimate.observe(norms[0], norms[1], local_batch, self.world_size)
        except ValueError:  # a non-finite gradient: the non-finite metric alert says more
            return
        self.observed += 1
        if self.observed % self.every == 0:
            self.emitter.emit_aside("gradnoise", step=step, noise_scale=self.estimate.value,
                                    observed=self.observed)
