"""The job machine's vocabulary: what a job asks for, events in, commands out (pure).

Every event carries ``now`` (the engine's monotonic clock, for durations and deadlines) and
``wall`` (epoch seconds, for what people read). The machine reads no clock, so a unit test
drives hours of a job's life by hand and the engine replays exactly what it saw.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbtrain.core.checkpoint_policy import DEFAULT_COMMIT_TIMEOUT_S
from nbtrain.core.checkpoint_policy import stop_grace_s as derived_stop_grace_s
from nbtrain.core.faults import Fault
from nbtrain.core.job import JobSpec
from nbtrain.core.machine_events import RankEvent, UserRequest
from nbtrain.core.mesh import MeshPlan
from nbtrain.core.mitigation import MitigationSettings
from nbtrain.core.watchdog import WatchdogSettings

__all__ = [
    "AbortCollectives",
    "Cancel",
    "CarriedHistory",
    "Command",
    "ControllerFailed",
    "Deliver",
    "Diagnose",
    "EndGeneration",
    "Event",
    "HangDiagnosed",
    "JobEnded",
    "JobPolicy",
    "JobSubmission",
    "Launch",
    "MachineConfig",
    "Publish",
    "RankExit",
    "RankFailureInfo",
    "Rejected",
    "RestartWorkers",
    "SetControl",
    "Submitted",
    "Tick",
    "WorkerJoined",
    "WorkerLeaving",
    "WorkerLeft",
]


# ------------------------------------------------------------------------------- what a job is
_WATCH = WatchdogSettings()


@dataclass(frozen=True, kw_only=True)
class JobPolicy:
    """How the controller watches one job (seconds). Built from the submitting client's
    ``nbtrain.Settings``; see there for tuning advice. The watchdog's bounds are validated
    on construction (see :class:`nbtrain.core.watchdog.WatchdogSettings`)."""

    hang_factor: float = _WATCH.hang_factor
    hang_floor_s: float = _WATCH.hang_floor_s
    peer_release_s: float = 0.3
    failure_grace_s: float = 10.0
    setup_timeout_s: float = _WATCH.setup_timeout_s
    restore_timeout_s: float = _WATCH.restore_timeout_s
    rendezvous_timeout_s: float = _WATCH.rendezvous_timeout_s
    #: A stopped job's ranks still running this long after the stop request are stopped
    #: and their workers restarted (a stop waits for a final checkpoint, not forever).
    stop_grace_s: float = derived_stop_grace_s(DEFAULT_COMMIT_TIMEOUT_S)

    def __post_init__(self) -> None:
        if not self.stop_grace_s > 0:
            raise ValueError(f"stop_grace_s must be > 0 seconds, got {self.stop_grace_s!r} "
                             "(longer than a step plus two checkpoint commits)")
        self.watchdog()  # raises ValueError naming every bad bound

    def watchdog(self) -> WatchdogSettings:
        """The hang and startup watchdog's settings for this job."""
        return WatchdogSettings(hang_factor=self.hang_factor, hang_floor_s=self.hang_floor_s,
                                setup_timeout_s=self.setup_timeout_s,
                                restore_timeout_s=self.restore_timeout_s,
                                rendezvous_timeout_s=self.rendezvous_timeout_s)


