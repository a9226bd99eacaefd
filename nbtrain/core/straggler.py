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
3. Per (rank, phase) a rolling vote over the last ``window`` steps: *suspect* (the early
   signal) when at least ``suspect_votes`` of them were slow, *cleared* when the count falls
   to ``clear_votes`` or fewer. A transient spike that hits fewer than ``suspect_votes`` of
   ``window`` steps cannot make a rank suspect, whatever its size: spikes are ignored by
   construction, not by tuning a magnitude. The gap between the suspect and clear counts is
   hysteresis, so a rank hovering near the threshold does not flap.
4. *Confirmed* (what is worth acting on) follows what the slow rank costs the job over a
   window, measured against the job's own noise rather than a fixed ratio
   (:mod:`nbtrain.core.stragglercost`): every block of ``window`` steps among the last
   ``confirm_steps`` cost at least ``confirm_share`` of a step on average and ``confirm_z``
   times the job's noise as it was when the slowdown began, and the slowdown has lasted
   ``confirm_s`` seconds. It needs no unbroken run of slow steps: a rank that alternates
   fast and slow steps counts by its mean. It is *cleared* only when the cost is gone (the
   mean excess over the last ``confirm_steps`` below ``clear_share`` of a step), not by a
   few fast steps. On a quiet machine the noise is small and a steady 1.3x is confirmed; on
   a busy one, where other processes come and go and slow one rank and then another for a
   second or two, it is large, and only a slowdown well beyond those is.
5. The first ``warmup_steps`` steps after each (re)start are not judged (compilation, cache
   warm-up and the first all-reduce make them slow for reasons that pass).

The detector reads no clock and keeps no threads: the same object runs in the engine (fed by
the event plane), the simulator and the benchmark.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from nbtrain.core.records import PHASES, FloatArray, Phase, StepFrame, StepRecord
from nbtrain.core.stragglercost import CostJudge, regrow, trimmed_mean

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


#: Most steps any window of the detector may span: its rings hold that many steps per rank
#: and phase, so a setting sent by a client must not make it allocate without bound.
HISTORY_STEPS_MAX = 4096


