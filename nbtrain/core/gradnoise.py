"""Gradient noise scale and the statistical efficiency it implies (pure).

The gradient noise scale ``B_noise = tr(Sigma) / |G|**2`` (McCandlish et al., "An Empirical
Model of Large-Batch Training", 2018) is the batch size beyond which a larger batch mostly
averages away noise instead of making progress. It is cheap to estimate at every step of a
data-parallel job (their appendix A.1): each rank's local gradient (batch ``b_small``) and
the all-reduced gradient (batch ``b_big``, ``n * b_small`` on an even split) give two
unbiased estimates,

    |G|**2   ~ (b_big * |g_big|**2 - b_small * |g_small|**2) / (b_big - b_small)
    tr(Sigma) ~ (|g_small|**2 - |g_big|**2) / (1 / b_small - 1 / b_big)

each noisy; their ratio is taken only after both are smoothed (exponential moving averages),
as the paper advises. ``|g_small|**2`` is the mean over ranks of their local squared norms.

Statistical efficiency (Pollux, OSDI'21, eq. 5): a step at global batch ``M`` makes
``(B_noise + M0) / (B_noise + M)`` of the progress per sample that a step at the reference
batch ``M0`` makes. nbtrain's loader keeps the global batch fixed across sizes, so the
efficiency is the same at every size and does not move a sizing decision; it matters for jobs
whose global batch grows with their size (a fixed per-rank batch). A job that sends no noise
scale has efficiency 1 (treated as if every sample counts fully).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["NoiseScale", "efficiency"]


def efficiency(batch: float, ref_batch: float, noise_scale: float | None) -> float:
    """Progress per sample at global ``batch`` relative to ``ref_batch`` (1 when the noise
    scale is unknown)."""
    if not (batch > 0 and ref_batch > 0):
        raise ValueError(f"batch sizes must be > 0, got batch={batch!r}, "
                         f"ref_batch={ref_batch!r}")
    if noise_scale is None:
        return 1.0
    phi = max(0.0, noise_scale)
    return (phi + ref_batch) / (phi + batch)


@dataclass
class NoiseScale:
    """Smoothed estimate of ``B_noise`` from per-step gradient norms.

    ``decay``: weight kept by the running averages per step (0.99: about the last 100 steps
    count), larger for noisier norms."""

    decay: float = 0.99
    _g2: float = 0.0
    _s: float = 0.0
    _w: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")

    def observe(self, local_sq_norm: float, global_sq_norm: float, local_batch: float,
                global_batch: float) -> None:
        """One step: the squared norm of a local gradient (or the mean over ranks of them),
        that of the reduced gradient, and the batches they were taken over (samples). A step
        whose local batch is the whole batch (a single rank) cannot tell noise from signal
        and is ignored."""
        if not 0 < local_batch < global_batch:
            if 0 < local_batch == global_batch:
                return
            raise ValueError(f"bad batch sizes: local_batch={local_batch!r} must be > 0 and "
                             f"<= global_batch={global_batch!r}")
        if not (math.isfinite(local_sq_norm) and math.isfinite(global_sq_norm)):
            raise ValueError(f"bad gradient-norm sample: local={local_sq_norm!r}, "
                             f"global={global_sq_norm!r}")
        small, big = local_batch, global_batch
        g2 = (big * global_sq_norm - small * local_sq_norm) / (big - small)
        s = (local_sq_norm - global_sq_norm) / (1.0 / small - 1.0 / big)
        self._g2 = self.decay * self._g2 + (1.0 - self.decay) * g2
        self._s = self.decay * self._s + (1.0 - self.decay) * s
        self._w = self.decay * self._w + (1.0 - self.decay)

    @property
    def value(self) -> float | None:
        """The estimate of ``B_noise`` (samples), or ``None`` before any usable step (or
        while the signal estimate is not positive)."""
        if self._w == 0.0 or self._g2 <= 0.0:
            return None
        return max(0.0, self._s) / self._g2
