"""When to checkpoint (pure): every N steps, every T seconds, on demand, or auto (Young/Daly).

The rank loop asks ``due(step, now)`` at each step boundary and calls ``record(...)`` when it
took a checkpoint. The clock is the caller's: ``now`` is any monotonic time in seconds, so the
simulator and the tests drive the policy with no clock reads.

``auto`` uses the Young/Daly first-order optimum ``interval = sqrt(2 * C * MTBF)``: checkpoint
too often and the blocking cost ``C`` eats the run, too rarely and a failure loses up to one
interval of work. ``C`` is measured (the training loop's stall per checkpoint: waiting for the
previous persist plus the host snapshot), smoothed with an exponential moving average, and the
interval is recomputed every time a new measurement arrives. MTBF is configured, or fed in by
the engine from observed failures via ``set_mtbf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "DEFAULT_COMMIT_TIMEOUT_S",
    "PREEMPT_COMMIT_SHARE",
    "CheckpointPolicy",
    "CheckpointPolicyConfig",
    "parse_checkpoint_setting",
    "preemption_commit_s",
    "young_daly_interval",
]

DEFAULT_MTBF_S = 6 * 3600.0
#: How long rank 0 waits for every rank's shard before a checkpoint is marked failed: the
#: one default of ``Settings.checkpoint_commit_timeout_s``, the launch's plan and storage.
#: Longer than the slowest rank's write of one shard. A preempted job's final commit waits at
#: most ``preemption_commit_s`` of it, which fits inside the preemption grace.
DEFAULT_COMMIT_TIMEOUT_S = 100.0
#: Share of the preemption grace a preempted job's final checkpoint may take to persist and
#: commit. The rest is for the ranks to exit before the controller stops them, so the commit
#: fails cleanly (and the job resumes from its previous checkpoint, uncharged) instead of being
#: cut off mid-write.
PREEMPT_COMMIT_SHARE = 0.75


def preemption_commit_s(commit_timeout_s: float, preempt_grace_s: float) -> float:
    """How long a preempted (or resized) job's final checkpoint may take: the commit timeout,
    capped at ``PREEMPT_COMMIT_SHARE`` of the grace, so the two timeouts are coherent whatever
    values they are set to (``Settings`` need not order them)."""
    return max(0.1, min(commit_timeout_s, PREEMPT_COMMIT_SHARE * preempt_grace_s))


#: Added to a stop's two commit waits for the ranks to reach a step boundary and exit.
STOP_MARGIN_S = 100.0


def stop_grace_s(commit_timeout_s: float, configured: float = 0.0) -> float:
    """How long a stopped job's ranks get before they are stopped: ``configured`` if set
    (> 0), else room for the checkpoint in flight and the final one to wait out their
    commits, plus ``STOP_MARGIN_S`` (300 s at the default commit timeout)."""
    return configured if configured > 0 else 2 * commit_timeout_s + STOP_MARGIN_S


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly optimal time between checkpoints: ``sqrt(2 * cost_s * mtbf_s)``."""
    if not (math.isfinite(cost_s) and cost_s >= 0):
        raise ValueError(f"checkpoint cost must be a finite number of seconds >= 0, got {cost_s!r}")
    if not (math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ValueError(f"MTBF must be a finite number of seconds > 0, got {mtbf_s!r}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def _positive(name: str, value: float | None, fix: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}: {fix}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}: {fix}")


@dataclass(frozen=True, kw_only=True)
class CheckpointPolicyConfig:
    """Which triggers are on. Any combination; none at all means on demand and on stop only.

    every_steps: checkpoint at step multiples of this (aligned to multiples, so a resumed run
        checkpoints at the same steps as an uninterrupted one).
    every_seconds: checkpoint when this much time has passed since the last one.
    auto: Young/Daly interval from the measured blocking cost and ``mtbf_s``.
    mtbf_s: mean time between failures of the whole job (not one node), in seconds.
    smoothing: weight of the newest cost measurement in the moving average (0 < w <= 1);
        lower is steadier, higher follows changes faster.
    min_interval_s / max_interval_s: bounds on the auto interval; the floor keeps a tiny
        measured cost from checkpointing every step, the ceiling bounds the loss when the
        MTBF estimate is too optimistic.
    probe_after_steps: with ``auto`` and no cost measured yet, the first checkpoint is taken
        this many steps after the start, to measure ``C``.
    on_stop: whether ``stop()`` should take a final checkpoint (read by the rank loop).
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    auto: bool = False
    mtbf_s: float = DEFAULT_MTBF_S
    smoothing: float = 0.3
    min_interval_s: float = 1.0
    max_interval_s: float = 3600.0
    probe_after_steps: int = 1
    on_stop: bool = True

    def __post_init__(self) -> None:
        if self.every_steps is not None and (
            isinstance(self.every_steps, bool)
            or not isinstance(self.every_steps, int)
            or self.every_steps < 1
        ):
            raise ValueError(
                f"every_steps must be a positive integer, got {self.every_steps!r}: "
                "e.g. every_steps=100, or None to turn step-based checkpoints off"
            )
        _positive(
            "every_seconds", self.every_seconds, "e.g. every_seconds=600, or None to turn it off"
        )
        _positive("mtbf_s", self.mtbf_s, "pass the job's mean time between failures in seconds")
        _positive("min_interval_s", self.min_interval_s, "e.g. min_interval_s=1.0")
        _positive("max_interval_s", self.max_interval_s, "e.g. max_interval_s=3600.0")
        if self.min_interval_s > self.max_interval_s:
            raise ValueError(
                f"min_interval_s={self.min_interval_s} is above max_interval_s="
                f"{self.max_interval_s}: swap them or widen the range"
            )
        if not (0 < self.smoothing <= 1):
            raise ValueError(
                f"smoothing must be in (0, 1], got {self.smoothing!r}: 0.3 is a good default"
            )
        if (
            isinstance(self.probe_after_steps, bool)
            or not isinstance(self.probe_after_steps, int)
            or self.probe_after_steps < 1
        ):
            raise ValueError(
                f"probe_after_steps must be a positive integer, got {self.probe_after_steps!r}"
            )


def _seconds(text: str) -> float | None:
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    if t and t[-1] in units:
        try:
            return float(t[:-1]) * units[t[-1]]
        except ValueError:
            return None
    return None


def parse_checkpoint_setting(
    value: int | str | CheckpointPolicyConfig | None, *, mtbf_s: float = DEFAULT_MTBF_S
) -> CheckpointPolicyConfig:
    """Turn the user's ``submit(checkpoint=...)`` value into a config.

    ``None`` or ``"off"``: on demand and on stop only; an int ``N``: every N steps;
    ``"auto"``: Young/Daly; ``"90s"``, ``"10m"``, ``"1h"``: every that many seconds.
    """
    if value is None:
        return CheckpointPolicyConfig(mtbf_s=mtbf_s)
    if isinstance(value, CheckpointPolicyConfig):
        return value
    if isinstance(value, bool):
        raise ValueError(
            f"checkpoint={value!r} is ambiguous: use checkpoint='auto', an int number of "
            "steps, a duration like '10m', or None"
        )
    if isinstance(value, int):
        return CheckpointPolicyConfig(every_steps=value, mtbf_s=mtbf_s)
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return CheckpointPolicyConfig(auto=True, mtbf_s=mtbf_s)
        if value.strip().lower() == "off":
            return CheckpointPolicyConfig(mtbf_s=mtbf_s)
        seconds = _seconds(value)
        if seconds is not None:
            return CheckpointPolicyConfig(every_seconds=seconds, mtbf_s=mtbf_s)
    raise ValueError(
        f"checkpoint={value!r} is not understood: use 'auto', an int number of steps "
        "(e.g. 100), a duration ('90s', '10m', '1h'), 'off' or None"
    )


class CheckpointPolicy:
    """Answers ``due(step, now)`` at step boundaries; learns the blocking cost from ``record``.

    ``step`` counts completed steps. ``now`` is the caller's monotonic clock in seconds.
    """

    def __init__(self, config: CheckpointPolicyConfig, *, now: float, step: int = 0) -> None:
        self.config = config
        self._last_time = float(now)
        self._last_step = int(step)
        self._start_step = int(step)
        self._requested = False
        self._cost_s: float | None = None
        self._mtbf_s = config.mtbf_s
        self._every_steps = config.every_steps

    # -- inputs -------------------------------------------------------------------------------
    def request(self) -> None:
        """On demand (``job.checkpoint()``): the next step boundary is due."""
        self._requested = True

    def set_every_steps(self, every_steps: int | None) -> None:
        """Replace the step interval (the ``checkpoint_every`` knob; None or 0: off), in
        force from the next boundary; still aligned to its multiples."""
        if every_steps is not None and (isinstance(every_steps, bool)
                                        or not isinstance(every_steps, int) or every_steps < 0):
            raise ValueError(f"every_steps must be a whole number of steps >= 0, got "
                             f"{every_steps!r}")
        self._every_steps = every_steps or None

    @property
    def every_steps(self) -> int | None:
        """The step interval in force (None: no step-based checkpoints)."""
        return self._every_steps

    def set_mtbf(self, mtbf_s: float) -> None:
        """Replace the MTBF (e.g. observed by the engine); the auto interval follows."""
        _positive("mtbf_s", mtbf_s, "pass a mean time between failures in seconds")
        self._mtbf_s = float(mtbf_s)

    def record(self, step: int, now: float, cost_s: float | None = None) -> None:
        """A checkpoint was taken at ``step``; ``cost_s`` is the training stall it caused."""
        if cost_s is not None:
            if not (math.isfinite(cost_s) and cost_s >= 0):
                raise ValueError(f"cost_s must be a finite number >= 0, got {cost_s!r}")
            w = self.config.smoothing
            self._cost_s = cost_s if self._cost_s is None else w * cost_s + (1 - w) * self._cost_s
        self._last_step = int(step)
        self._last_time = float(now)
        self._requested = False

    # -- outputs ------------------------------------------------------------------------------
    @property
    def cost_s(self) -> float | None:
        """The smoothed blocking cost per checkpoint, None before the first measurement."""
        return self._cost_s

    @property
    def mtbf_s(self) -> float:
        return self._mtbf_s

    @property
    def interval_s(self) -> float | None:
        """The current time interval: auto's Young/Daly value, else every_seconds, else None."""
        if self.config.auto and self._cost_s is not None:
            raw = young_daly_interval(self._cost_s, self._mtbf_s)
            return min(max(raw, self.config.min_interval_s), self.config.max_interval_s)
        return self.config.every_seconds

    @property
    def last_step(self) -> int:
        return self._last_step

    def due(self, step: int, now: float) -> bool:
        """Whether to checkpoint at this step boundary. Never twice for the same step."""
        if step <= self._last_step:
            return False
        n = self._every_steps
        if n is not None and step >= (self._last_step // n + 1) * n:
            return True
        return self.time_due(step, now)

    def time_due(self, step: int, now: float) -> bool:
        """The time-based and auto part of :meth:`due`, and an on-demand request: what one
        rank can only offer to the others. The step interval is left out: every rank knows
        its multiples and acts on them at the same step (an interval changed live would
        otherwise make a multiple already passed look overdue, off the new grid)."""
        if step <= self._last_step:
            return False
        if self._requested:
            return True
        if self.config.auto and self._cost_s is None:
            return step >= self._start_step + self.config.probe_after_steps
        interval = self.interval_s
        if self.config.auto and self.config.every_seconds is not None and interval is not None:
            interval = min(interval, self.config.every_seconds)
        return interval is not None and now - self._last_time >= interval
