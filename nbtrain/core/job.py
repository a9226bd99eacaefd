"""Job specification and lifecycle states (pure)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class JobState(str, enum.Enum):
    """Lifecycle of a job as the controller sees it."""

    QUEUED = "QUEUED"  # waiting for a whole gang of free slots
    STARTING = "STARTING"  # rank tasks submitted, rendezvous under way
    RUNNING = "RUNNING"  # at least one step record received in this generation
    STOPPING = "STOPPING"  # stop/preempt asked; ranks finish at the next step boundary
    PREEMPTED = "PREEMPTED"  # checkpointed and released; resume() queues it again
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    @property
    def holds_slots(self) -> bool:
        return self in (JobState.STARTING, JobState.RUNNING, JobState.STOPPING)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What a user asked for. Validated on construction; errors name the values and the fix."""

    job_id: str
    name: str
    world_size: int
    steps: int
    min_size: int | None = None
    priority: int = 0
    team: str = "default"
    queue: bool = True
    seed: int = 0
    checkpoint_every: int | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(
                f"world_size must be a positive integer, got {self.world_size!r}: "
                "pass the number of ranks, e.g. world_size=2"
            )
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(
                f"steps must be a positive integer, got {self.steps!r}: e.g. steps=100"
            )
        if self.min_size is not None and not 1 <= self.min_size <= self.world_size:
            raise ValueError(
                f"min_size must be between 1 and world_size={self.world_size}, "
                f"got {self.min_size!r}"
            )
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(
                f"checkpoint_every must be >= 1 step, got {self.checkpoint_every!r}"
            )
