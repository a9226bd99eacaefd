"""Job specification and lifecycle states (pure)."""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbtrain.core.mesh import layout_of, validate_mesh
from nbtrain.core.placement import Layout
from nbtrain.core.sched_types import SIZING


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

    def can_become(self, other: JobState) -> bool:
        """Whether the job machine may move a job from this state to ``other`` (see
        ``TRANSITIONS``)."""
        return other in TRANSITIONS[self]


def user_actions(state: str) -> dict[str, bool]:
    """Which of a user's requests a job in ``state`` (a ``JobState`` value, or ``"UNKNOWN"``)
    acts on: the rule the job machine judges requests by and every view's buttons follow.
    ``stop`` until the job ends; ``preempt`` while it holds slots and is not already stopping;
    ``resume`` only PREEMPTED; ``checkpoint`` and ``inject`` (a fault) while RUNNING;
    ``resize`` (an elastic job's size) until it ends, except while STOPPING."""
    ended = state not in _LIVE
    return {"stop": not ended, "preempt": state in ("STARTING", "RUNNING"),
            "resume": state == "PREEMPTED", "checkpoint": state == "RUNNING",
            "inject": state == "RUNNING", "resize": not ended and state != "STOPPING"}


_LIVE = frozenset(s.value for s in JobState if not s.terminal)


class TransitionError(RuntimeError):
    """The job machine tried a move ``TRANSITIONS`` does not allow: a bug in the machine."""


_S = JobState

#: Longest job name: it becomes a directory name (checkpoints, tracker runs) with the job's id
#: beside it, well inside every filesystem's 255-byte limit.
NAME_MAX = 100
#: Characters safe in a directory name on every filesystem and shell a path meets.
NAME_CHARS = "letters, digits and . _ - + = @ ,"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-+=@,]*")


def check_name(name: object) -> str:
    """A job name, or ValueError saying what is allowed: it names directories (checkpoints,
    tracker runs), so no path separators, no dot-only names, at most ``NAME_MAX``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > NAME_MAX:
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        raise ValueError(
            f"job name {shown} is not allowed: use {NAME_CHARS}, starting with a letter or "
            f"digit, at most {NAME_MAX} characters (it names the job's checkpoint and tracker "
            "directories), e.g. name='mlp-lr3'")
    return name


def default_name(label: str, job_id: str) -> str:
    """A valid name from a recipe's class or a function's name (``<lambda>`` too)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", label).strip("._-")[: NAME_MAX - 5] or "job"
    return f"{safe}-{job_id[:4]}"
