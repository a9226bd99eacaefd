"""The vocabulary of the gang scheduler: job requests, events in, decisions out (pure).

Everything here is a frozen dataclass, so a decision log can be hashed, compared and replayed.
Every event carries ``now`` (seconds, any epoch): the scheduler never reads a clock, which is
what lets the simulator replay a day in seconds and tests drive time by hand.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from nbtrain.core.placement import POLICIES, Layout, Placement

__all__ = [
    "SIZING",
    "Cancelled",
    "Checkpointed",
    "Decision",
    "Event",
    "Failed",
    "Finished",
    "JobRequest",
    "PreemptJob",
    "RejectJob",
    "Released",
    "ResizeJob",
    "ResizeRequested",
    "Resume",
    "SchedulerConfig",
    "StartJob",
    "StepTimes",
    "Submit",
    "Suspend",
    "Tick",
    "WorkersAdded",
    "WorkersForgotten",
    "WorkersRemoved",
]


@dataclass(frozen=True, kw_only=True)
class JobRequest:
    """What the scheduler needs to know about a job.

    ``size`` ranks are wanted; an elastic job (``min_size`` set) may start or be resized to any
    multiple of ``layout.replica`` in ``[min_size, size]``. ``est_duration_s`` (runtime at
    ``size``, like a Slurm time limit) lets backfill prove a small job will not delay the
    reserved head of the queue; without it the job is assumed to run forever for that purpose.
    ``checkpoint_every_s`` lets preemption estimate the work a victim would lose.

    ``sizing="goodput"`` (an elastic job) lets the scheduler choose the size from the job's
    measured goodput (``StepTimes`` events; ``nbtrain.core.goodput_sizing``) anywhere in
    ``[min_size, max_size]``; it starts at ``size``. ``max_size`` (default ``size``) is only
    read for such jobs.
    """

    job_id: str
    size: int
    layout: Layout = field(default_factory=Layout)
    min_size: int | None = None
    priority: int = 0
    team: str = "default"
    preemptible: bool = True
    est_duration_s: float | None = None
    checkpoint_every_s: float | None = None
    sizing: str = "fixed"
    max_size: int | None = None

    def __post_init__(self) -> None:
        r = self.layout.replica
        if self.sizing not in SIZING:
            raise ValueError(f"job {self.job_id!r}: sizing={self.sizing!r} must be one of "
                             f"{SIZING}")
        if self.max_size is not None and (
            not isinstance(self.max_size, int) or self.max_size < self.size
            or self.max_size % r
        ):
            raise ValueError(f"job {self.job_id!r}: max_size={self.max_size!r} must be a "
                             f"multiple of {r} of at least size={self.size}")
        if self.sizing == "goodput" and self.min_size is None and (
            self.max_size is None or self.max_size == self.size
        ):
            raise ValueError(f"job {self.job_id!r}: sizing='goodput' needs a range of sizes "
                             f"to choose from: set min_size below size={self.size} or "
                             "max_size above it")
        if not isinstance(self.size, int) or self.size < 1 or self.size % r:
            raise ValueError(
                f"job {self.job_id!r}: size={self.size!r} must be a positive multiple of "
                f"tp*cp*pp={r}"
            )
        if self.min_size is not None and (
            self.min_size < 1 or self.min_size > self.size or self.min_size % r
        ):
            raise ValueError(
                f"job {self.job_id!r}: min_size={self.min_size!r} must be a multiple of {r} "
                f"between {r} and size={self.size}"
            )
        if self.est_duration_s is not None and not self.est_duration_s > 0:
            raise ValueError(
                f"job {self.job_id!r}: est_duration_s must be > 0 or None, got "
                f"{self.est_duration_s!r}"
            )
        if self.checkpoint_every_s is not None and not self.checkpoint_every_s > 0:
            raise ValueError(
                f"job {self.job_id!r}: checkpoint_every_s must be > 0 or None, got "
                f"{self.checkpoint_every_s!r}"
            )

    @property
    def min_slots(self) -> int:
        return self.size if self.min_size is None else self.min_size

    @property
    def elastic(self) -> bool:
        return self.min_size is not None and self.min_size < self.size

    @property
    def goodput_sized(self) -> bool:
        return self.sizing == "goodput"

    @property
    def max_slots(self) -> int:
        return self.size if self.max_size is None else self.max_size


SIZING: tuple[str, ...] = ("fixed", "goodput")
"""How a job's size is chosen: as asked (today's elastic rules), or from its goodput."""


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Submit:
    """A job joins the queue."""

    now: float
    job: JobRequest


@dataclass(frozen=True)
class Finished:
    """A running job ended by itself (success, or stopped by its user); its slots are free."""

    now: float
    job_id: str


@dataclass(frozen=True)
class Failed:
    """A running job failed; ``requeue=True`` puts it back in the queue (restart from the last
    checkpoint), otherwise it is gone."""

    now: float
    job_id: str
    requeue: bool = False
    avoid: frozenset[Hashable] = frozenset()
    """Slot ids to stay off at the restart when others fit (the failed slot, a bad host)."""


@dataclass(frozen=True)
class Released:
    """A job told to stop (``PreemptJob``), or stopped by the engine itself (a straggler's
    replacement), has checkpointed and let go of its slots; it queues again with its original
    submit order, staying off ``avoid`` when other slots fit."""

    now: float
    job_id: str
    avoid: frozenset[Hashable] = frozenset()


@dataclass(frozen=True)
class Checkpointed:
    """A job committed a checkpoint: preempting it now loses almost nothing."""

    now: float
    job_id: str


@dataclass(frozen=True)
class Cancelled:
    """The user withdrew a job, queued or running (the engine has stopped its ranks)."""

    now: float
    job_id: str


@dataclass(frozen=True)
class Suspend:
    """The user parked a job (``job.preempt()``): a queued job leaves the queue, a running one
    (whose ranks the engine has already checkpointed and stopped) lets go of its slots. It
    holds nothing and waits for ``Resume``."""

    now: float
    job_id: str


@dataclass(frozen=True)
class Resume:
    """A suspended job queues again with its original submit order."""

    now: float
    job_id: str


@dataclass(frozen=True)
class ResizeRequested:
    """The user asks a job to run with ``size`` ranks (within its ``min_size`` floor)."""

    now: float
    job_id: str
    size: int


@dataclass(frozen=True)
class WorkersAdded:
    """Workers (slots) joined. Known slots come back online; slots on hosts the topology has
    not seen extend it (``Topology.with_hosts``; only for topologies built from hosts)."""

    now: float
    hosts: Mapping[str, tuple[Hashable, ...]]
    nvlink_of: Mapping[Hashable, str] = field(default_factory=dict)
    """NVLink domain labels of new slots (see ``Topology.from_hosts``)."""
    leaf_of: Mapping[str, str] = field(default_factory=dict)
    """Leaf switch labels of new hosts."""


@dataclass(frozen=True)
class WorkersRemoved:
    """Workers (slots) left. A job that held one loses its gang: an elastic job shrinks onto
    the rest when it can, any other is stopped and queued again."""

    now: float
    slots: tuple[Hashable, ...]


@dataclass(frozen=True)
class WorkersForgotten:
    """Slots gone for good (a departed host's, offline for longer than the engine keeps
    them): the topology drops those that are offline and unowned, never its last slot."""

    now: float
    slots: tuple[Hashable, ...]


@dataclass(frozen=True)
class StepTimes:
    """A job's mean step time over ``steps`` steps at ``size`` ranks (for goodput sizing;
    ignored for other jobs); optionally its gradient noise scale (samples), how the step
    splits: ``compute_s`` (forward and backward, which shrink as the per-rank batch does) and
    ``comm_s`` (waiting for the gradient all-reduce), means over the same steps, and
    ``steps_left``, the steps the job still has to run (``None``: not known, a job without
    ``steps``)."""

    now: float
    job_id: str
    size: int
    step_s: float
    steps: float = 1.0
    noise_scale: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    steps_left: float | None = None


@dataclass(frozen=True)
class Tick:
    """Time passed; lets waiting-time and fair-share order advance with no other event."""

    now: float


Event = (
    Submit | Finished | Failed | Released | Checkpointed | Cancelled | Suspend | Resume
    | ResizeRequested | WorkersAdded | WorkersRemoved | WorkersForgotten | StepTimes | Tick
)


# ---------------------------------------------------------------------------------- decisions
@dataclass(frozen=True)
class StartJob:
    """Launch the whole gang: rank ``r`` on ``placement.slots[r]``."""

    job_id: str
    placement: Placement

    @property
    def size(self) -> int:
        return self.placement.world_size


@dataclass(frozen=True)
class PreemptJob:
    """Checkpoint at the next step boundary and release all slots within ``grace_s`` seconds
    (after that the engine kills the ranks); then send ``Released``. ``for_job`` is the job the
    slots are for (``None`` when a worker was lost)."""

    job_id: str
    grace_s: float
    reason: str
    for_job: str | None = None


@dataclass(frozen=True)
class ResizeJob:
    """Restart the job's next generation on ``placement`` (grow or shrink); slots it no longer
    holds may be given to other jobs by later decisions of the same batch, so the engine carries
    decisions out in order."""

    job_id: str
    placement: Placement
    old_size: int
    reason: str


@dataclass(frozen=True)
class RejectJob:
    """A request that can never be met, with the values and the fix."""

    job_id: str
    reason: str


Decision = StartJob | PreemptJob | ResizeJob | RejectJob


# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Policy knobs. The defaults are nbtrain's policy; the baselines switch parts off.

    order: ``"priority"`` (priority, then fair share, then submit order) or ``"fifo"``.
    backfill: start later jobs that do not delay the reserved head of the queue.
    preemption: let a higher-priority job stop whole lower-priority preemptible jobs.
    fair_share: order teams of equal priority by decayed usage / weight.
    team_weights: share weight per team (missing teams weigh 1).
    fair_share_half_life_s: how fast past usage is forgotten (default 7 days, Slurm's
        default); it should be several times the horizon over which shares are expected to
        hold: with a half-life of one day, shares measured over that day drift by several %.
    share_window_s: the recent window over which the class view reports each team's share
        of slot-time (``team_window``); it changes no decision.
    max_wait_s: a job queued this long goes first among its priority, whatever its team's
        usage, so fair share never starves it.
    preempt_grace_s: time a victim gets to checkpoint and release; should exceed the time to
        snapshot a checkpoint plus one step.
    restart_cost_s: seconds of work a restart costs beyond the lost steps (rendezvous, load);
        used to prefer fewer victims.
    placement: ``"topology"`` (nbtrain), ``"first_fit"`` or ``"random"`` (baselines).
    elastic_grow: grow elastic jobs into idle slots when nobody waits.
    can_grow: the cluster may still grow (a live cluster whose workers come and go): a job
        larger than the topology waits for workers instead of being rejected.
    min_resize_interval_s: an elastic job is grown into idle slots at most this long after
        its last start or resize, so a worker that comes and goes cannot restart it over and
        over (shrinks for a lost worker or a waiting job are not held back).
    goodput_interval_s: a goodput-sized job is resized by its goodput at most this long
        after its last start or resize (Pollux reconsiders every 60 s; a restart costs
        ``restart_cost_s``, so this should be a few times that; 120 s gave a mean JCT 4%
        lower than 300 s on ``benchmarks/goodput.py``'s full trace, 2026-12-05).
    goodput_check_s: how often the scheduler looks at goodput-sized jobs at all (bounds the
        cost of a decision on a busy queue).
    goodput_knee: while jobs wait, a goodput-sized job gives back the ranks whose marginal
        speedup is below this fraction of its average rank's (0.5: the last ranks add less
        than half what an average one does, while a waiting job's first ranks add about all
        of theirs). Higher gives back more, at a restart each time.
    goodput_min_gain: growing goodput-sized jobs into idle slots must raise each one's
        speedup, and the summed speedup net of what shrinks cost, by at least this
        fraction; the grown job is likely to be shrunk back (one more restart) when jobs
        arrive, and noise in the measurements must not move it (the hysteresis).
    goodput_min_confidence: model confidence (``GoodputModel.confidence``) needed, at the
        current and the new size, before a job is shrunk on its curve's word.
    goodput_value_ranks: how many ranks one second of a goodput-sized job's run is worth.
        Idle slots go to the jobs whose run each added rank-second shortens most, and a job
        grows by a replica only while each rank-second it adds saves at least
        ``1 / goodput_value_ranks`` of a second of its run: past that a job holds slots it
        barely uses, which arriving jobs then take back at a restart each.
    """

    order: str = "priority"
    backfill: bool = True
    preemption: bool = True
    fair_share: bool = True
    team_weights: Mapping[str, float] = field(default_factory=dict)
    fair_share_half_life_s: float = 7 * 86400.0
    share_window_s: float = 600.0
    max_wait_s: float | None = 12 * 3600.0
    preempt_grace_s: float = 120.0
    restart_cost_s: float = 60.0
    placement: str = "topology"
    seed: int = 0
    elastic_grow: bool = True
    can_grow: bool = False
    min_resize_interval_s: float = 0.0
    goodput_interval_s: float = 120.0
    goodput_check_s: float = 30.0
    goodput_knee: float = 0.5
    goodput_min_gain: float = 0.25
    goodput_min_confidence: float = 0.3
    goodput_value_ranks: float = 256.0

    def __post_init__(self) -> None:
        if self.order not in ("priority", "fifo"):
            raise ValueError(f"order must be 'priority' or 'fifo', got {self.order!r}")
        if self.placement not in POLICIES:
            raise ValueError(f"placement must be one of {POLICIES}, got {self.placement!r}")
        for team, w in self.team_weights.items():
            if not (w > 0 and math.isfinite(w)):
                raise ValueError(f"team_weights[{team!r}] must be a positive number, got {w!r}")
        if not self.fair_share_half_life_s > 0:
            raise ValueError(
                f"fair_share_half_life_s must be > 0, got {self.fair_share_half_life_s!r}"
            )
        if not (self.share_window_s > 0 and math.isfinite(self.share_window_s)):
            raise ValueError(f"share_window_s must be a positive number of seconds, got "
                             f"{self.share_window_s!r}")
        if self.preempt_grace_s < 0 or self.restart_cost_s < 0:
            raise ValueError("preempt_grace_s and restart_cost_s must be >= 0")
        self._check_goodput()

    def _check_goodput(self) -> None:
        if not (self.goodput_interval_s >= 0 and self.goodput_check_s >= 0):
            raise ValueError(f"goodput_interval_s and goodput_check_s must be >= 0 seconds, "
                             f"got {self.goodput_interval_s!r} and {self.goodput_check_s!r}")
        for name in ("goodput_knee", "goodput_min_gain", "goodput_min_confidence"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        if not (self.goodput_value_ranks > 0 and math.isfinite(self.goodput_value_ranks)):
            raise ValueError(f"goodput_value_ranks must be a positive number of ranks, got "
                             f"{self.goodput_value_ranks!r}")

    def weight(self, team: str) -> float:
        return float(self.team_weights.get(team, 1.0))
