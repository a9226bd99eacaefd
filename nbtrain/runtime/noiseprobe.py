"""Rank 0's estimate of the gradient noise scale, sent to the controller for goodput sizing.

Each step of a data-parallel (DDP) job, the all-reduce hook (``runtime.timing``) measures the
squared norms of this rank's local gradient (its share of the batch) and of the reduced one
(the whole global batch), as tensors on the gradients' device. :class:`NoiseProbe` keeps them
with the step's batch sizes and, every ``every`` steps, reads them all at once (one wait for
the device per ``every`` steps, none per step), feeds them to the smoothed estimator of
``core.gradnoise`` and sends its value (a ``gradnoise`` event).

Rank 0 alone measures: its local norm stands in for the mean over ranks, an unbiased
estimate that the smoothing makes usable. It runs only where it can: a job of two ranks or
more (one rank cannot tell noise from signal) whose batches come from nbtrain's loader (the
real per-rank and global batch sizes, also when the batch splits unevenly); a step that was
not reduced by DDP (FSDP) gives no norms and is skipped.
"""

from __future__ import annotations

import torch

from nbtrain.core.gradnoise import NoiseScale
from nbtrain.runtime.events import EventEmitter
from nbtrain.runtime.timing import PhaseTimer

__all__ = ["NoiseProbe"]


class NoiseProbe:
    """Gradient norms of rank 0's steps to a noise-scale estimate, sent every ``every``."""

    def __init__(self, timer: PhaseTimer, emitter: EventEmitter, every: int = 20) -> None:
        self.timer = timer
        self.emitter = emitter
        self.every = every
        self.estimate = NoiseScale()
        self.observed = 0
        self._norms: list[torch.Tensor] = []
        self._sizes: list[tuple[int, int]] = []
        timer.grad_norms = True

    def after_step(self, step: int) -> None:
        norms = self.timer.take_grad_norms()
        sizes = self.timer.batch_sizes
        if sizes is None:  # not nbtrain's loader: the sizes are unknown, stop measuring
            self.timer.grad_norms = False
            return
        if norms is None or not 0 < sizes[0] < sizes[1]:
            return
        self._norms.append(norms)
        self._sizes.append(sizes)
        if len(self._norms) >= self.every:
            self._send(step)

    def _send(self, step: int) -> None:
        rows = torch.stack(self._norms).cpu().tolist()  # the one wait for the device
        sizes, self._norms, self._sizes = self._sizes, [], []
        for (local_sq, global_sq), (mine, batch) in zip(rows, sizes, strict=True):
            try:
                self.estimate.observe(local_sq, global_sq, mine, batch)
            except ValueError:  # a non-finite gradient: the non-finite metric alert says more
                continue
            self.observed += 1
        self.emitter.emit_aside("gradnoise", step=step, noise_scale=self.estimate.value,
                                observed=self.observed)