#: Every move of a job's state the job machine makes (``nbtrain.core.lifecycle``); a state
#: may also stay, with a new reason, until it is terminal. QUEUED starts (a launch, or a
#: launch deferred until a shrinking job hands over its slots), is held by its user or ends
#: (stopped, or a controller error); a generation STARTING reaches RUNNING with its first step
#: rows, or STOPPING (stop, preemption, resize, halt), or ends (failed: requeued, FAILED or
#: CANCELLED; all ranks done); a STOPPING generation ends: relaunched at its new size
#: (resize), PREEMPTED (by its user), requeued (by the scheduler, a straggler's replacement,
#: a failure) or ended; PREEMPTED is resumed or stopped.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.QUEUED: frozenset({_S.QUEUED, _S.STARTING, _S.PREEMPTED, _S.CANCELLED, _S.FAILED}),
    _S.STARTING: frozenset({_S.STARTING, _S.RUNNING, _S.STOPPING, _S.QUEUED, _S.SUCCEEDED,
                            _S.FAILED, _S.CANCELLED}),
    _S.RUNNING: frozenset({_S.RUNNING, _S.STOPPING, _S.QUEUED, _S.SUCCEEDED, _S.FAILED,
                           _S.CANCELLED}),
    _S.STOPPING: frozenset({_S.STOPPING, _S.STARTING, _S.QUEUED, _S.PREEMPTED, _S.SUCCEEDED,
                            _S.FAILED, _S.CANCELLED}),
    _S.PREEMPTED: frozenset({_S.PREEMPTED, _S.QUEUED, _S.CANCELLED, _S.FAILED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What a user asked for. Validated on construction; errors name the values and the fix."""

    job_id: str
    name: str
    world_size: int
    #: Steps to train. None: the training function's own loop decides when it is done (a
    #: ``Recipe`` needs a number).
    steps: int | None
    #: Elastic bounds: the job may run (and be resized, by its user or the scheduler) at any
    #: size in ``[min_size, max_size]``; None means ``world_size``. ``world_size`` is the size
    #: it asks for; a resize asks for another.
    min_size: int | None = None
    max_size: int | None = None
    priority: int = 0
    team: str = "default"
    queue: bool = True
    seed: int = 0
    #: ``"auto"`` (Young/Daly), an int N (every N steps), a duration ("90s", "10m"), or
    #: None / "off" (on demand, on stop and at preemption only).
    checkpoint: int | str | None = "auto"
    #: None (fresh start), "latest" (newest committed checkpoint of any job with this name),
    #: or the URL of a checkpoint directory or of one ``step-XXXXXXXX`` in it.
    resume: str | None = None
    #: Automatic restarts allowed within ``restart_window_s`` before the job is FAILED.
    max_restarts: int = 3
    restart_window_s: float = 3600.0
    #: An exception with the same message at the same step as the fault before it (a bug
    #: in the training code, not a flaky node) fails the job at once instead of spending
    #: the rest of ``max_restarts``; False retries it like any fault.
    fail_fast: bool = True
    #: ``"gpu"`` (GPU slots, NCCL), ``"cpu"`` (CPU slots, gloo) or ``"auto"``: GPU slots when
    #: the cluster has any when the job is queued, else CPU slots.
    device: str = "auto"
    #: A NaN or infinite reported metric: "alert" (say so at once) or "halt" (also stop the
    #: job, checkpointing nothing from that step on, so the newest committed checkpoint is
    #: the last good state).
    on_nonfinite: str = "alert"
    #: The device mesh: ``{"dp": 2, "tp": 2}`` (``dp`` follows from the world size). TP
    #: groups are placed inside an NVLink domain; None: data parallel over every rank.
    mesh: dict[str, int] | None = None
    #: ``"fixed"`` (the size asked for, shrunk and grown back by the elastic rules) or
    #: ``"goodput"``: the scheduler chooses the size in ``[min_size, max_size]`` from the
    #: job's measured speedup (``nbtrain.core.goodput_sizing``).
    sizing: str = "fixed"
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name(self.name)
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}: e.g. "
                             "priority=5 (higher runs first)")
        self._check_sizes()
        self._check_policy()
        self._check_sizing()
        if self.mesh is not None:
            validate_mesh(self.mesh, self.world_size, sizes=self.bounds)

    def _check_sizes(self) -> None:
        """``world_size``, ``steps``, ``min_size`` and ``max_size``: ValueError with the fix."""
        if (not isinstance(self.world_size, int) or isinstance(self.world_size, bool)
                or self.world_size < 1):
            raise ValueError(
                f"world_size must be a positive integer, got {self.world_size!r}: "
                "pass the number of ranks, e.g. world_size=2"
            )
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(
                f"steps must be a positive integer (or None for a training function that "
                f"decides itself), got {self.steps!r}: e.g. steps=100"
            )
        if self.min_size is not None and not 1 <= self.min_size <= self.world_size:
            raise ValueError(
                f"min_size must be between 1 and world_size={self.world_size}, "
                f"got {self.min_size!r}"
            )
        if self.max_size is not None and (not isinstance(self.max_size, int)
                                          or self.max_size < self.world_size):
            raise ValueError(
                f"max_size must be an integer >= world_size={self.world_size}, "
                f"got {self.max_size!r}"
            )

    def _check_policy(self) -> None:
        """The restart, device and non-finite policies: ValueError with the fix."""
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(
                f"max_restarts must be an integer >= 0, got {self.max_restarts!r}: "
                "0 fails the job at its first fault"
            )
        if not isinstance(self.fail_fast, bool):
            raise ValueError(f"fail_fast must be True or False, got {self.fail_fast!r}")
        if (not isinstance(self.restart_window_s, int | float)
                or not math.isfinite(self.restart_window_s) or self.restart_window_s <= 0):
            raise ValueError(f"restart_window_s must be a finite number of seconds > 0, got "
                             f"{self.restart_window_s!r}: e.g. restart_window_s=3600")
        if self.device not in ("auto", "gpu", "cpu"):
            raise ValueError(
                f"device must be 'auto', 'gpu' or 'cpu', got {self.device!r}: 'gpu' runs on "
                "GPU slots only (NCCL), 'cpu' on CPU slots only (gloo)"
            )
        if self.on_nonfinite not in ("alert", "halt"):
            raise ValueError(f"on_nonfinite must be 'alert' or 'halt', got "
                             f"{self.on_nonfinite!r}")

    def _check_sizing(self) -> None:
        if self.sizing not in SIZING:
            raise ValueError(f"sizing must be one of {SIZING}, got {self.sizing!r}: 'goodput' "
                             "lets the scheduler choose the size in [min_size, max_size] from "
                             "the job's measured speedup")
        if self.sizing == "goodput" and not self.resizable:
            raise ValueError(f"sizing='goodput' needs sizes to choose from: set min_size below "
                             f"world_size={self.world_size} or max_size above it")

    @property
    def bounds(self) -> tuple[int, int]:
        """The sizes the job may run at: ``(min_size, max_size)``."""
        return (self.min_size or self.world_size, self.max_size or self.world_size)

    @property
    def layout(self) -> Layout:
        """The placement layout the mesh asks for (TP degree)."""
        return layout_of(self.mesh)

    @property
    def resizable(self) -> bool:
        """Submitted with room to change size (``min_size`` or ``max_size``)."""
        lo, hi = self.bounds
        return lo < hi

    def progress(self, step: int) -> str:
        """``"52/100"``, or ``"52"`` when the training function decides the number of steps."""
        return format_progress(step, self.steps)

    def describe(self) -> dict[str, object]:
        """JSON-friendly summary (recorded in checkpoint manifests)."""
        return {
            "job_id": self.job_id, "name": self.name, "world_size": self.world_size,
            "min_size": self.min_size, "max_size": self.max_size, "steps": self.steps,
            "seed": self.seed, "team": self.team,
            "priority": self.priority, "checkpoint": self.checkpoint,
            "mesh": dict(self.mesh) if self.mesh else None, "sizing": self.sizing,
        }


def format_progress(step: int, steps: int | None) -> str:
    """A job's progress as people read it: ``"52/100"``, or ``"52"`` with no fixed total."""
    return f"{step}/{steps}" if steps else str(step)


def status_progress(status: Mapping[str, Any]) -> str:
    """A job status's progress; ``"(hidden)"`` for a status this reader may not see in full
    (another user's job on a cluster with ``visibility="owner"``)."""
    if status.get("hidden"):
        return "(hidden)"
    return format_progress(int(status.get("step") or 0), status.get("steps"))
