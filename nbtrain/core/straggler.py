"""Straggler detector: per-rank, per-phase verdicts from step records (pure, numpy only).

In synchronous training every rank's step takes as long as the slowest rank's, so total step
times say nothing about who is slow. The detector compares each *phase* of a rank's step with
the same phase on the other ranks:

1. Per step, a rank's phase is *slow* when it is at least ``ratio`` times the median of the
   other ranks (leave-one-out median, so that with two ranks each is compared with the other),
   the excess is above an absolute floor and a share of the step, and (with three or more
   ranks) the excess is ``min_z`` robust standard deviations (1.4826 x MAD across ranks) wide.
2. Communication is judged on the *residual* wait: the wait explained by peers that became
   ready later (they spent longer in optimizer, data and compute) is removed first. The ranks
   waiting for a compute straggler therefore have ordinary residuals and are never blamed;
   only a rank whose own wait stands out after that correction is a comm straggler.
3. Per (rank, phase) a rolling vote over the last ``window`` steps: *suspect* when at least
   ``suspect_votes`` of them were slow, *cleared* when the count falls to ``clear_votes`` or
   fewer, *confirmed* when it stayed suspect for ``confirm_steps`` steps. A transient spike
   that hits fewer than ``suspect_votes`` of ``window`` steps cannot make a rank suspect,
   whatever its size: spikes are ignored by construction, not by tuning a magnitude. The gap
   between the suspect and clear counts is hysteresis, so a rank hovering near the threshold
   does not flap.
4. The first ``warmup_steps`` steps after each (re)start are not judged (compilation, cache
   warm-up and the first all-reduce make them slow for reasons that pass).

The detector reads no clock and keeps no threads: the same object runs in the engine (fed by
the event plane), the simulator and the benchmark.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from nbtrain.core.records import PHASES, FloatArray, Phase, StepFrame, StepRecord

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_DATA, _COMPUTE, _COMM, _OPT = (PHASES.index(p) for p in PHASES)
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
_MAX_PENDING_STEPS = 1024  # incomplete steps kept while waiting for slower ranks' records


class Verdict(str, enum.Enum):
    """The state a (rank, phase) pair moved into."""

    SUSPECT = "suspect"
    CONFIRMED = "confirmed"
    CLEARED = "cleared"


HINTS: dict[Phase, str] = {
    Phase.DATA: (
        "input pipeline: slow storage or network I/O, or too few data-loader workers "
        "on this rank's host"
    ),
    Phase.COMPUTE: (
        "compute: thermal or power throttling, a co-located process competing for the device "
        "or CPU, or a slower device on this host"
    ),
    Phase.COMM: "network: a slow, congested or misconfigured link or NIC on this rank's host",
    Phase.OPT: (
        "optimizer step: CPU contention or slow host-device copies on this rank's host"
    ),
}


@dataclass(frozen=True, kw_only=True)
class StragglerSettings:
    """Thresholds of the detector; change them on a running job with ``update_settings``.

    Defaults flag a rank 1.2x slower than its peers in one phase about 6-8 steps after it
    slows down, and ignore spikes of any size on fewer than 6 of 8 steps.
    """

    ratio: float = 1.2
    """A phase is slow on a step at >= ratio x the other ranks' median. Lower it to catch
    milder stragglers; keep it above the cross-rank noise of your phase times."""
    window: int = 8
    """Steps in the rolling vote. Longer windows tolerate longer transients and react later."""
    suspect_votes: int = 6
    """Slow steps among the last ``window`` that make a (rank, phase) suspect."""
    clear_votes: int = 2
    """A suspect is cleared when its slow steps in the window fall to this many or fewer."""
    confirm_steps: int = 30
    """Steps a pair must stay suspect to be confirmed (the verdict mitigation acts on). Should
    cover a few times the longest pause you consider normal (a checkpoint, an evaluation)."""
    warmup_steps: int = 20
    """Steps after each (re)start that are not judged."""
    min_excess_s: float = 1e-3
    """Absolute floor on the excess seconds per step, so microsecond phases are never blamed."""
    min_step_share: float = 0.01
    """The excess must also be this share of the median step time (over the window): a
    straggler that costs the job less than 1% is not worth an alert."""
    min_z: float = 2.0
    """With 3 or more ranks, the excess must be this many robust standard deviations
    (1.4826 x MAD across ranks): guards jobs whose ranks are noisy by nature, where ``ratio``
    alone would flag ordinary noise. Per step, not per window: the vote does the rest."""
    phases: tuple[Phase, ...] = PHASES
    """The phases judged."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not self.ratio > 1.0:
            problems.append(f"ratio must be > 1, got {self.ratio!r} (e.g. ratio=1.2)")
        if not (isinstance(self.window, int) and self.window >= 1):
            problems.append(f"window must be an integer >= 1 step, got {self.window!r}")
        elif not (isinstance(self.suspect_votes, int) and 1 <= self.suspect_votes <= self.window):
            problems.append(
                f"suspect_votes must be between 1 and window={self.window}, "
                f"got {self.suspect_votes!r}"
            )
        elif not (isinstance(self.clear_votes, int) and 0 <= self.clear_votes < self.suspect_votes):
            problems.append(
                f"clear_votes must be >= 0 and below suspect_votes={self.suspect_votes}, "
                f"got {self.clear_votes!r}"
            )
        if not (isinstance(self.confirm_steps, int) and self.confirm_steps >= 1):
            problems.append(f"confirm_steps must be an integer >= 1, got {self.confirm_steps!r}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            problems.append(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not self.min_excess_s >= 0.0:
            problems.append(f"min_excess_s must be >= 0 seconds, got {self.min_excess_s!r}")
        if not 0.0 <= self.min_step_share < 1.0:
            problems.append(f"min_step_share must be in [0, 1), got {self.min_step_share!r}")
        if not self.min_z >= 0.0:
            problems.append(f"min_z must be >= 0, got {self.min_z!r}")
        try:
            phases = tuple(Phase(p) for p in self.phases)
        except ValueError:
            phases = ()
        if not phases or len(set(phases)) != len(phases):
            problems.append(
                f"phases must be a non-empty selection of {[p.value for p in PHASES]} without "
                f"repeats, got {self.phases!r}"
            )
        else:
            object.__setattr__(self, "phases", phases)
        if problems:
            raise ValueError("invalid StragglerSettings: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """Which rank is slow, in which phase, by how much, since when, and a likely cause.

    ``ratio`` and ``excess_s`` are medians over the vote window, so one spike does not
    distort them. ``step_share`` (excess over the median step time) is about how much the
    whole job slows down because of this rank. For ``comm`` they describe the residual wait
    (the wait not explained by later peers), not the raw one. ``nvml`` is attached by the
    engine on GPUs (clocks, temperature, power); the detector never fills it.
    """

    rank: int
    phase: Phase
    state: Verdict
    step: int
    since_step: int
    ratio: float
    excess_s: float
    step_share: float
    slow_steps: int
    window: int
    hint: str
    nvml: Mapping[str, float] | None = field(default=None, compare=False)

    def with_nvml(self, readings: Mapping[str, float], hint: str | None = None) -> Diagnosis:
        """A copy with device readings attached (on GPUs), and the hint they point to."""
        return dataclasses.replace(self, nvml=dict(readings), hint=hint or self.hint)

    def summary(self) -> str:
        """One line for an alert list or a log."""
        if self.state is Verdict.CLEARED:
            return (
                f"rank {self.rank} {self.phase.value}: cleared at step {self.step} "
                f"(was slow since step {self.since_step}; now {self.ratio:.2f}x its peers)"
            )
        return (
            f"rank {self.rank} {self.phase.value} {self.state.value}: {self.ratio:.2f}x its "
            f"peers (+{self.excess_s * 1e3:.1f} ms/step, {self.step_share:.0%} of a step) "
            f"since step {self.since_step}; {self.slow_steps}/{self.window} recent steps slow. "
            f"Likely {self.hint}"
        )

    def to_event(self) -> dict[str, Any]:
        """A plain dict for the event plane and the notebook (JSON-friendly)."""
        return {
            "topic": "straggler",
            "rank": self.rank,
            "phase": self.phase.value,
            "state": self.state.value,
            "step": self.step,
            "since_step": self.since_step,
            "ratio": self.ratio,
            "excess_s": self.excess_s,
            "step_share": self.step_share,
            "slow_steps": self.slow_steps,
            "window": self.window,
            "hint": self.hint,
            "nvml": dict(self.nvml) if self.nvml is not None else None,
            "summary": self.summary(),
        }


def leave_one_out_median(values: FloatArray) -> FloatArray:
    """For each column i of each row, the median of that row without column i.

    ``values`` has shape (rows, n) with n >= 2. O(n log n) per row via one sort: removing the
    element at sorted position p shifts the order statistics above p down by one.
    """
    rows, n = values.shape
    if n < 2:
        raise ValueError(f"leave_one_out_median needs at least 2 columns, got {n}")
    order = np.argsort(values, axis=1, kind="stable")
    ordered = np.take_along_axis(values, order, axis=1)
    position = np.empty_like(order)
    np.put_along_axis(position, order, np.broadcast_to(np.arange(n), (rows, n)), axis=1)
    remaining = n - 1

    def kth_of_rest(k: int) -> FloatArray:
        index = np.where(position > k, k, k + 1)
        picked: FloatArray = np.take_along_axis(ordered, index, axis=1)
        return picked

    if remaining % 2 == 1:
        return kth_of_rest(remaining // 2)
    return 0.5 * (kth_of_rest(remaining // 2 - 1) + kth_of_rest(remaining // 2))


def residual_comm(phases: FloatArray, prev_opt: FloatArray | None) -> FloatArray:
    """Each rank's comm wait minus the part explained by peers that became ready later.

    A rank is ready for the all-reduce after its previous optimizer step (which delays the
    start of this step), its data wait and its compute. Under a blocking all-reduce a rank
    waits ``max(ready) - ready[i]`` for the latest peer; what it waits beyond that is its own.
    ``prev_opt`` is the previous step's optimizer time per rank; the current one stands in
    for it on the first step after a (re)start.
    """
    opt = phases[_OPT] if prev_opt is None else prev_opt
    ready = opt + phases[_DATA] + phases[_COMPUTE]
    explained = ready.max() - ready
    residual: FloatArray = phases[_COMM] - explained
    return residual


class StragglerDetector:
    """Rolling, per-phase, cross-rank straggler verdicts for one job generation.

    Feed it with :meth:`observe` (step records, any order, batched) or :meth:`observe_frame`
    (one complete step as columns); both return the verdict changes of the steps they
    completed. :meth:`active` lists the current suspects and confirmed stragglers. Call
    :meth:`reset` when a new generation starts (ranks may have moved or changed in number).
    """

    def __init__(
        self, world_size: int, settings: StragglerSettings | None = None, *, start_step: int = 0
    ) -> None:
        self._settings = settings if settings is not None else StragglerSettings()
        self.dropped_records = 0
        """Records ignored: older than the last judged step, or of steps never completed."""
        self._init_state(world_size, start_step)

    # -- public API ------------------------------------------------------------------------

    @property
    def settings(self) -> StragglerSettings:
        return self._settings

    @property
    def world_size(self) -> int:
        return self._n

    @property
    def last_step(self) -> int | None:
        """The last step judged or skipped as warm-up, None before the first."""
        return self._last_step

    def update_settings(self, **changes: Any) -> list[Diagnosis]:
        """Change thresholds while the job runs; returns verdicts cleared by the change.

        The vote history is kept: a longer window starts with the steps already seen, a
        shorter one keeps the most recent. Phases no longer judged are cleared.
        """
        new = dataclasses.replace(self._settings, **changes)
        old = self._settings
        self._settings = new
        if new.window != old.window:
            self._resize_window(new.window)
        dropped = [i for i, p in enumerate(PHASES) if p not in new.phases]
        events: list[Diagnosis] = []
        for pi in dropped:
            if self._last_step is not None:
                for rank in np.flatnonzero(self._state[pi] > 0):
                    events.append(self._diagnose(pi, int(rank), Verdict.CLEARED, self._last_step))
            self._state[pi] = 0
            self._votes[:, pi] = False
            self._count[pi] = 0
            self._run_start[pi] = -1
        return events

    def reset(self, world_size: int, *, start_step: int = 0) -> list[Diagnosis]:
        """Start a new generation: forget all history; warm-up begins again.

        Returns a cleared verdict for each pair that was active, so listeners can close it.
        Records of steps below ``start_step`` are ignored from now on; records of the old
        generation at later steps are the engine's to filter (it knows the generation).
        """
        events: list[Diagnosis] = []
        if self._last_step is not None:
            for pi, rank in zip(*np.nonzero(self._state > 0), strict=True):
                events.append(
                    self._diagnose(int(pi), int(rank), Verdict.CLEARED, self._last_step)
                )
        self._init_state(world_size, start_step)
        return events

    def observe(self, records: Iterable[StepRecord]) -> list[Diagnosis]:
        """Take step records of any ranks and steps; judge every step that is now complete."""
        for record in records:
            if record.rank >= self._n:
                raise ValueError(
                    f"step record of rank {record.rank} but the detector has world_size "
                    f"{self._n}: call reset(world_size=...) when a new generation starts"
                )
            floor = self._start_step if self._last_step is None else self._last_step + 1
            if record.step < floor:
                self.dropped_records += 1
                continue
            self._pending.setdefault(record.step, {})[record.rank] = record
        events: list[Diagnosis] = []
        complete = sorted(s for s, recs in self._pending.items() if len(recs) == self._n)
        for step in complete:
            for older in [s for s in self._pending if s < step]:
                self.dropped_records += len(self._pending.pop(older))
            frame = StepFrame.from_records(list(self._pending.pop(step).values()))
            events.extend(self._judge(frame))
        while len(self._pending) > _MAX_PENDING_STEPS:
            self.dropped_records += len(self._pending.pop(min(self._pending)))
        return events

    def observe_frame(self, frame: StepFrame) -> list[Diagnosis]:
        """Judge one complete step given as columns; steps must come in increasing order."""
        if frame.world_size != self._n:
            raise ValueError(
                f"frame of step {frame.step} has {frame.world_size} ranks but the detector has "
                f"world_size {self._n}: call reset(world_size=...) when a new generation starts"
            )
        if frame.step < self._start_step or (
            self._last_step is not None and frame.step <= self._last_step
        ):
            raise ValueError(
                f"frame of step {frame.step} arrived after step {self._last_step} was judged: "
                "feed frames in increasing step order"
            )
        return self._judge(frame)

    def active(self) -> list[Diagnosis]:
        """Current suspects and confirmed stragglers, by rank then phase."""
        if self._last_step is None:
            return []
        out = []
        for rank in range(self._n):
            for pi in range(len(PHASES)):
                state = int(self._state[pi, rank])
                if state > 0:
                    verdict = Verdict.SUSPECT if state == 1 else Verdict.CONFIRMED
                    out.append(self._diagnose(pi, rank, verdict, self._last_step))
        return out

    # -- internals ---------------------------------------------------------------------------

    def _init_state(self, world_size: int, start_step: int) -> None:
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        n, p, w = world_size, len(PHASES), self._settings.window
        self._n = n
        self._start_step = start_step
        self._last_step: int | None = None
        self._judged = 0  # steps seen since (re)start, warm-up included
        self._pending: dict[int, dict[int, StepRecord]] = {}
        self._prev_opt: FloatArray | None = None
        self._pos = 0
        self._votes: BoolArray = np.zeros((w, p, n), dtype=bool)
        self._ratios: FloatArray = np.full((w, p, n), np.nan)
        self._excess: FloatArray = np.full((w, p, n), np.nan)
        self._count: IntArray = np.zeros((p, n), dtype=np.int64)
        self._state: npt.NDArray[np.int8] = np.zeros((p, n), dtype=np.int8)
        self._age: IntArray = np.zeros((p, n), dtype=np.int64)
        self._run_start: IntArray = np.full((p, n), -1, dtype=np.int64)
        self._since: IntArray = np.full((p, n), -1, dtype=np.int64)
        self._step_ring: FloatArray = np.full(w, np.nan)  # median step time of recent steps
        self._median_step_s = 0.0

    def _resize_window(self, w: int) -> None:
        def chrono(ring: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return np.roll(ring, -self._pos, axis=0)

        keep = min(w, self._votes.shape[0])
        rings = (self._votes, self._ratios, self._excess)
        votes, ratios, excess = (chrono(ring)[-keep:] for ring in rings)
        p, n = self._count.shape
        self._votes = np.zeros((w, p, n), dtype=bool)
        self._ratios = np.full((w, p, n), np.nan)
        self._excess = np.full((w, p, n), np.nan)
        self._votes[:keep], self._ratios[:keep], self._excess[:keep] = votes, ratios, excess
        self._pos = keep % w
        self._count = self._votes.sum(axis=0).astype(np.int64)

    def _slow_steps(self, frame: StepFrame) -> tuple[BoolArray, FloatArray, FloatArray]:
        """Per (phase, rank) of one step: slow or not, ratio and excess over the peers."""
        s = self._settings
        values = frame.phases.copy()
        values[_COMM] = residual_comm(frame.phases, self._prev_opt)
        reference = leave_one_out_median(values)
        excess = values - reference
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(reference > 0.0, values / reference, np.inf)
        floor = max(s.min_excess_s, s.min_step_share * self._median_step_s)
        slow = (excess >= (s.ratio - 1.0) * np.maximum(reference, 0.0)) & (excess >= floor)
        if self._n >= 3:
            centre = np.median(values, axis=1, keepdims=True)
            mad = np.median(np.abs(values - centre), axis=1, keepdims=True)
            slow &= excess >= s.min_z * _MAD_TO_SIGMA * mad
        watched = np.array([[p in s.phases] for p in PHASES])
        slow &= watched
        return slow, ratio, excess

    def _judge(self, frame: StepFrame) -> list[Diagnosis]:
        s = self._settings
        step = frame.step
        self._last_step = step
        self._judged += 1
        self._step_ring[self._judged % self._step_ring.size] = float(np.median(frame.step_s))
        self._median_step_s = float(np.nanmedian(self._step_ring))
        judged = self._judged > s.warmup_steps and self._n >= 2
        if judged:
            slow, ratio, excess = self._slow_steps(frame)  # uses the previous step's opt
        self._prev_opt = frame.phases[_OPT].copy()
        if not judged:
            return []

        w = self._votes.shape[0]
        self._count += slow.astype(np.int64) - self._votes[self._pos]
        self._votes[self._pos] = slow
        self._ratios[self._pos] = ratio
        self._excess[self._pos] = excess
        self._pos = (self._pos + 1) % w

        starting = slow & (self._run_start < 0)
        self._run_start[starting] = step
        self._run_start[self._count == 0] = -1

        state = self._state
        cleared = (state > 0) & (self._count <= s.clear_votes)
        state[cleared] = 0
        suspect = (state == 0) & (self._count >= s.suspect_votes)
        state[suspect] = 1
        self._age[suspect] = 0
        started = self._run_start[suspect]
        self._since[suspect] = np.where(started >= 0, started, step)
        self._age[state > 0] += 1
        confirmed = (state == 1) & (self._age > s.confirm_steps)
        state[confirmed] = 2

        events: list[Diagnosis] = []
        for verdict, mask in (
            (Verdict.CLEARED, cleared),
            (Verdict.SUSPECT, suspect & ~confirmed),
            (Verdict.CONFIRMED, confirmed),
        ):
            if mask.any():
                for pi, rank in zip(*np.nonzero(mask), strict=True):
                    events.append(self._diagnose(int(pi), int(rank), verdict, step))
        events.sort(key=lambda d: (d.step, d.rank, PHASES.index(d.phase)))
        return events

    def _diagnose(self, pi: int, rank: int, verdict: Verdict, step: int) -> Diagnosis:
        ratios = self._ratios[:, pi, rank]
        excess = self._excess[:, pi, rank]
        ratios, excess = ratios[~np.isnan(ratios)], excess[~np.isnan(excess)]
        ratio = float(np.median(ratios)) if ratios.size else float("nan")
        excess_s = float(np.median(excess)) if excess.size else float("nan")
        share = excess_s / self._median_step_s if self._median_step_s > 0 else float("nan")
        since = int(self._since[pi, rank])
        phase = PHASES[pi]
        return Diagnosis(
            rank=rank,
            phase=phase,
            state=verdict,
            step=step,
            since_step=since if since >= 0 else step,
            ratio=ratio,
            excess_s=excess_s,
            step_share=share,
            slow_steps=int(self._count[pi, rank]),
            window=int(self._votes.shape[0]),
            hint=HINTS[phase],
        )


__all__ = [
    "HINTS",
    "Diagnosis",
    "StragglerDetector",
    "StragglerSettings",
    "Verdict",
    "leave_one_out_median",
    "residual_comm",
]
