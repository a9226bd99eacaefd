"""One live job as the job machine keeps it: state, generations, faults, accounting (pure).

:class:`LiveJob` is written by :class:`nbtrain.core.lifecycle.JobMachine` only; everyone else
reads :class:`JobStatus`, a frozen snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from nbtrain.core.faults import Fault
from nbtrain.core.goodput import GoodputLedger
from nbtrain.core.job import JobSpec, JobState
from nbtrain.core.jobevents import fault_event
from nbtrain.core.knobs import KnobBook
from nbtrain.core.lifecycle_types import CarriedHistory, JobSubmission, RankFailureInfo
from nbtrain.core.resizeplan import ResizePlan
from nbtrain.core.stragglerwatch import StragglerWatch
from nbtrain.core.watchdog import GenerationWatch

__all__ = ["Generation", "JobStatus", "LiveJob", "Preemption", "primary_failure"]

#: The cause of the fault a restored job records for its controller's restart.
CONTROLLER_RESTARTED = "controller restarted"
#: Control flags a generation's ranks act on (``checkpoint`` is a sequence number).
CONTROL_FLAGS = ("stop", "preempt", "checkpoint", "halt")


@dataclass
class Preemption:
    """Why the current generation is being ended to free its slots."""

    cause: str  # "user" (job.preempt), "scheduler" (a higher-priority job), "replace",
    #            "leaving" (its worker is about to leave: walltime, SIGTERM, retirement)
    reason: str
    deadline: float  # monotonic; past it the ranks are stopped without their checkpoint
    for_job: str | None = None
    slot: str | None = None  # replace / leaving: the slot to stay off


@dataclass
class Generation:
    """One (re)start of a job's gang."""

    number: int
    slots: tuple[str, ...]  # slot ids, index = rank
    addresses: tuple[str, ...]  # their workers at launch
    watch: GenerationWatch  # the hang and startup watchdog's view of it (and when it started)
    control: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONTROL_FLAGS, 0))
    #: Bumped at each change of ``control`` or of the pending knobs: rank 0's long poll of the
    #: flags waits for a version other than the one it holds (0: as launched).
    control_version: int = 0
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: dict[int, RankFailureInfo] = field(default_factory=dict)
    failed_at: float | None = None  # monotonic time of the first failure
    failed_wall: float | None = None
    injected: dict[str, Any] | None = None  # the last fault injected in this generation
    running: bool = False  # a step row arrived
    released: bool = False  # peers freed (failed ranks' workers restarted, or NCCL aborted)
    forced: bool = False  # preemption grace ran out: ranks stopped without their checkpoint
    #: The ranks a stop's grace ran out on (stopped, their workers restarted), for the reason.
    stop_forced: tuple[int, ...] = ()
    nonfinite: set[str] = field(default_factory=set)  # metrics already reported non-finite
    timed_rows: int = 0  # rank 0's step rows goodput sizing has seen (it skips the first)

    @property
    def size(self) -> int:
        """Ranks of this generation (an elastic job's size can change between generations)."""
        return len(self.slots)

    def finished(self) -> bool:
        return len(self.outcomes) + len(self.failures) >= self.size

    @property
    def failing(self) -> bool:
        return bool(self.failures) or self.watch.hang is not None

    def unfinished(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.size)
                     if r not in self.outcomes and r not in self.failures)


