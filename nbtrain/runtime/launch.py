"""What one rank task is given: the launch spec and its checkpoint plan (torch-free).

Built by the controller inside the Dask scheduler process, which never imports torch, and
pickled to the rank's worker, where :func:`nbtrain.runtime.loop.run_rank` runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbtrain.config import Settings
from nbtrain.core.checkpoint_policy import (
    DEFAULT_COMMIT_TIMEOUT_S,
    CheckpointPolicyConfig,
    preemption_commit_s,
)
from nbtrain.core.faults import Fault
from nbtrain.core.mesh import MeshPlan
from nbtrain.core.sched_types import SchedulerConfig

__all__ = ["CheckpointPlan", "RankLaunch"]


@dataclass(frozen=True)
class CheckpointPlan:
    """Where a generation writes and reads checkpoints.

    ``restore_from``: checkpoint directories to resume from, in order of preference, each
    with the newest step to consider (None: any). The ranks take the first that holds a
    committed checkpoint: the job's own directory once it has one, else the ``resume=``
    source. Empty: a fresh start.
    """

    url: str  # this job's own checkpoint directory
    policy: CheckpointPolicyConfig
    keep: int = Settings.checkpoint_keep
    restore_from: tuple[tuple[str, int | None], ...] = ()
    commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S
    #: How long the final checkpoint of a preemption or resize may take to commit
    #: (``preemption_commit_s``: inside the grace, so it fails before the ranks are stopped).
    preempt_commit_s: float = preemption_commit_s(DEFAULT_COMMIT_TIMEOUT_S,
                                                  SchedulerConfig.preempt_grace_s)

    def final_commit_s(self, outcome: str) -> float:
        """How long a rank waits for its last checkpoint when the loop ended with ``outcome``."""
        return self.preempt_commit_s if outcome == "preempted" else self.commit_timeout_s


@dataclass(frozen=True)
class RankLaunch:
    """Everything one rank task needs; built by the controller, pickled to the worker."""

    job_id: str
    rank: int
    world_size: int
    generation: int
    recipe: bytes  # cloudpickled Recipe or TrainFunction, as the submitting client made it
    steps: int | None  # None: a training function's own loop decides
    seed: int
    host_slots: int  # slots of the cluster on this rank's host, to size torch threads
    settings: Settings
    checkpoint: CheckpointPlan | None = None
    faults: tuple[Fault, ...] = ()
    job_info: dict[str, Any] | None = None  # the job spec, recorded in checkpoint manifests
    control: Mapping[str, int] = field(default_factory=dict)  # requests standing at launch
    #: The slot's kind: "gpu" (the worker's GPU, NCCL), "cpu" (gloo, even on a GPU worker),
    #: "" (the GPU if the worker has one).
    device: str = ""
    #: Take no checkpoint once a reported metric was NaN or infinite (on_nonfinite="halt").
    halt_on_nonfinite: bool = False
    #: The generation's device mesh and where each rank runs (None: one "dp" dimension).
    mesh: MeshPlan | None = None
    #: The generation's secret (``nbtrain.core.rankseal``): the rank seals its events with
    #: it and shows it at the rendezvous and the control long-poll.
    secret: str = field(default="", repr=False)
    #: The job's knobs (``core.knobs.KnobBook.wire()``): declarations the controller knows,
    #: pending changes and the applied history, re-applied at its steps.
    knobs: Mapping[str, Any] = field(default_factory=dict)
