"""When a straggler is confirmed and when it is cleared: its cost over a window (pure, numpy).

The detector (:mod:`nbtrain.core.straggler`) says per step how much longer each rank spent in
each phase than its peers (the *excess*). A confirmed verdict is what mitigation acts on, so
it follows what the slow rank costs the job, not how many single steps looked slow:

- **Confirmed** when, over the last ``confirm_steps`` steps, the excess was sustained: split
  into blocks of ``window`` steps, *every* block's mean excess is at least ``confirm_share``
  of the median step time and ``confirm_z`` times the job's noise. A mean over a block counts
  a rank that alternates fast and slow steps (a CPU shared with another process, whose
  scheduler slices do not line up with steps) by what it costs on average; a burst that
  fills one block but not the others is not sustained. Each block's mean leaves out its
  fastest and slowest step (``trimmed_mean``), so one spike cannot make a block cost.
- **Or confirmed when it lasts**: over the last ``sustain_steps`` (64) steps every block's
  mean excess is at least ``confirm_share`` of a step and ``sustain_z`` (2) times the noise.
  On a busy machine the noise bar can stand above a rank that costs the job a fifth of every
  step (seen: a hogged rank costing 4-7 ms of a 30 ms step against a bar of 8.5 ms); a load
  that comes and goes does not stay on one rank for 64 steps, a slow rank does.
- **Cleared** when the cost is gone: the mean of those block means is below ``clear_share``
  of a step. One fast step, or a few, cannot clear a rank that still costs the job a share
  of every step.
- The **noise** is how much the job's block means wander over time (a rank's excess over its
  peers, or the peers' own time in the phase, weighted ``LOAD_WEIGHT``; 1.4826 x the MAD over
  time, median over ranks), measured over the ``noise_steps`` steps before the last
  ``confirm_steps``. A (rank, phase) is judged against the noise as it was when its slowdown
  began (``freeze``): a slow rank makes the job noisier itself (its own onset; the other
  processes the kernel moves off its core land on its peers), and the bar must not rise with
  the slowdown it is meant to measure.

Why (issue 31): the previous rule asked for 70% of 32 steps slow on their own and cleared
after 6 of 8 fast steps; a rank with a CPU hog on its core was slow on 67% of steps, and
flapped between suspect and cleared all run long without being confirmed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from nbtrain.core.records import PHASES, FloatArray

if TYPE_CHECKING:
    from nbtrain.core.straggler import StragglerSettings

BoolArray = npt.NDArray[np.bool_]

_MAD_TO_SIGMA = 1.4826
_MIN_NOISE_STEPS = 16  # fewer lagged levels than this: measure the noise on all levels seen
_NOISE_EVERY = 16  # steps between two measurements of the noise
#: How much the peers' own wander counts in the noise (a machine whose load comes and goes).
LOAD_WEIGHT = 1.5


def trimmed_mean(values: FloatArray, axis: int = 0) -> FloatArray:
    """The mean along ``axis`` without the smallest and the largest value (all values when
    there are fewer than 4): what a block of steps cost, one spike left out. NaN where a
    column holds one."""
    n = values.shape[axis]
    if n < 4:
        plain: FloatArray = values.mean(axis=axis)
        return plain
    ordered = np.sort(values, axis=axis)  # NaN sorts last: the mean keeps it
    if axis != 0:
        ordered = np.moveaxis(ordered, axis, 0)
    # What ``ordered[1:-1].mean(axis=0)`` computes (the same sum, divided the same way),
    # without its Python wrapper: the detector calls this twice on every judged step.
    inner: FloatArray = np.add.reduce(ordered[1:n - 1], axis=0) / (n - 2)
    gaps = np.isnan(ordered[n - 1])  # a column with a NaN has one last
    if gaps.any():
        inner = np.where(gaps, np.nan, inner)
    return inner


def block_means(excess: FloatArray, block: int) -> FloatArray:
    """Trimmed mean excess of each block of ``block`` steps (the last ones of ``excess``,
    oldest first along axis 0; a partial block at the old end is dropped), shape
    (blocks, ...)."""
    n = max(1, excess.shape[0] // block)
    span = min(excess.shape[0], n * block)
    tail = excess[excess.shape[0] - span:]
    means: FloatArray = trimmed_mean(tail.reshape(n, span // n, *excess.shape[1:]), axis=1)
    return means


def sustained_excess(excess: FloatArray, block: int) -> FloatArray:
    """The excess a pair kept through the whole evidence: the smallest of its block means."""
    lowest: FloatArray = block_means(excess, block).min(axis=0)
    return lowest


class CostJudge:
    """The confirm and clear rule of one detector, with the job's noise it is measured against.

    ``record`` takes, per judged step, the mean excess and peers' time over the vote window
    (phases x ranks); ``freeze`` keeps the current noise for pairs whose slowdown begins;
    ``confirm`` and ``clear`` read the evidence the detector passes in.
    """

    def __init__(self, settings: StragglerSettings, world_size: int) -> None:
        self._settings = settings
        self._levels: FloatArray = np.full(
            (noise_len(settings), 2, len(PHASES), world_size), np.nan)
        self._pos = 0
        self._recorded = 0
        self._cache: tuple[int, FloatArray, bool] | None = None
        self.frozen: FloatArray = np.full((len(PHASES), world_size), np.nan)
        """Per (phase, rank), the noise when its current slowdown began (NaN: it began before
        the noise was measured, and the noise now is used)."""

    def update_settings(self, settings: StragglerSettings) -> None:
        old, self._settings = self._settings, settings
        if noise_len(settings) != noise_len(old):
            self._levels, self._pos = regrow(self._levels, self._pos, noise_len(settings))
        self._cache = None

    def record(self, excess_level: FloatArray, reference_level: FloatArray) -> None:
        """One step's levels: the mean excess and the peers' mean time over the vote window
        (NaN where the window has a gap: such a level is skipped)."""
        self._levels[self._pos, 0] = excess_level
        self._levels[self._pos, 1] = reference_level
        self._pos = (self._pos + 1) % self._levels.shape[0]
        self._recorded += 1

    def noise(self) -> FloatArray:
        """Per phase, the job's noise now (seconds; zero until measured)."""
        return self._measure()[0]

    def _measure(self) -> tuple[FloatArray, bool]:
        """The noise, and whether it was measured on steps before the evidence (enough of
        them) rather than on all steps seen. Measured again every ``_NOISE_EVERY`` steps: it
        is a median over time, which at 64 ranks costs ten times the rest of a judged step,
        and it moves slowly (it is lagged by ``confirm_steps`` anyway)."""
        if self._cache is not None and self._recorded - self._cache[0] < _NOISE_EVERY:
            return self._cache[1], self._cache[2]
        ring = np.roll(self._levels, -self._pos, axis=0)  # oldest first
        lagged = ring[: ring.shape[0] - self._settings.confirm_steps]
        enough = bool(np.sum(~np.isnan(lagged[:, 0, 0, 0])) >= _MIN_NOISE_STEPS)
        usable = lagged if enough else ring
        levels = usable[~np.isnan(usable[:, 0, 0, 0])]
        sigma: FloatArray = np.zeros(len(PHASES))
        if levels.shape[0] >= 2:
            mad = np.median(np.abs(levels - np.median(levels, axis=0)), axis=0)
            wander = _MAD_TO_SIGMA * np.median(mad, axis=2)  # (excess or peers, phase)
            sigma = np.maximum(wander[0], LOAD_WEIGHT * wander[1])
        self._cache = (self._recorded, sigma, enough)
        return sigma, enough

    def freeze(self, starting: BoolArray) -> None:
        """Pairs whose slowdown begins now are judged against the noise as it is now."""
        if starting.any():
            sigma, measured = self._measure()
            now = np.broadcast_to(sigma[:, None] if measured else np.nan, starting.shape)
            self.frozen[starting] = now[starting]

    def bar(self) -> FloatArray:
        """Per (phase, rank), the noise a confirmation is measured against: as it was when the
        pair's slowdown began, or as it is now if the noise was not measured then."""
        frozen = self.frozen
        bar: FloatArray = np.where(np.isnan(frozen), self.noise()[:, None], frozen)
        return bar

    def confirm(self, candidates: BoolArray, excess: FloatArray, step_s: float,
                sustained: FloatArray | None = None) -> BoolArray:
        """Which ``candidates`` (phase, rank) the evidence ``excess`` (the last
        ``confirm_steps`` steps) confirms, the median step time being ``step_s``;
        ``sustained``: the last ``sustain_steps`` steps, for the slower path."""
        s = self._settings
        if excess.shape[0] < s.confirm_steps or not candidates.any():
            return np.zeros(candidates.shape, dtype=bool)
        ok: BoolArray = np.zeros(candidates.shape, dtype=bool)
        kept = sustained_excess(excess[:, candidates], s.window)  # the candidates' columns
        costly = kept >= s.confirm_share * step_s
        if costly.any():  # the noise only where it decides
            bar = self.bar()[candidates]
            clear_of_noise = kept >= s.confirm_z * bar
            if (sustained is not None and sustained.shape[0] >= s.sustain_steps
                    and not clear_of_noise[costly].all()):
                lasting = sustained_excess(sustained[:, candidates], s.window)
                clear_of_noise |= ((lasting >= s.confirm_share * step_s)
                                   & (lasting >= s.sustain_z * bar))
            costly &= clear_of_noise
        ok[candidates] = costly
        return ok

    def clear(self, confirmed: BoolArray, excess: FloatArray, step_s: float) -> BoolArray:
        """Which ``confirmed`` pairs no longer cost the job: their mean excess over the
        evidence is below ``clear_share`` of a step."""
        if not confirmed.any():
            return np.zeros(confirmed.shape, dtype=bool)
        gone: BoolArray = np.zeros(confirmed.shape, dtype=bool)
        cost = block_means(excess[:, confirmed], self._settings.window).mean(axis=0)
        share = min(self._settings.clear_share, self._settings.confirm_share)
        gone[confirmed] = cost < share * step_s
        return gone


def noise_len(s: StragglerSettings) -> int:
    return s.noise_steps + s.confirm_steps


def regrow(ring: npt.NDArray[Any], pos: int, length: int, fill: Any = np.nan
           ) -> tuple[Any, int]:
    """A ring of ``length`` entries with the most recent ones of ``ring`` (written up to
    ``pos``), oldest first, and the position of the next write; new entries are ``fill``."""
    chrono = np.roll(ring, -pos, axis=0)
    keep = min(length, ring.shape[0])
    out = np.full((length, *ring.shape[1:]), fill, dtype=ring.dtype)
    out[:keep] = chrono[ring.shape[0] - keep:]
    return out, keep % length


__all__ = ["LOAD_WEIGHT", "CostJudge", "block_means", "noise_len", "regrow",
           "sustained_excess", "trimmed_mean"]