@dataclass(frozen=True)
class GenerationControl:
    """What rank 0 of the job's live generation long-polls: its control flags and pending
    knob changes (``core.knobs.KnobChange.to_dict()``), at ``version``."""

    generation: int
    version: int
    flags: dict[str, int]
    knobs: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class JobStatus:
    """A read-only snapshot of one job, for handles, views and listings."""

    job_id: str
    name: str
    owner: str
    team: str
    priority: int
    world_size: int
    steps: int | None
    state: str
    reason: str
    generation: int
    slots: tuple[str, ...]  # worker addresses, index = rank (empty while not holding slots)
    step: int
    error: str | None
    restarts: int
    faults: tuple[dict[str, Any], ...]
    goodput: dict[str, float]
    submitted: float
    started: float | None
    ended: float | None
    size: int  # ranks of the current generation (0 while it holds no slots)
    min_size: int
    max_size: int
    target_size: int  # the size asked for (``world_size`` until a resize asks for another)
    resize_note: str  # why a resize the user asked for has not happened yet ("" if none)
    knob_seq: int = 0  # the newest knob change accepted (``core.knobs``)
    waiting_s: float = 0.0  # a queued job: seconds in this wait so far (0 otherwise)
    #: A goodput-sized job's fitted speedup curve, one point per size it may run at
    #: (``GoodputModel.points``); empty for other jobs.
    speedup: tuple[dict[str, Any], ...] = ()
    #: A goodput-sized job's gradient noise scale (samples), as rank 0 last estimated it.
    noise_scale: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @classmethod
    def before_news(cls, spec: JobSpec, *, submitted: float) -> JobStatus:
        """What a client knows of a job before the controller says more: its spec."""
        return cls(job_id=spec.job_id, name=spec.name, owner="", team=spec.team,
                   priority=spec.priority, world_size=spec.world_size, steps=spec.steps,
                   state=JobState.QUEUED.value, reason="waiting for the scheduler",
                   generation=-1, slots=(), step=0, error=None, restarts=0, faults=(),
                   goodput={}, submitted=submitted, started=None, ended=None, size=0,
                   min_size=spec.bounds[0], max_size=spec.bounds[1],
                   target_size=spec.world_size, resize_note="")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], fallback: JobStatus) -> JobStatus:
        """A status as it came over the wire (``to_dict()``, or the part of it a client may
        see: ``nbtrain.engine.access.shown_status``), parsed once. A field that is missing,
        ``None`` where it may not be, or unreadable (a bad record, an older controller)
        keeps ``fallback``'s value; a state that is not a ``JobState`` too."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            read = _STATUS_READERS.get(str(f.type))
            try:
                value = data[f.name] if read is None else read(data[f.name])
            except (TypeError, ValueError, OverflowError):
                continue
            if value is not None or str(f.type).endswith("| None"):
                values[f.name] = value
        if values.get("state") not in {s.value for s in JobState}:
            values.pop("state", None)
        return replace(fallback, **values)


def _none_or(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else kind(v)


def _faults(value: Any) -> tuple[dict[str, Any], ...]:
    return tuple(dict(f) for f in value if isinstance(f, Mapping))


def _goodput(value: Any) -> dict[str, float]:
    return {str(k): float(v) for k, v in dict(value).items()}


#: How each annotation of a ``JobStatus`` field is read from a wire value.
_STATUS_READERS: dict[str, Callable[[Any], Any]] = {
    "str": _none_or(str), "str | None": _none_or(str), "int": _none_or(int),
    "int | None": _none_or(int), "float": _none_or(float), "float | None": _none_or(float),
    "tuple[str, ...]": _none_or(lambda v: tuple(str(x) for x in v)),
    "tuple[dict[str, Any], ...]": _none_or(_faults), "dict[str, float]": _none_or(_goodput),
}


class LiveJob:
    """The machine's record of one job."""

    def __init__(self, sub: JobSubmission, now: float, wall: float) -> None:
        self.sub = sub
        self.spec = sub.spec
        self.state = JobState.QUEUED
        self.reason = "waiting for the scheduler"
        self.queue_note = ""  # why it is queued again (a restart, a preemption, a resume)
        self.generation = -1
        self.gen: Generation | None = None
        self.step = 0
        self.error: str | None = None
        self.submitted = wall
        self.started: float | None = None
        self.ended: float | None = None
        self.restarts: list[float] = []
        #: Rank 0's latest gradient noise scale (a goodput-sized job's; None: none sent).
        self.noise_scale: float | None = None
        self.fault_log: list[dict[str, Any]] = []
        self.planned: list[Fault] = list(sub.faults)
        self.fired: set[str] = set()
        self.committed_step = sub.resume_step
        self.ledger = GoodputLedger(now)
        self.stragglers = StragglerWatch(sub.spec.world_size, mitigation=sub.mitigation)
        self.recovering = ""
        self.stop_requested = False
        #: Monotonic: past it, ranks still running after a stop request are stopped.
        self.stop_deadline: float | None = None
        self.preempt: Preemption | None = None
        self.checkpoint_seq = 0
        self.halt_reason = ""
        self.plan = ResizePlan(target=sub.spec.world_size)
        self.watchdog = sub.policy.watchdog()
        self.longest_step = 0.0  # the longest step seen (first steps of a generation aside)
        #: Restored PREEMPTED by a restarted controller: kept out of the gang scheduler until
        #: ``resume()`` submits it there again.
        self.parked = False
        #: Declared knobs, pending changes and the applied history (``core.knobs``).
        self.knobs = KnobBook.replaying(sub.knob_history)
        self.knobs.offer(self.stragglers.specs())
        self.stragglers.follow(self.knobs.history)

    @property
    def id(self) -> str:
        return self.spec.job_id

    @property
    def name(self) -> str:
        return self.spec.name

    def carry(self, now: float, wall: float) -> CarriedHistory:
        """What a restarted controller needs to continue this job (see ``restore``)."""
        return CarriedHistory(
            generation=self.generation, step=self.step, committed_step=self.committed_step,
            restarts_wall=tuple(wall - (now - t) for t in self.restarts),
            faults=tuple({k: v for k, v in f.items() if not k.startswith("_")}
                         for f in self.fault_log),
            planned=tuple(f.to_dict() for f in self.planned), fired=tuple(sorted(self.fired)),
            held=self.state is JobState.PREEMPTED, stopping=self.stop_requested,
            target=self.plan.target,
            last_size=self.plan.last_size, submitted=self.submitted, started=self.started,
            knobs=self.knobs.wire(), goodput={**self.ledger.carry(now), "wall": wall})

    def restore(self, carried: CarriedHistory, now: float, wall: float) -> dict[str, Any]:
        """Continue from what an earlier controller knew; returns the fault to record for
        its restart (charged to no restart budget)."""
        self.generation = carried.generation
        self.step = carried.step
        self.committed_step = max(self.committed_step, carried.committed_step)
        # Budget times are kept on this controller's monotonic clock.
        self.restarts = [now - (wall - w) for w in carried.restarts_wall]
        self.fault_log = [dict(f) for f in carried.faults]
        if carried.planned:
            self.planned = [Fault.from_dict(dict(f)) for f in carried.planned]
        self.fired = set(carried.fired)
        self.plan.target = carried.target or self.plan.target
        self.plan.last_size = carried.last_size
        self.submitted = carried.submitted or self.submitted
        self.started = carried.started
        if carried.knobs:
            self.knobs = KnobBook.from_wire(carried.knobs)
            self.knobs.offer(self.stragglers.specs())
            self.stragglers.follow(self.knobs.history)
        lost = max(0, self.step - self.committed_step)
        if carried.goodput:  # its totals go on; the steps it had at risk are its count
            self.ledger = GoodputLedger.continued(
                carried.goodput, now, wall - float(carried.goodput.get("wall", wall)))
            lost = GoodputLedger.at_risk_steps(carried.goodput)
        fault: dict[str, Any] = {
            **fault_event(wall, what="controller", rank=None, host=None, step=self.step,
                          generation=self.generation, error=CONTROLLER_RESTARTED,
                          cause=f"{CONTROLLER_RESTARTED}: the job continues from its newest "
                                f"committed checkpoint (step {self.committed_step})",
                          detect_s=None),
            "lost_steps": lost if carried.generation >= 0 else 0,
            "resume_step": self.committed_step, "budget": False, "_detected_mono": now}
        self.fault_log.append(fault)
        return fault

    def unfired_faults(self) -> tuple[Fault, ...]:
        return tuple(f for f in self.planned if f.id not in self.fired)

    def consume_faults(self, rank: int, step: int) -> None:
        """A failure of ``rank`` at ``step`` used up the one-shot faults planned there, even if
        their announcement was lost with the process: they must not fire after the restart."""
        for planned in self.planned:
            if (planned.rank == rank and planned.one_shot
                    and (planned.step is None or planned.step <= step + 1)):
                self.fired.add(planned.id)

    def public_faults(self) -> tuple[dict[str, Any], ...]:
        return tuple({k: v for k, v in f.items() if not k.startswith("_")}
                     for f in self.fault_log)

    def control(self) -> GenerationControl | None:
        """The live generation's control (None between generations)."""
        gen = self.gen
        if gen is None:
            return None
        return GenerationControl(gen.number, gen.control_version, dict(gen.control),
                                 tuple(c.to_dict() for c in self.knobs.pending))

    def status(self, now: float, addresses: tuple[str, ...]) -> JobStatus:
        return JobStatus(
            job_id=self.id, name=self.name, owner=self.sub.owner, team=self.spec.team,
            priority=self.spec.priority, world_size=self.spec.world_size, steps=self.spec.steps,
            state=self.state.value, reason=self.reason, generation=self.generation,
            slots=addresses, step=self.step, error=self.error, restarts=len(self.restarts),
            faults=self.public_faults(), goodput=self.ledger.snapshot(now).as_dict(),
            submitted=self.submitted, started=self.started, ended=self.ended,
            size=self.gen.size if self.gen is not None and self.state.holds_slots else 0,
            min_size=self.spec.bounds[0], max_size=self.spec.bounds[1],
            target_size=self.plan.target, resize_note=self.plan.note, knob_seq=self.knobs.seq,
            noise_scale=self.noise_scale,
            waiting_s=(self.ledger.in_phase_s(now) if self.state is JobState.QUEUED
                       and self.ledger.phase == "queued" else 0.0),
        )


def primary_failure(failures: dict[int, RankFailureInfo]) -> tuple[int, RankFailureInfo]:
    """The cause, not the consequences: a rank whose worker died, else the earliest failure
    that is not a peer's reaction. A worker's death is noticed after what its peers raised
    meanwhile (a broken collective, their DataLoader children gone), so it comes first."""
    causes = ([(r, f) for r, f in failures.items() if f.lost_worker]
              or [(r, f) for r, f in failures.items() if not f.peer] or list(failures.items()))
    return min(causes, key=lambda rf: rf[1].when)