@dataclass(frozen=True, kw_only=True)
class CarriedHistory:
    """What an earlier controller knew of a job that was live when it stopped, read back from
    its journal: the job continues where it was instead of starting over.

    Built by :meth:`nbtrain.core.lifecycle.JobMachine.carry` and journaled by the engine; never
    taken from a client (``engine/wire.py`` drops it from submissions)."""

    #: The newest generation launched (-1: none); the next one is numbered above it, so a rank
    #: of an old generation can never pass for one of the new (the fence).
    generation: int = -1
    step: int = 0
    committed_step: int = 0
    #: Wall-clock times of the restarts charged to the restart budget.
    restarts_wall: tuple[float, ...] = ()
    #: The fault history (``fault`` event dicts).
    faults: tuple[Mapping[str, Any], ...] = ()
    #: Planned faults (as ``Fault.to_dict()``, injected ones included) and the ids fired.
    planned: tuple[Mapping[str, Any], ...] = ()
    fired: tuple[str, ...] = ()
    #: Preempted by its user: stays PREEMPTED until ``resume()``.
    held: bool = False
    #: Its user had asked it to stop: it ends at its newest committed checkpoint.
    stopping: bool = False
    target: int = 0
    last_size: int | None = None
    submitted: float = 0.0
    started: float | None = None
    #: The job's knobs (``core.knobs.KnobBook.wire()``): declarations, pending, history.
    knobs: Mapping[str, Any] = field(default_factory=dict)
    #: The job's goodput ledger (``GoodputLedger.carry``) and the wall time it was carried at
    #: (``wall``); empty from a journal written before it was kept (the ledger starts again).
    goodput: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class JobSubmission:
    """Everything the machine needs about a new job (the recipe itself stays in the engine)."""

    spec: JobSpec
    owner: str = ""
    policy: JobPolicy = field(default_factory=JobPolicy)
    mitigation: MitigationSettings = field(default_factory=MitigationSettings)
    faults: tuple[Fault, ...] = ()
    #: Newest committed step of the ``resume=`` source (0: a fresh start).
    resume_step: int = 0
    #: Set when a restarted controller restores the job from its journal (see there).
    carried: CarriedHistory | None = None
    #: ``submit(replay=...)``: another run's applied knob changes, applied again at their
    #: steps (``core.knobs.KnobChange.to_dict()``).
    knob_history: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True)
class MachineConfig:
    """Cluster-wide settings of the machine (the gang scheduler has its own config)."""

    #: A host whose ranks fail this many times within the window is avoided for a while.
    host_failure_limit: int = 2
    host_failure_window_s: float = 600.0
    host_exclusion_s: float = 300.0
    #: How often the gang scheduler gets a ``Tick`` (waiting-time aging, fair share).
    scheduler_tick_s: float = 1.0
    #: A worker asked to restart that has not come back after this long is reported lost.
    worker_return_s: float = 120.0
    #: A slot offline this long that no job holds is forgotten (a departed host's).
    slot_forget_s: float = 3600.0


@dataclass(frozen=True)
class RankFailureInfo:
    """Why a rank task ended in error, as the engine could tell."""

    error: str
    traceback: str
    host: str
    step: int
    when: float  # the rank's wall clock when it failed
    peer: bool  # a consequence of another rank's failure (a collective lost its peer)
    lost_worker: bool = False  # the rank's worker process went away


# ------------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class Submitted:
    now: float
    wall: float
    job: JobSubmission


@dataclass(frozen=True)
class RankExit:
    """A rank task of ``generation`` ended: ``outcome`` (its summary) or ``failure``."""

    now: float
    wall: float
    job_id: str
    generation: int
    rank: int
    outcome: Mapping[str, Any] | None = None
    failure: RankFailureInfo | None = None


@dataclass(frozen=True)
class WorkerJoined:
    now: float
    wall: float
    address: str
    host: str
    name: str = ""
    nvlink: str = ""
    leaf: str = ""
    gpu: str = ""  # the UUID of the worker's GPU; "" = a CPU worker
    #: What else the worker said of its device, for the views (its GPU's name and PCI bus,
    #: where its NVLink label came from): (key, value) pairs.
    about: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class WorkerLeft:
    now: float
    wall: float
    address: str
    #: Why its process went, where the shell knows (Dask's memory limit); "" = it died.
    cause: str = ""


@dataclass(frozen=True)
class WorkerLeaving:
    """A worker is about to leave (its batch job's walltime, a pod's SIGTERM, a
    ``retire_workers``): its slot takes no new rank, and a job running a rank there is
    preempted, checkpoint first, and queued again on other slots. ``reason`` says why."""

    now: float
    wall: float
    address: str
    reason: str