@dataclass(frozen=True, kw_only=True)
class StragglerSettings:
    """Thresholds of the detector; change them on a running job with ``update_settings``.

    Defaults make a rank *suspect* (the early signal) when one phase is 1.2x its peers on 6
    of 8 steps, and *confirm* it when, in each quarter of the last 32 steps, it cost the job
    on average at least 10% of a step and 4x the job's own noise in that phase (or, over the
    last 64 steps, 10% of a step and 2x the noise in every block), for at least a second of
    training; it is cleared when it costs under 5% over the last 32 steps. Spikes
    of any size on fewer than 6 of 8 steps never make a suspect.
    """

    ratio: float = 1.2
    """A phase is slow on a step at >= ratio x the other ranks' median. Lower it to catch
    milder stragglers; keep it above the cross-rank noise of your phase times."""
    window: int = 8
    """Steps in the rolling vote. Longer windows tolerate longer transients and react later."""
    suspect_votes: int = 6
    """Slow steps among the last ``window`` that make a (rank, phase) suspect."""
    clear_votes: int = 2
    """A suspect pair is cleared when its slow steps in the window fall to this many or
    fewer (a confirmed one only when its cost is gone: ``clear_share``)."""
    confirm_steps: int = 32
    """Steps of evidence a confirmed verdict (the one mitigation acts on) rests on: the last
    ``confirm_steps`` steps, in blocks of ``window``. Longer is steadier and later; it should
    cover a few times the longest pause you consider normal (a checkpoint, an evaluation)."""
    confirm_share: float = 0.10
    """A pair is confirmed when, in every block of ``window`` steps among the last
    ``confirm_steps``, its mean excess over the peers is at least this share of the median
    step time: the job would run that much faster without the slow rank. A mean, so a rank
    that alternates fast and slow steps counts by what it costs. Lower it to confirm
    stragglers that cost the job less."""
    confirm_z: float = 4.0
    """...and at least this many times the job's own noise in the phase: how much the mean
    excess of a rank over its peers (over the vote window) wanders in this job, or the peers'
    own mean time in the phase does (weighted 1.5), whichever is larger, as 1.4826 x the MAD
    over the ``noise_steps`` steps before the evidence, taken when the slowdown began. A job
    on a busy machine or shared host, whose load comes and goes and slows one rank and then
    another, needs a larger slowdown to be confirmed than a job on a quiet one."""
    clear_share: float = 0.05
    """A confirmed pair is cleared when its mean excess over the last ``confirm_steps`` steps
    falls below this share of the median step time (or below ``confirm_share``, if that is
    lower): the cost is gone, not one step fast. The gap to ``confirm_share`` is hysteresis."""
    sustain_steps: int = 64
    """...or, where the noise bar is too high for that (a busy machine), when the cost lasted
    this many steps: every block of ``window`` steps among the last ``sustain_steps`` cost at
    least ``confirm_share`` of a step and ``sustain_z`` times the noise. A load that comes
    and goes slows one rank and then another; a slow rank stays slow. 0: off."""
    sustain_z: float = 2.0
    """The noise multiple of the ``sustain_steps`` path."""
    confirm_s: float = 1.0
    """...and only once its slowdown has lasted this many seconds of training (step times
    summed since it began): with fast steps, tens of steps pass in a fraction of a second,
    and a slowdown that short costs the job less than the attention it asks for."""
    noise_steps: int = 256
    """Steps over which the job's noise per phase is measured (the most recent ones before
    the confirmation evidence)."""
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
        problems = [*self._size_problems(), *self._vote_problems(), *self._confirm_problems(),
                    *self._floor_problems()]
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

    def _size_problems(self) -> list[str]:
        return [f"{name} must be at most {HISTORY_STEPS_MAX} steps (the detector keeps that "
                f"many steps per rank and phase), got {value!r}"
                for name, value in (("window", self.window),
                                    ("confirm_steps", self.confirm_steps),
                                    ("sustain_steps", self.sustain_steps),
                                    ("noise_steps", self.noise_steps),
                                    ("warmup_steps", self.warmup_steps))
                if isinstance(value, int) and value > HISTORY_STEPS_MAX]

    def _vote_problems(self) -> list[str]:
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
        return problems

    def _confirm_problems(self) -> list[str]:
        problems: list[str] = []
        if not (isinstance(self.confirm_steps, int) and self.confirm_steps >= 1):
            problems.append(f"confirm_steps must be an integer >= 1, got {self.confirm_steps!r}")
        if not 0.0 <= self.confirm_share < 1.0:
            problems.append(f"confirm_share must be in [0, 1), got {self.confirm_share!r}")
        if not 0.0 <= self.clear_share < 1.0:
            problems.append(f"clear_share must be in [0, 1), got {self.clear_share!r} "
                            "(e.g. half of confirm_share)")
        if not self.confirm_z >= 0.0:
            problems.append(f"confirm_z must be >= 0, got {self.confirm_z!r}")
        if not (isinstance(self.sustain_steps, int) and self.sustain_steps >= 0):
            problems.append(f"sustain_steps must be an integer >= 0 (0: off), "
                            f"got {self.sustain_steps!r}")
        if not self.sustain_z >= 0.0:
            problems.append(f"sustain_z must be >= 0, got {self.sustain_z!r}")
        if not self.confirm_s >= 0.0:
            problems.append(f"confirm_s must be >= 0 seconds, got {self.confirm_s!r}")
        return problems

    def _floor_problems(self) -> list[str]:
        problems: list[str] = []
        if not (isinstance(self.noise_steps, int) and self.noise_steps >= 2):
            problems.append(f"noise_steps must be an integer >= 2, got {self.noise_steps!r}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            problems.append(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not self.min_excess_s >= 0.0:
            problems.append(f"min_excess_s must be >= 0 seconds, got {self.min_excess_s!r}")
        if not 0.0 <= self.min_step_share < 1.0:
            problems.append(f"min_step_share must be in [0, 1), got {self.min_step_share!r}")
        if not self.min_z >= 0.0:
            problems.append(f"min_z must be >= 0, got {self.min_z!r}")
        return problems


_LEVELS = {"suspect": "warning", "confirmed": "critical", "cleared": "info"}
_NEAR_ZERO_S = 5e-5  # peers' phase time below this: a ratio to it says nothing


def ratio_text(ratio: float | None, peer_s: float | None) -> str:
    """How a rank compares with its peers, for people: "2.05x its peers", or, when the peers
    spend (about) no time in the phase and a ratio would be huge or infinite, "peers ~0 ms"."""
    return f"{ratio:.2f}x its peers" if _telling(ratio, peer_s) else "peers ~0 ms"


def _telling(ratio: float | None, peer_s: float | None) -> bool:
    """Does the ratio to the peers say something (finite, peers not about idle)?"""
    peers_idle = peer_s is not None and math.isfinite(peer_s) and peer_s < _NEAR_ZERO_S
    return ratio is not None and math.isfinite(ratio) and not peers_idle


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """Which rank is slow, in which phase, by how much, since when, and a likely cause.

    ``ratio``, ``excess_s`` and ``peer_s`` are medians over the evidence (the vote window for
    suspect and cleared verdicts, the last ``confirm_steps`` steps for confirmed ones), so one
    spike does not distort them; ``ratio`` is NaN when the peers spend about no time in the
    phase. ``step_share`` (excess over the median step time) is about how much the whole job
    slows down because of this rank; ``noise_s`` is the job's noise in the phase that a
    confirmation is measured against (see ``StragglerSettings.confirm_z``). For ``comm`` they
    describe the residual
    wait (the wait not explained by later peers), not the raw one. ``nvml`` is attached by
    the engine on GPUs (clocks, temperature, power); the detector never fills it.
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
    peer_s: float = float("nan")
    noise_s: float = float("nan")
    nvml: Mapping[str, float] | None = field(default=None, compare=False)

    @property
    def level(self) -> str:
        """How loudly to tell: "critical" (confirmed: worth acting on), "warning" (suspect:
        the early signal, shown on demand) or "info" (cleared)."""
        return _LEVELS[self.state.value]

    def with_nvml(self, readings: Mapping[str, float], hint: str | None = None) -> Diagnosis:
        """A copy with device readings attached (on GPUs), and the hint they point to."""
        return dataclasses.replace(self, nvml=dict(readings), hint=hint or self.hint)

    def summary(self) -> str:
        """One line for an alert list or a log."""
        compared = ratio_text(self.ratio, self.peer_s)
        if self.state is Verdict.CLEARED:
            now = f"; now {compared}" if _telling(self.ratio, self.peer_s) else ""
            return (
                f"rank {self.rank} {self.phase.value}: cleared at step {self.step} "
                f"(was slow since step {self.since_step}{now})"
            )
        noise = (
            f", {self.excess_s / self.noise_s:.1f}x the job's noise"
            if self.state is Verdict.CONFIRMED and self.noise_s > 0 else ""
        )
        return (
            f"rank {self.rank} {self.phase.value} {self.state.value}: {compared} "
            f"(+{self.excess_s * 1e3:.1f} ms/step, {_finite(self.step_share):.0%} of a step"
            f"{noise}) since step {self.since_step}; {self.slow_steps}/{self.window} recent "
            f"steps slow. Likely {self.hint}"
        )

    def to_event(self) -> dict[str, Any]:
        """A plain dict for the event plane and the notebook (JSON-friendly: no NaN or
        infinity; a ratio that says nothing is None)."""
        return {
            "topic": "straggler",
            "rank": self.rank,
            "phase": self.phase.value,
            "state": self.state.value,
            "level": self.level,
            "step": self.step,
            "since_step": self.since_step,
            "ratio": self.ratio if _telling(self.ratio, self.peer_s) else None,
            "excess_s": _json_float(self.excess_s),
            "peer_s": _json_float(self.peer_s),
            "noise_s": _json_float(self.noise_s),
            "step_share": _json_float(self.step_share),
            "slow_steps": self.slow_steps,
            "window": self.window,
            "hint": self.hint,
            "nvml": dict(self.nvml) if self.nvml is not None else None,
            "summary": self.summary(),
        }


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _json_float(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def median0(values: FloatArray) -> FloatArray:
    """``np.median(values, axis=0)``, bit for bit (NaN where a column holds one; NaN for no
    rows), at a third of its cost on the small windows the detector judges every step."""
    n = values.shape[0]
    if n == 0:
        out: FloatArray = np.full(values.shape[1:], np.nan)
        return out
    ordered = np.sort(values, axis=0)
    m = n // 2
    mid: FloatArray = ordered[m] if n % 2 else (ordered[m - 1] + ordered[m]) / 2
    gaps = np.isnan(ordered[-1])  # NaN sorts last: a column with one has it there
    if gaps.any():
        mid = np.where(gaps, np.nan, mid)
    return mid


def leave_one_out_median(values: FloatArray) -> FloatArray:
    """For each column i of each row, the median of that row without column i.

    ``values`` has shape (rows, n) with n >= 2. O(n log n) per row via one sort: removing the
    element at sorted position p shifts the order statistics above p down by one.
    """
    rows, n = values.shape
    if n < 2:
        raise ValueError(f"leave_one_out_median needs at least 2 columns, got {n}")
    if n == 2:  # without one of two columns, the median is the other one
        pair: FloatArray = values[:, ::-1].copy()
        return pair
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

    def noise_s(self) -> dict[Phase, float]:
        """The job's current noise per phase (seconds; 0 until measured): what ``confirm_z``
        multiplies."""
        sigma = self._cost.noise()
        return {p: float(sigma[i]) for i, p in enumerate(PHASES)}

    def update_settings(self, **changes: Any) -> list[Diagnosis]:
        """Change thresholds while the job runs; returns verdicts cleared by the change.

        The vote and noise history is kept: longer windows start with the steps already
        seen, shorter ones keep the most recent. Phases no longer judged are cleared.
        """
        new = dataclasses.replace(self._settings, **changes)
        old = self._settings
        self._settings = new
        if _ring_len(new) != _ring_len(old):
            self._resize_rings(_ring_len(new))
        self._cost.update_settings(new)
        self._watched = _watched(new)
        dropped = [i for i, p in enumerate(PHASES) if p not in new.phases]
        events: list[Diagnosis] = []
        for pi in dropped:
            if self._last_step is not None:
                for rank in np.flatnonzero(self._state[pi] > 0):
                    events.append(self._diagnose(pi, int(rank), Verdict.CLEARED, self._last_step))
            self._state[pi] = 0
            self._votes[:, pi] = False
            self._run_start[pi] = -1
            self._run_s[pi] = 0.0
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
    #
    # Per step and (phase, rank) the rings hold the slow vote, the excess over the peers and
    # the peers' median, with each step's median time, for the last max(window,
    # confirm_steps) steps; ``_pos`` is where the next step goes. The level ring holds, per
    # step and (phase, rank), the median excess over the vote window: how much slower than
    # its peers the rank was lately. How much that level wanders in a job is the job's noise.

    def _init_state(self, world_size: int, start_step: int) -> None:
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        n, p, r = world_size, len(PHASES), _ring_len(self._settings)
        self._n = n
        self._start_step = start_step
        self._last_step: int | None = None
        self._judged = 0  # steps seen since (re)start, warm-up included
        self._pending: dict[int, dict[int, StepRecord]] = {}
        self._prev_opt: FloatArray | None = None
        self._pos = 0
        self._votes: BoolArray = np.zeros((r, p, n), dtype=bool)
        self._excess: FloatArray = np.full((r, p, n), np.nan)
        self._reference: FloatArray = np.full((r, p, n), np.nan)
        self._steps_s: FloatArray = np.full(r, np.nan)  # median step time of each step
        self._state: npt.NDArray[np.int8] = np.zeros((p, n), dtype=np.int8)
        self._run_start: IntArray = np.full((p, n), -1, dtype=np.int64)
        self._run_s: FloatArray = np.zeros((p, n))  # training seconds since the run began
        self._since: IntArray = np.full((p, n), -1, dtype=np.int64)
        self._cost = CostJudge(self._settings, n)
        self._median_step_s = 0.0
        self._watched = _watched(self._settings)

    def _resize_rings(self, r: int) -> None:
        pos = self._pos
        self._votes, _ = regrow(self._votes, pos, r, False)
        self._excess, _ = regrow(self._excess, pos, r, np.nan)
        self._reference, _ = regrow(self._reference, pos, r, np.nan)
        self._steps_s, self._pos = regrow(self._steps_s, pos, r, np.nan)

    def _recent(self, k: int) -> IntArray:
        """Ring positions of the last ``k`` judged steps (fewer if the ring is shorter)."""
        r = self._votes.shape[0]
        positions: IntArray = (self._pos - 1 - np.arange(min(k, r), dtype=np.int64)) % r
        return positions

    def _slow_steps(self, frame: StepFrame) -> tuple[BoolArray, FloatArray, FloatArray]:
        """Per (phase, rank) of one step: slow or not, excess over the peers and the peers'
        median."""
        s = self._settings
        values = frame.phases.copy()
        values[_COMM] = residual_comm(frame.phases, self._prev_opt)
        reference = leave_one_out_median(values)
        excess = values - reference
        floor = max(s.min_excess_s, s.min_step_share * self._median_step_s)
        slow = (excess >= (s.ratio - 1.0) * np.maximum(reference, 0.0)) & (excess >= floor)
        if self._n >= 3:
            centre = median0(values.T)[:, None]  # np.median over the ranks, bit for bit
            mad = median0(np.abs(values - centre).T)[:, None]
            slow &= excess >= s.min_z * _MAD_TO_SIGMA * mad
        slow &= self._watched
        return slow, excess, reference

    def _judge(self, frame: StepFrame) -> list[Diagnosis]:
        s = self._settings
        step = frame.step
        self._last_step = step
        self._judged += 1
        judged = self._judged > s.warmup_steps and self._n >= 2
        if judged:
            slow, excess, reference = self._slow_steps(frame)  # uses the previous step's opt
        self._prev_opt = frame.phases[_OPT].copy()
        if not judged:
            return []

        r = self._votes.shape[0]
        step_s = float(median0(frame.step_s))
        self._votes[self._pos] = slow
        self._excess[self._pos] = excess
        self._reference[self._pos] = reference
        self._steps_s[self._pos] = step_s
        self._pos = (self._pos + 1) % r
        recent = self._recent(min(s.window, self._judged - s.warmup_steps))
        steps_s = self._steps_s[recent]
        self._median_step_s = float(median0(steps_s[~np.isnan(steps_s)]))
        # a mean that is NaN where a column has a gap (a ring grown by a settings change):
        # the noise skips such a level
        self._cost.record(trimmed_mean(self._excess[recent]),
                          trimmed_mean(self._reference[recent]))
        count = self._votes[recent].sum(axis=0)

        starting = slow & (self._run_start < 0)
        self._run_start[starting] = step
        self._run_s[starting] = 0.0
        self._cost.freeze(starting)  # judged against the noise from before it began
        self._run_start[count == 0] = -1
        self._run_s[self._run_start >= 0] += step_s

        state = self._state
        if self._nothing_to_decide(count):
            return []
        evidence = self._recent(s.confirm_steps)
        excess = self._excess[evidence[::-1]]  # oldest first
        evidence_s = float(median0(self._steps_s[evidence]))
        cleared = ((state == 1) & (count <= s.clear_votes)) | self._cost.clear(
            state == 2, excess, evidence_s)
        state[cleared] = 0
        suspect = (state == 0) & (count >= s.suspect_votes)
        state[suspect] = 1
        started = self._run_start[suspect]
        self._since[suspect] = np.where(started >= 0, started, step)
        candidates = (state < 2) & ~cleared & self._watched & (self._run_s >= s.confirm_s)
        # the lasting path's evidence, copied out of the ring only when someone may use it
        long_excess = (self._excess[self._recent(s.sustain_steps)[::-1]]
                       if s.sustain_steps > s.confirm_steps and candidates.any() else None)
        confirmed = self._cost.confirm(candidates, excess, evidence_s, sustained=long_excess)
        unannounced = confirmed & (state == 0)  # confirmed before it was ever suspect
        started = self._run_start[unannounced]
        self._since[unannounced] = np.where(started >= 0, started, step)
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

    def _nothing_to_decide(self, count: IntArray) -> bool:
        """The common step (on a healthy job, almost every one): no pair is suspect or
        confirmed, none becomes suspect (``count``: its slow steps in the vote window), and
        none has been slow long enough to be confirmed. The clear, suspect and confirm rules
        would then change nothing, so the step skips reading their evidence (a third of a
        judged step's cost at 2 ranks, a sixth at 64)."""
        s = self._settings
        return not (self._state.any() or (count >= s.suspect_votes).any()
                    or (self._watched & (self._run_s >= s.confirm_s)).any())

    def _diagnose(self, pi: int, rank: int, verdict: Verdict, step: int) -> Diagnosis:
        s = self._settings
        span = s.confirm_steps if verdict is Verdict.CONFIRMED else s.window
        recent = self._recent(span)
        excess = self._excess[recent, pi, rank]
        reference = self._reference[recent, pi, rank]
        seen = ~np.isnan(excess)
        excess_s = float(np.median(excess[seen])) if seen.any() else float("nan")
        peer_s = float(np.median(reference[seen])) if seen.any() else float("nan")
        ratio = (peer_s + excess_s) / peer_s if peer_s >= _NEAR_ZERO_S else float("nan")
        step_s = self._steps_s[recent]
        median_step = float(np.nanmedian(step_s)) if (~np.isnan(step_s)).any() else 0.0
        share = excess_s / median_step if median_step > 0 else float("nan")
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
            slow_steps=int(self._votes[recent, pi, rank].sum()),
            window=int(recent.size),
            hint=HINTS[phase],
            peer_s=peer_s,
            noise_s=float(self._cost.bar()[pi, rank] if verdict is Verdict.CONFIRMED
                          else self._cost.noise()[pi]),
        )


def _watched(s: StragglerSettings) -> BoolArray:
    """Per (phase, 1): whether the phase is judged (broadcasts over the ranks)."""
    return np.array([[p in s.phases] for p in PHASES])


def _ring_len(s: StragglerSettings) -> int:
    return max(s.window, s.confirm_steps, s.sustain_steps)


__all__ = [
    "HINTS",
    "Diagnosis",
    "StragglerDetector",
    "StragglerSettings",
    "Verdict",
    "leave_one_out_median",
    "ratio_text",
    "residual_comm",
]