@dataclass(frozen=True)
class HangDiagnosed:
    """Which ranks of a hung generation are stuck outside a collective (empty: unknown)."""

    now: float
    wall: float
    job_id: str
    generation: int
    culprits: tuple[int, ...]
    #: Each rank's call stack (frames joined), to tell a stuck rank from a slow one.
    stacks: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Tick:
    now: float
    wall: float


@dataclass(frozen=True)
class ControllerFailed:
    """Handling an event of ``job_id`` raised inside the controller (a bug): the job ends
    FAILED with ``error`` (the traceback) as its cause; every other job goes on."""

    now: float
    wall: float
    job_id: str
    error: str


#: Users' requests and ranks' messages are typed per kind in
#: :mod:`nbtrain.core.machine_events` (``UserRequest``, ``RankEvent`` and their kinds).
Event = (Submitted | UserRequest | RankEvent | RankExit | WorkerJoined | WorkerLeft
         | WorkerLeaving | HangDiagnosed | Tick | ControllerFailed)


# ---------------------------------------------------------------------------------- commands
@dataclass(frozen=True)
class Launch:
    """Start ``generation``: rank ``r`` on worker ``addresses[r]``. ``faults``: planned
    faults not fired yet; ``control``: requests already standing (e.g. a checkpoint);
    ``device``: the slots' kind, ``gpu`` or ``cpu`` ("" = whatever the worker has)."""

    job_id: str
    generation: int
    addresses: tuple[str, ...]
    faults: tuple[Fault, ...]
    control: Mapping[str, int]
    device: str = ""
    #: The generation's device mesh: shape, names and where each rank runs.
    mesh: MeshPlan | None = None
    #: The job's knobs (``core.knobs.KnobBook.wire()``): what the ranks apply and when.
    knobs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SetControl:
    """The control flags ranks of ``generation`` act on at their next agreement, and the
    knob changes pending (``core.knobs.KnobChange.to_dict()``) they apply at it."""

    job_id: str
    generation: int
    flags: Mapping[str, int]
    knobs: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Deliver:
    """Hand ``fault`` to the rank running on ``address``."""

    job_id: str
    address: str
    fault: Fault


@dataclass(frozen=True)
class RestartWorkers:
    """Restart these workers through their nannies (their slots are offline meanwhile)."""

    addresses: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class AbortCollectives:
    """Abort the NCCL communicators of ``generation``'s ranks on these workers: a rank blocked
    in a collective with a failed peer raises at once, and its process (and CUDA context)
    stays warm for the next generation."""

    job_id: str
    generation: int
    addresses: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Cancel:
    """Give up on these rank tasks (their workers are being restarted or are gone)."""

    job_id: str
    generation: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Diagnose:
    """Find which ranks of a hung generation are stuck; answer with ``HangDiagnosed``."""

    job_id: str
    generation: int


@dataclass(frozen=True)
class EndGeneration:
    """Nothing of ``generation`` runs any more: drop its tasks and rendezvous."""

    job_id: str
    generation: int


@dataclass(frozen=True)
class Publish:
    """Append ``event`` to the log of ``job_id`` (``None``: the cluster's log)."""

    job_id: str | None
    event: Mapping[str, Any]


@dataclass(frozen=True)
class JobEnded:
    """The job reached ``state`` (SUCCEEDED, FAILED or CANCELLED): nothing of it will run
    again. Said once, right after its last state event."""

    job_id: str
    state: str


@dataclass(frozen=True)
class Rejected:
    """A submission that will not run, with the values and the fix."""

    job_id: str
    reason: str


Command = (Launch | SetControl | Deliver | RestartWorkers | Cancel | Diagnose | EndGeneration
           | Publish | Rejected | AbortCollectives | JobEnded)
