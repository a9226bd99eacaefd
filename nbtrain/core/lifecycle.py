"""The job machine: every live job's lifecycle as a pure state machine, events in, commands out.

``JobMachine.handle(event) -> list[Command]`` is the whole API (plus read-only views). The
engine's controller, a thin shell living with the Dask scheduler, feeds it what happens
(submissions, users' requests, rank events and exits, workers joining and leaving, ticks of
time) and carries out what it says (launch a generation, set control flags, restart workers,
publish events). It reads no clock and does no I/O, so every transition is a unit test.

Admission is not decided here: the machine drives :class:`nbtrain.core.scheduler.Scheduler`
(gang admission, priorities, preemption, fair share, reservation and backfill) and turns its
decisions into generations. What the machine adds is what the scheduler does not know about:

- **Generations.** Each (re)start of a job's gang; it ends when every rank has exited. How it
  ended decides what comes next, in this order: a stop request wins (CANCELLED, also while a
  preemption or a straggler's replacement is in flight), then failures (recovery within the
  restart budget, else FAILED), then preemptions (by the user: PREEMPTED until ``resume``; by
  the scheduler or for a straggler's replacement: queued again), then completion.
- **Failures.** A rank that raised, a worker that died, a generation with no progress (the
  hang watchdog). Peers of a failed rank still blocked in a collective are released after
  ``peer_release_s``: on CPU slots (gloo) by restarting the failed rank's worker (gloo keeps
  its connections open while DDP holds the group), on GPU slots (NCCL) by aborting the
  peers' communicators, which keeps their processes and CUDA contexts; ranks still running
  ``failure_grace_s`` after a failure are stopped by restarting their workers. Every fault
  is recorded with one readable cause.
- **Slots whose workers restart.** A slot whose worker is asked to restart is offline for the
  scheduler until a worker backs it again; one that does not come back within
  ``worker_return_s`` is reported lost.
- **Preemption grace.** A job told to release its slots gets ``preempt_grace_s`` to
  checkpoint; after that its ranks are stopped and it resumes from its last committed
  checkpoint (the steps after it are counted as lost).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from nbtrain.core.health import HostHealth, waits_for_checkpoint_writer
from nbtrain.core.inventory import Inventory, WorkerInfo
from nbtrain.core.job import JobState
from nbtrain.core.jobevents import (
    fault_event,
    nonfinite_event,
    preemption_event,
    recovery_event,
    resize_event,
    state_event,
)
from nbtrain.core.jobrecord import (
    CONTROLLER_RESTARTED,
    Generation,
    JobStatus,
    LiveJob,
    PendingResize,
    Preemption,
    primary_failure,
)
from nbtrain.core.lifecycle_types import (
    AbortCollectives,
    Cancel,
    CarriedHistory,
    Command,
    ControllerFailed,
    Deliver,
    Diagnose,
    EndGeneration,
    Event,
    HangDiagnosed,
    JobSubmission,
    Launch,
    MachineConfig,
    Publish,
    RankExit,
    RankFailureInfo,
    RankMessage,
    Rejected,
    Request,
    RestartWorkers,
    SetControl,
    Submitted,
    Tick,
    WorkerJoined,
    WorkerLeft,
)
from nbtrain.core.mesh import MeshPlan, RankPlace, mesh_plan
from nbtrain.core.mitigation import ActionKind, SlotInfo
from nbtrain.core.placement import Placement
from nbtrain.core.pools import CPU, GPU, DevicePools
from nbtrain.core.records import ROW_COLUMNS
from nbtrain.core.sched_types import (
    Cancelled,
    Checkpointed,
    Decision,
    Failed,
    Finished,
    JobRequest,
    PreemptJob,
    RejectJob,
    Released,
    ResizeJob,
    ResizeRequested,
    Resume,
    SchedulerConfig,
    StartJob,
    Submit,
    Suspend,
    WorkersAdded,
    WorkersRemoved,
)
from nbtrain.core.sched_types import Event as SchedEvent
from nbtrain.core.sched_types import Tick as SchedTick
from nbtrain.core.stragglerwatch import mitigation_event

__all__ = ["JobMachine", "SlotView"]

#: One-line explanations of fault kinds, used in causes.
_LOST = "worker died"
#: Position of the metrics dict in a rank's step row.
METRICS_AT = len(ROW_COLUMNS)


class SlotView(dict[str, Any]):
    """A slot for display: ``slot``, ``host``, ``nvlink``, ``leaf``, ``address`` (None while
    offline), ``state`` (free / held / restarting / offline), ``job`` (the holder's id),
    ``device`` (``gpu`` or ``cpu``) and ``gpu`` (its GPU's UUID, "" for a CPU slot)."""


class JobMachine:
    """Lifecycle of every job on one cluster. See the module docstring."""

    def __init__(self, config: MachineConfig | None = None,
                 scheduler: SchedulerConfig | None = None) -> None:
        self.config = config or MachineConfig()
        self.sched_config = replace(scheduler or SchedulerConfig(), can_grow=True)
        self.sched: DevicePools | None = None  # made when the first worker joins
        self.inventory = Inventory()
        self.health = HostHealth(self.config.host_failure_limit,
                                 self.config.host_failure_window_s, self.config.host_exclusion_s)
        self.now = 0.0
        self.wall = 0.0
        self._jobs: dict[str, LiveJob] = {}
        self._live: dict[str, LiveJob] = {}  # jobs with a generation (ticks walk only these)
        self._pending: list[str] = []  # submitted before any worker joined
        self._offline: set[str] = set()  # slots the scheduler has been told are offline
        self._restarting: dict[str, float] = {}  # slot -> when its restart was asked
        self._last_sched_tick = -1e18
        self._out: list[Command] = []
        self._queue_dirty = False
        self._in_pass = False
        self._asking: str | None = None  # the job whose user request the scheduler decides
        self._deferred: dict[str, Placement] = {}  # placed on slots a shrinking job still holds
        self._sched_later: list[SchedEvent] = []  # fed after the decisions being carried out

    # ================================================================== the API
    def handle(self, event: Event) -> list[Command]:
        """Apply one event; returns the commands to carry out, in order."""
        self.now, self.wall = event.now, event.wall
        self._out = []
        if isinstance(event, RankMessage):
            self._on_rank_message(event)
        elif isinstance(event, RankExit):
            self._on_rank_exit(event)
        elif isinstance(event, Tick):
            self._on_tick()
        elif isinstance(event, Submitted):
            self._on_submitted(event.job)
        elif isinstance(event, Request):
            self._on_request(event)
        elif isinstance(event, WorkerJoined):
            self._on_worker_joined(event)
        elif isinstance(event, WorkerLeft):
            self._on_worker_left(event.address)
        elif isinstance(event, HangDiagnosed):
            self._on_hang_diagnosed(event)
        elif isinstance(event, ControllerFailed):
            self._on_controller_failed(event)
        else:
            raise TypeError(f"unknown event {event!r}; see nbtrain.core.lifecycle_types.Event")
        if self._queue_dirty:
            self._explain_queue()
        out, self._out = self._out, []
        return out

    def status(self, job_id: str) -> JobStatus:
        """Snapshot of one job; ``KeyError`` for an unknown (or forgotten) id."""
        job = self._jobs[job_id]
        return job.status(self.now, self._addresses(job))

    def job_ids(self) -> list[str]:
        """Known jobs in submit order."""
        return list(self._jobs)

    def forget(self, job_id: str) -> None:
        """Drop an ended job's record (the engine keeps a bounded history)."""
        job = self._jobs.get(job_id)
        if job is not None and job.state.terminal:
            del self._jobs[job_id]
            if self.sched is not None:
                self.sched.forget(job_id)

    def slots(self) -> list[SlotView]:
        """Every slot the cluster has had, with its state and holder."""
        owners: dict[Hashable, str | None] = {}
        if self.sched is not None:
            owners = self.sched.owner_map()
        out = []
        for rec in self.inventory.records():
            holder = owners.get(rec.slot)
            if rec.slot in self._restarting:
                state = "restarting"
            elif rec.address is None:
                state = "offline"
            else:
                state = "held" if holder is not None else "free"
            out.append(SlotView(slot=rec.slot, host=rec.host, nvlink=rec.nvlink or rec.host,
                                leaf=rec.leaf, address=rec.address, state=state, job=holder,
                                device=GPU if rec.gpu else CPU, gpu=rec.gpu))
        return out

    def team_usage(self) -> dict[str, float]:
        """Slot-seconds held per team so far (the scheduler's fair-share ledger)."""
        return {} if self.sched is None else self.sched.team_usage()

    # ================================================================== submission
    def _on_submitted(self, sub: JobSubmission) -> None:
        spec = sub.spec
        if spec.job_id in self._jobs:
            self._out.append(Rejected(spec.job_id, f"job id {spec.job_id!r} is already in use"))
            return
        job = LiveJob(sub, self.now, self.wall)
        self._jobs[job.id] = job
        if sub.carried is not None:
            self._restore(job, sub.carried)
            if job.parked:
                return
        self._publish(job, state_event(self.wall, job.state.value, job.reason))
        if self.sched is None:
            if not spec.queue and sub.carried is None:
                self._reject(job, 0, 0)
                return
            self._pending.append(job.id)
            self._set_state(job, JobState.QUEUED, f"needs {spec.world_size} slots at once; the "
                                                  "cluster has 0: waiting for workers to join")
            return
        self._admit(job)

    def _restore(self, job: LiveJob, carried: CarriedHistory) -> None:
        """A job an earlier controller ran: its history continues, a fault records the
        restart (no restart-budget charge); a held job stays PREEMPTED (out of the gang
        scheduler until ``resume()``), any other waits for slots to resume from its newest
        committed checkpoint."""
        fault = job.restore(carried, self.now, self.wall)
        self._publish(job, {k: v for k, v in fault.items() if not k.startswith("_")})
        if carried.held:
            job.parked = True
            job.ledger.enter("queued", self.now)
            self._set_state(job, JobState.PREEMPTED, f"preempted (restored after a "
                                                     f"{CONTROLLER_RESTARTED}); resume() "
                                                     "queues it again")
            return
        if carried.generation >= 0:
            job.recovering = CONTROLLER_RESTARTED
            job.queue_note = CONTROLLER_RESTARTED
            job.ledger.enter("recovery", self.now)
        job.reason = f"{CONTROLLER_RESTARTED}: waiting for slots"

    def carry(self, job_id: str) -> CarriedHistory:
        """What a restarted controller needs to continue a job (``KeyError`` if unknown)."""
        return self._jobs[job_id].carry(self.now, self.wall)

    def _admit(self, job: LiveJob) -> None:
        spec = job.spec
        # ``target``: the size asked for, the world size unless a resize (carried over a
        # controller restart) asked for another.
        request = JobRequest(job_id=job.id, size=job.target if spec.resizable
                             else spec.world_size, priority=spec.priority,
                             team=spec.team, layout=spec.layout,
                             min_size=spec.bounds[0] if spec.resizable else None)
        self._sched(Submit(self.now, request))
        if job.id not in self._jobs:  # rejected by the scheduler
            return
        if not spec.queue and job.gen is None and job.sub.carried is None:
            assert self.sched is not None
            kind = self.sched.kind_of(job.id)
            free, online = self.sched.free_of(kind), self.sched.online_of(kind)
            self._sched(Cancelled(self.now, job.id))
            self._reject(job, free, online)

    def _reject(self, job: LiveJob, free: int, online: int) -> None:
        del self._jobs[job.id]
        unit = self._unit(self.sched.kind_of(job.id) if self.sched is not None else "")
        self._out.append(Rejected(job.id, (
            f"job {job.name} needs {job.spec.world_size} {unit} at once but only {free} of the "
            f"cluster's {online} are free (queue=False, so it is not queued): free slots, add "
            "workers, or submit with queue=True")))

    def _job_kind(self, job_id: str) -> str:
        """The device kind a job needs: its ``device``, or for ``auto`` GPU slots when the
        cluster has any (asked once, when the job enters the gang scheduler)."""
        device = self._jobs[job_id].spec.device
        if device != "auto":
            return device
        return GPU if any(r.gpu for r in self.inventory.records()) else CPU

    def _kind_of(self, job: LiveJob) -> str:
        return self.sched.kind_of(job.id) if self.sched is not None else ""

    def _slot_kind(self, slot: Hashable) -> str:
        return GPU if self.inventory.record(str(slot)).gpu else CPU

    def _slot_counts(self, kind: str) -> tuple[int, int]:
        """(slots ever seen, slots restarting) of ``kind``; counted by kind only where kinds
        mix, so a one-kind cluster pays what it paid before."""
        if self.sched is None or self.sched.kinds() in ([], [kind]):
            return len(self.inventory.records()), len(self._restarting)
        return (sum(1 for r in self.inventory.records() if self._slot_kind(r.slot) == kind),
                sum(1 for s in self._restarting if self._slot_kind(s) == kind))

    def _unit(self, kind: str) -> str:
        """"slots" on a cluster of one kind; "GPU slots" / "CPU slots" where kinds mix or the
        job's kind has no slot yet."""
        kinds = self.sched.kinds() if self.sched is not None else []
        return "slots" if not kind or kinds == [kind] else f"{kind.upper()} slots"

    # ================================================================== the gang scheduler
    def _sched(self, event: SchedEvent) -> None:
        """Feed the gang scheduler and carry its decisions out, in order."""
        assert self.sched is not None
        assert not self._in_pass, "the scheduler was fed while its decisions were carried out"
        self._in_pass = True
        try:
            decisions = self.sched.handle(event)
        finally:
            self._in_pass = False
        self._queue_dirty = True
        for d in decisions:
            self._carry_out(d)
        while self._sched_later:
            self._sched(self._sched_later.pop(0))

    def _carry_out(self, d: Decision) -> None:
        job = self._jobs.get(d.job_id)
        if isinstance(d, StartJob):
            assert job is not None, f"the scheduler started unknown job {d.job_id}"
            self._start(job, d.placement)
        elif isinstance(d, PreemptJob):
            if job is not None:
                self._preempt_for_scheduler(job, d)
        elif isinstance(d, RejectJob):
            if job is not None and self._asking == job.id:
                self._out.append(Rejected(job.id, d.reason))  # a request the user made now
            elif job is not None and job.gen is None and job.state is JobState.QUEUED:
                del self._jobs[job.id]
                self._out.append(Rejected(job.id, d.reason))
            elif job is not None:
                self._publish_cluster({"kind": "scheduler", "job": job.id, "reason": d.reason})
        elif isinstance(d, ResizeJob) and job is not None:
            self._resize(job, d)

    def _start(self, job: LiveJob, placement: Placement) -> None:
        busy = self._busy_slots() & {str(s) for s in placement.slots}
        if busy:
            # The scheduler frees a shrinking job's slots when it decides the shrink; its
            # ranks leave them at the next step boundary. Launch when they have.
            self._deferred[job.id] = placement
            holders = sorted({j.name for j in self._live.values() if j.gen is not None
                              and busy & set(j.gen.slots)})
            self._set_state(job, JobState.STARTING, f"waiting for {', '.join(holders)} to "
                                                    f"hand over {len(busy)} slot(s)")
            return
        self._deferred.pop(job.id, None)
        number = job.generation + 1
        slots = tuple(str(s) for s in placement.slots)
        addresses = tuple(self.inventory.address_of(s) or "" for s in slots)
        assert all(addresses), f"the scheduler placed job {job.id} on an offline slot"
        gen = Generation(number=number, slots=slots, addresses=addresses, started=self.now,
                         last_progress=self.now)
        if (job.resizing is None and job.last_size is not None
                and job.last_size != len(slots)):
            # A restart (recovery, resume) at another size: the fewer slots there are now, or
            # the more that returned. A resize all the same, for the events and the plots.
            why = (f"{job.recovering}; {len(slots)} of {job.target} ranks fit now"
                   if job.recovering else f"{len(slots)} of {job.target} ranks fit now")
            job.resizing = PendingResize(placement=placement, old_size=job.last_size,
                                         reason=why, asked=self.now)
        if job.last_size is not None and job.last_size != len(slots):
            # Rows of the new ranks may arrive before rank 0 says it started (which resets
            # the detector again, at the step it restored).
            for event in job.stragglers.restart(len(slots), job.committed_step):
                self._publish(job, event)
        job.last_size = len(slots)
        job.gen = gen
        self._growth_note(job)
        self._live[job.id] = job
        job.generation = number
        job.checkpoint_seq = 0
        job.queue_note = ""
        if job.started is None:
            job.started = self.wall
        job.ledger.enter("recovery" if job.recovering or job.resizing else "startup", self.now)
        what = (f"recovering ({job.recovering})" if job.recovering else
                f"resized from {job.resizing.old_size} ranks" if job.resizing else "starting")
        if job.resizing is not None:
            self._publish(job, resize_event(self.wall, phase="started",
                                            old=job.resizing.old_size, new=len(slots),
                                            reason=job.resizing.reason, generation=number))
        self._set_state(job, JobState.STARTING, f"generation {number}: {what}, "
                                                f"{len(slots)} ranks")
        self._out.append(Launch(job.id, number, addresses, job.unfired_faults(),
                                dict(gen.control), device=self._kind_of(job),
                                mesh=self._mesh_plan(job, slots)))

    def _mesh_plan(self, job: LiveJob, slots: tuple[str, ...]) -> MeshPlan:
        """The generation's mesh on its slots (rank order is placement order)."""
        places = []
        for slot in slots:
            rec = self.inventory.record(slot)
            places.append(RankPlace(slot=slot, host=rec.host, nvlink=rec.nvlink or rec.host))
        return mesh_plan(job.spec.mesh, places)

    def _busy_slots(self) -> set[str]:
        """Slots with a rank still running on them."""
        return {gen.slots[r] for j in self._live.values() if (gen := j.gen) is not None
                for r in gen.unfinished()}

    def _launch_deferred(self) -> None:
        for job_id, placement in list(self._deferred.items()):
            job = self._jobs.get(job_id)
            if job is None or job.state.terminal:
                self._deferred.pop(job_id, None)
            elif not self._busy_slots() & {str(s) for s in placement.slots}:
                self._start(job, placement)

    def _resize(self, job: LiveJob, d: ResizeJob) -> None:
        """The scheduler gave the job a new placement (a resize it was asked for, growth into
        idle slots, a shrink for a waiting job): end the generation at the next step
        boundary, through the preemption path (checkpoint, commit), and start the next one
        there. A generation already failing or stopping ends by itself, and the job is then
        requeued (and restarted at the largest size that fits) or ended."""
        if job.id in self._deferred:  # not launched yet: launch it there instead
            self._deferred[job.id] = d.placement
            self._launch_deferred()
            return
        gen = job.gen
        new = d.placement.world_size
        if gen is None or gen.failing or job.stop_requested or (
                job.preempt is not None and job.preempt.cause != "resize"):
            return
        job.resize = PendingResize(placement=d.placement, old_size=gen.size, reason=d.reason,
                                   asked=self.now)
        self._publish_cluster({"kind": "resize", "job": job.id,
                               "reason": f"{job.name} resized {gen.size} -> {new} ranks: "
                                         f"{d.reason}"})
        self._growth_note(job)
        self._publish(job, resize_event(self.wall, phase="requested", old=gen.size, new=new,
                                        reason=d.reason, generation=gen.number))
        if job.preempt is None:
            job.preempt = Preemption(cause="resize", reason=d.reason,
                                     deadline=self.now + self.sched_config.preempt_grace_s)
            self._set_control(job, preempt=1)
        self._set_state(job, JobState.STOPPING,
                        f"resizing from {gen.size} to {new} ranks ({d.reason}): checkpoint at "
                        "the next step boundary")

    def _explain_queue(self) -> None:
        """Say why each queued job waits: the head of its kind's queue needs more free slots
        than there are; the others wait behind it."""
        self._queue_dirty = False
        if self.sched is None:
            return
        heads: dict[str, tuple[str, str]] = {}  # device kind -> (head's name, why)
        for job_id in self.sched.queued():
            job = self._jobs.get(job_id)
            if job is None or job.state is not JobState.QUEUED:
                continue
            need = job.spec.world_size
            kind = self.sched.kind_of(job_id)
            head_name, head_why = heads.get(kind, ("", ""))
            if not head_name:
                free, online = self.sched.free_of(kind), self.sched.online_of(kind)
                total, restarting = self._slot_counts(kind)
                offline = total - online - restarting
                away = ", ".join(f"{n} {what}" for n, what in ((restarting, "restarting"),
                                                             (offline, "offline")) if n)
                away = f" ({away})" if away else ""
                unit = self._unit(kind)
                if need > online:
                    why = (f"needs {need} {unit} at once; the cluster has {online}{away}: "
                           "waiting for workers to join")
                else:
                    why = f"needs {need} {unit} at once; {free} of {online} free{away}"
                    releasing = [j.name for j in self._live.values()
                                 if j.preempt is not None and j.preempt.for_job == job.id]
                    if releasing:
                        why += f"; preempted {', '.join(releasing)} releasing its slots"
                heads[kind] = (job.name, why)
            else:
                why = f"waiting behind job {head_name} ({head_why})"
            reason = f"{job.queue_note}: {why}" if job.queue_note else why
            self._set_state(job, JobState.QUEUED, reason)

    # ================================================================== workers
    def _on_worker_joined(self, ev: WorkerJoined) -> None:
        sharing = next((r for r in self.inventory.records()
                        if r.gpu == ev.gpu and r.address is not None), None) if ev.gpu else None
        if sharing is not None and sharing.address != ev.address:
            # Two workers on one GPU: ranks on both would share it by accident.
            self._publish_cluster({
                "kind": "worker", "what": "refused", "address": ev.address, "host": ev.host,
                "reason": f"it runs on GPU {ev.gpu}, which worker {sharing.address} (slot "
                          f"{sharing.slot}) already uses: start one worker per GPU, each "
                          "with its own CUDA_VISIBLE_DEVICES (dask cuda worker does)"})
            return
        rec = self.inventory.join(WorkerInfo(address=ev.address, host=ev.host, name=ev.name,
                                             nvlink=ev.nvlink, leaf=ev.leaf, gpu=ev.gpu))
        self._restarting.pop(rec.slot, None)
        self._publish_cluster({"kind": "worker", "what": "joined", "slot": rec.slot,
                               "address": ev.address, "host": rec.host})
        first = self.sched is None
        if self.sched is None:
            self.sched = DevicePools(self.sched_config, slot_kind=self._slot_kind,
                                     job_kind=self._job_kind)
        self._offline.discard(rec.slot)
        nvlink: dict[Hashable, str] = {rec.slot: rec.nvlink} if rec.nvlink else {}
        leaf = {rec.host: rec.leaf} if rec.leaf else {}
        try:
            self._sched(WorkersAdded(self.now, {rec.host: (rec.slot,)}, nvlink_of=nvlink,
                                     leaf_of=leaf))
        except ValueError as exc:
            # Labels that make no topology (a multi-host NVLink domain across leaf switches,
            # a host split between such a domain and others): the topology is unchanged,
            # so keep the worker out rather than stop the controller.
            self.inventory.leave(ev.address)
            self._offline.add(rec.slot)
            self._publish_cluster({
                "kind": "worker", "what": "refused", "address": ev.address, "host": ev.host,
                "reason": f"its labels (NVLink domain {ev.nvlink or ev.host!r}, leaf "
                          f"{ev.leaf!r}) do not fit the cluster's topology: {exc}"})
            return
        if first:
            pending, self._pending = self._pending, []
            for job_id in pending:
                job = self._jobs.get(job_id)
                if job is not None and job.state is JobState.QUEUED:
                    self._admit(job)

    def _on_worker_left(self, address: str) -> None:
        rec = self.inventory.leave(address)
        if rec is None:
            return
        slot = rec.slot
        self._publish_cluster({"kind": "worker", "what": "left", "slot": slot,
                               "address": address, "host": rec.host,
                               "restarting": slot in self._restarting})
        hit: list[LiveJob] = []
        for job in self._live.values():
            gen = job.gen
            if gen is None or slot not in gen.slots:
                continue
            rank = gen.slots.index(slot)
            if rank in gen.outcomes or rank in gen.failures:
                continue
            self._record_failure(gen, rank, RankFailureInfo(
                error=f"worker {address} left the cluster (its process died)",
                traceback="(no traceback: the worker process is gone)", host=rec.host,
                step=job.step, when=self.wall, peer=False, lost_worker=True))
            self._out.append(Cancel(job.id, gen.number, (rank,)))
            hit.append(job)
        self._take_offline([slot])
        for job in hit:
            if job.gen is not None and job.gen.finished():
                self._end_generation(job)

    def _take_offline(self, slots: Iterable[str]) -> None:
        new = tuple(s for s in slots if s not in self._offline)
        if not new or self.sched is None:
            return
        self._offline.update(new)
        self._sched(WorkersRemoved(self.now, new))

    def _restart_workers(self, addresses: Iterable[str], reason: str) -> None:
        """Restart workers through their nannies; their slots stay offline until a worker
        backs them again (a slot is never offered while its worker restarts)."""
        todo: list[str] = []
        slots: list[str] = []
        for address in dict.fromkeys(addresses):
            slot = self.inventory.slot_of(address)
            if slot is None or slot in self._restarting:
                continue
            self._restarting[slot] = self.now
            todo.append(address)
            slots.append(slot)
        if not todo:
            return
        self._take_offline(slots)
        self._out.append(RestartWorkers(tuple(todo), reason))

    # ================================================================== rank events
    def _on_rank_message(self, ev: RankMessage) -> None:
        job = self._jobs.get(ev.job_id)
        if job is None:
            return
        msg = ev.msg
        kind = msg.get("kind")
        gen = job.gen
        current = gen is not None and msg.get("gen") == gen.number
        if kind == "steps":
            if current:
                assert gen is not None
                self._on_steps(job, gen, int(msg["rank"]), msg["rows"])
            return
        if kind == "phase":  # a rank's startup progress, for the startup watchdog
            if current:
                assert gen is not None
                gen.phases[int(msg["rank"])] = (str(msg["phase"]), self.now)
            return
        if kind == "device":  # GPU readings for straggler verdicts; too frequent for the log
            if current:
                job.stragglers.device(int(msg["rank"]), dict(msg.get("readings") or {}))
            return
        self._publish(job, msg)
        if kind == "checkpoint":
            phase = msg.get("phase")
            if phase == "committed":
                step = int(msg["step"])
                job.ledger.committed(step)
                if step > job.committed_step:
                    job.committed_step = step
                    if self.sched is not None and job.gen is not None:
                        self._sched(Checkpointed(self.now, job.id))
            elif phase == "snapshot" and msg.get("rank") == 0:
                job.ledger.checkpoint_blocked(
                    (float(msg.get("blocking_ms", 0)) + float(msg.get("wait_ms", 0))) / 1e3)
        elif kind == "rank_started" and current:
            assert gen is not None
            gen.phases[int(msg["rank"])] = ("first step", self.now)
            if msg.get("rank") == 0:
                for event in job.stragglers.restart(gen.size, int(msg["start_step"])):
                    self._publish(job, event)
        elif kind == "fault_injected" and current:
            assert gen is not None
            job.fired.add(str(msg["fault"]["id"]))
            gen.injected = dict(msg)

    def _on_steps(self, job: LiveJob, gen: Generation, rank: int, rows: list[Any]) -> None:
        gen.last_progress = self.now
        self._check_finite(job, gen, rank, rows)
        if rank == 0 and rows:
            for row in rows:
                job.ledger.step(int(row[0]), float(row[2]))
                if gen.step_times:  # the first step of a generation warms up: not counted
                    job.longest_step = max(job.longest_step, float(row[2]))
                gen.step_times.append(float(row[2]))
            job.step = max(job.step, int(rows[-1][0]))
        try:
            events = job.stragglers.observe(rank, rows)
        except ValueError:  # malformed timing (e.g. clock jumps): skip, never break the job
            events = []
        for event in events:
            self._publish(job, event)
        if not gen.running:
            gen.running = True
            job.ledger.enter("training", self.now)
            if job.recovering:
                self._finish_recovery(job, gen, rows)
            if job.resizing is not None:
                done, job.resizing = job.resizing, None
                self._publish(job, resize_event(
                    self.wall, phase="done", old=done.old_size, new=gen.size,
                    reason=done.reason, generation=gen.number,
                    duration_s=self.now - done.asked))
            if job.state is JobState.STARTING:
                self._set_state(job, JobState.RUNNING, f"training (generation {gen.number})")
        if rank == 0 and job.state is JobState.RUNNING:
            self._mitigate(job, gen)

    def _check_finite(self, job: LiveJob, gen: Generation, rank: int,
                      rows: list[Any]) -> None:
        """A NaN or infinite metric is news at once; with ``on_nonfinite="halt"`` the job
        stops without checkpointing the bad state."""
        for row in rows:
            metrics = row[METRICS_AT] if len(row) > METRICS_AT else None
            if not isinstance(metrics, dict):
                continue
            for name, value in metrics.items():
                if math.isfinite(value) or name in gen.nonfinite:
                    continue
                gen.nonfinite.add(name)
                halting = job.spec.on_nonfinite == "halt" and not job.stop_requested
                self._publish(job, nonfinite_event(
                    self.wall, rank=rank, step=int(row[0]), metric=name, value=value,
                    generation=gen.number, halting=halting))
                if halting and gen.control.get("halt", 0) == 0:
                    job.halt_reason = (f"{name} was {value} at step {int(row[0])} on rank "
                                       f"{rank}")
                    self._set_control(job, halt=1)
                    self._set_state(job, JobState.STOPPING,
                                    f"halting: {job.halt_reason}; stopping without a "
                                    "checkpoint, so the newest one stays the last good state")

    def _mitigate(self, job: LiveJob, gen: Generation) -> None:
        assert self.sched is not None
        placement = {r: SlotInfo(s, self.inventory.host_of(s)) for r, s in enumerate(gen.slots)}
        spares = [SlotInfo(str(s), self.inventory.host_of(str(s)))
                  for s in self.sched.free_slot_ids(self._kind_of(job))]
        for action in job.stragglers.decide(self.now, job.step, placement, spares):
            event = mitigation_event(action)
            event["time"] = self.wall
            self._publish(job, event)
            if (action.kind is ActionKind.REPLACE and action.slot is not None
                    and job.preempt is None and not job.stop_requested):
                # Through the preemption path: checkpoint, end the generation, start again
                # without the slow slot. No committed step is lost.
                job.preempt = Preemption(cause="replace", reason=action.reason,
                                         deadline=self.now + self.sched_config.preempt_grace_s,
                                         slot=action.slot.slot)
                self._set_control(job, preempt=1)
                self._set_state(job, JobState.STOPPING, f"replacing slow rank {action.rank}: "
                                                        "checkpoint at the next step boundary")

    def _finish_recovery(self, job: LiveJob, gen: Generation, rows: list[Any]) -> None:
        fault = job.fault_log[-1] if job.fault_log else {}
        start = fault.get("_detected_mono")
        recovery_s = self.now - start if start is not None else None
        if fault:
            fault["recovery_s"] = recovery_s
        job.recovering = ""
        self._publish(job, recovery_event(
            self.wall, generation=gen.number, recovery_s=recovery_s,
            resumed_step=int(rows[0][0]) - 1 if rows else None,
            lost_steps=fault.get("lost_steps"), fault=fault.get("what")))

    def _on_rank_exit(self, ev: RankExit) -> None:
        job = self._jobs.get(ev.job_id)
        gen = job.gen if job is not None else None
        if job is None or gen is None or gen.number != ev.generation:
            return  # a late report from an ended generation
        if ev.rank in gen.outcomes or ev.rank in gen.failures:
            return
        if ev.failure is not None:
            self._record_failure(gen, ev.rank, ev.failure)
        else:
            gen.outcomes[ev.rank] = dict(ev.outcome or {})
        if gen.finished():
            self._end_generation(job)

    def _on_controller_failed(self, ev: ControllerFailed) -> None:
        """End the job FAILED at once: its running ranks' workers are restarted (their
        slots come back when the workers do), its slots released, nothing retried."""
        job = self._jobs.get(ev.job_id)
        if job is None or job.state.terminal:
            return
        gen = job.gen
        if gen is not None:
            stuck = gen.unfinished()
            if stuck:
                self._out.append(Cancel(job.id, gen.number, stuck))
                self._restart_workers([gen.addresses[r] for r in stuck],
                                      f"job {job.name}: nbtrain controller error")
            self._out.append(EndGeneration(job.id, gen.number))
            self._live.pop(job.id, None)
            job.gen = None
        job.preempt = None
        job.error = ev.error
        last = ev.error.strip().splitlines()[-1] if ev.error.strip() else "unknown error"
        self._end_job(job, JobState.FAILED, f"nbtrain controller error while handling this "
                                            f"job: {last}", Cancelled(self.now, job.id))

    def _record_failure(self, gen: Generation, rank: int, failure: RankFailureInfo) -> None:
        gen.failures[rank] = failure
        if gen.failed_at is None:
            gen.failed_at = self.now
            gen.failed_wall = self.wall

    # ================================================================== time
    def _on_tick(self) -> None:
        for job in list(self._live.values()):
            gen = job.gen
            if gen is None:
                continue
            policy = job.sub.policy
            if gen.failures and not gen.finished():
                assert gen.failed_at is not None
                waited = self.now - gen.failed_at
                if waited > policy.failure_grace_s:
                    self._force_end(job, gen)
                elif waited > policy.peer_release_s and not gen.released:
                    gen.released = True
                    if self._kind_of(job) == GPU:  # NCCL has an abort; gloo does not
                        self._out.append(AbortCollectives(
                            job.id, gen.number, tuple(gen.addresses[r] for r in
                                                      gen.unfinished()),
                            f"free the peers of job {job.name}'s failed rank"))
                    else:
                        self._restart_workers(
                            [gen.addresses[r] for r, f in gen.failures.items()
                             if not f.peer and not f.lost_worker],
                            f"free the peers of job {job.name}'s failed rank")
            elif job.preempt is not None and self.now > job.preempt.deadline and not gen.failing:
                self._force_release(job, gen)
            elif gen.running and job.state is JobState.RUNNING and gen.hang is None:
                self._watch_for_hang(job, gen)
            elif not gen.running and not gen.failing and job.preempt is None:
                self._watch_startup(job, gen)
        for slot, asked in list(self._restarting.items()):
            if self.now - asked > self.config.worker_return_s:
                del self._restarting[slot]
                self._queue_dirty = True
                self._publish_cluster({
                    "kind": "slot_lost", "slot": slot, "host": self.inventory.host_of(slot),
                    "reason": f"its worker did not come back within "
                              f"{self.config.worker_return_s:.0f} s of a restart; the cluster "
                              "has one slot fewer until a worker joins on that host"})
        if self.sched is not None and self.now - self._last_sched_tick >= (
                self.config.scheduler_tick_s):
            self._last_sched_tick = self.now
            self._sched(SchedTick(self.now))

    # ================================================================== the hang watchdog
    def _hang_limit(self, job: LiveJob, gen: Generation) -> tuple[float, str]:
        """How long a running generation may go without a step row, and why: the largest of
        ``hang_factor`` x the median step, the floor, and twice the longest step this job
        has taken (a machine that stalled a step that long before can stall it again)."""
        policy = job.sub.policy
        median = gen.median_step()
        parts = {f"{policy.hang_factor:g} x median step {median:.3f} s":
                 policy.hang_factor * median,
                 f"floor {policy.hang_floor_s:g} s": policy.hang_floor_s,
                 f"2 x longest step {job.longest_step:.2f} s": 2 * job.longest_step}
        limit = max(parts.values())
        return limit, f"max({', '.join(parts)})"

    def _watch_for_hang(self, job: LiveJob, gen: Generation) -> None:
        """No step row for longer than the limit: look at the ranks' call stacks, twice,
        ``confirm`` seconds apart. A rank whose stack did not move while nothing progressed is
        stuck (a rank waiting in a collective waits for it); a rank whose stack moved is slow,
        not hung, and is looked at again, up to ten times the limit."""
        limit, why = self._hang_limit(job, gen)
        silent = self.now - gen.last_progress
        probe = gen.probe
        if probe is not None and probe["since"] != gen.last_progress:
            gen.probe = probe = None  # it progressed: whatever was slow has passed
        if silent <= limit:
            return
        confirm = min(max(2.0, limit / 2), 60.0)
        if probe is None:
            gen.probe = {"since": gen.last_progress, "asked": self.now, "first": None,
                         "limit": limit, "why": why, "looks": 0}
            self._out.append(Diagnose(job.id, gen.number))
            return
        if probe["first"] is None or probe.get("second_asked"):
            if self.now - probe["asked"] > 30.0:  # no answer (a busy scheduler): ask again
                probe["asked"] = self.now
                self._out.append(Diagnose(job.id, gen.number))
            return
        if self.now - probe["first_at"] >= confirm:
            probe["second_asked"] = True
            probe["asked"] = self.now
            self._out.append(Diagnose(job.id, gen.number))

    def _on_hang_diagnosed(self, ev: HangDiagnosed) -> None:
        job = self._jobs.get(ev.job_id)
        gen = job.gen if job is not None else None
        if job is None or gen is None or gen.number != ev.generation:
            return
        if gen.hang is not None and gen.hang.get("phase") and "culprits" not in gen.hang:
            self._declare_hung(job, gen, gen.hang, ev.culprits)  # a startup bound ran out
            return
        probe = gen.probe
        if probe is None or gen.hang is not None:
            return
        stacks = dict(ev.stacks)
        if probe["first"] is None:
            probe.update(first=stacks, first_at=self.now)
            return
        silent = self.now - gen.last_progress
        # a rank waiting for its checkpoint writer counts as moving: the writer thread works
        unmoved = sorted(r for r in range(gen.size)
                         if r in stacks and stacks.get(r) == probe["first"].get(r)
                         and not waits_for_checkpoint_writer(stacks[r]))
        stuck = [r for r in ev.culprits if r in unmoved]
        waited = self.now - probe["first_at"]
        give_up = silent > 10 * probe["limit"]
        if not stacks or stuck or len(unmoved) == gen.size or give_up:
            if stuck:
                evidence = (f"rank {stuck[0]}'s call stack did not change in {waited:.1f} s, "
                            f"outside a collective, at {_top_frame(stacks[stuck[0]])}")
            elif not stacks:
                evidence = "the ranks' call stacks could not be read"
            elif give_up:
                evidence = f"still no step after 10 x the limit ({silent:.1f} s)"
            else:
                evidence = (f"no rank's call stack changed in {waited:.1f} s (every rank "
                            "waits in a collective)")
            hang = {"silent_s": silent, "limit_s": probe["limit"], "why": probe["why"],
                    "evidence": evidence, "detected_wall": self.wall,
                    "detected_mono": self.now, "median_s": gen.median_step()}
            self._declare_hung(job, gen, hang, tuple(stuck))
            return
        # The stacks moved: slow, not stuck. Say so once, and look again later.
        if not probe.get("said"):
            probe["said"] = True
            self._publish(job, {"kind": "slow", "time": self.wall, "generation": gen.number,
                                "silent_s": round(silent, 3), "limit_s": probe["limit"],
                                "note": f"no step for {silent:.1f} s (limit "
                                        f"{probe['limit']:.1f} s), but the ranks are moving: "
                                        "slow, not hung"})
        probe.update(first=stacks, first_at=self.now, second_asked=False, looks=probe["looks"] + 1)

    def _watch_startup(self, job: LiveJob, gen: Generation) -> None:
        """A generation that has not stepped yet: each rank gets ``rendezvous_timeout_s``
        (+30 s to be dispatched) to reach setup, ``setup_timeout_s`` for its setup (and the
        code before its loop), ``restore_timeout_s`` for the restore, and ``setup_timeout_s``
        again for its first step (compilation, warm-up)."""
        if gen.hang is not None:
            return
        policy = job.sub.policy
        bounds = {"rendezvous": policy.rendezvous_timeout_s + 30.0,
                  "setup": policy.setup_timeout_s, "restore": policy.restore_timeout_s,
                  "first step": policy.setup_timeout_s}
        late: list[tuple[int, str, float]] = []
        for rank in gen.unfinished():
            phase, since = gen.phases.get(rank, ("rendezvous", gen.started))
            if self.now - since > bounds[phase]:
                late.append((rank, phase, self.now - since))
        if not late:
            return
        # Ranks further on wait for the ones behind (in a collective): those are the culprits.
        order = list(bounds)
        first = min(order.index(phase) for _, phase, _ in late)
        late = [x for x in late if order.index(x[1]) == first]
        rank, phase, spent = late[0]
        setting = {"rendezvous": "rendezvous_timeout_s", "restore": "restore_timeout_s"}.get(
            phase, "setup_timeout_s")
        gen.hang = {"silent_s": spent, "limit_s": bounds[phase], "phase": phase,
                    "why": f"{setting} {bounds[phase]:g} s",
                    "evidence": f"rank {rank} spent {spent:.1f} s in {phase} (bound "
                                f"{bounds[phase]:g} s, {setting})",
                    "culprit_ranks": [r for r, _, _ in late], "median_s": 0.0,
                    "detected_wall": self.wall, "detected_mono": self.now}
        self._out.append(Diagnose(job.id, gen.number))  # for the stacks; culprits are known

    def _declare_hung(self, job: LiveJob, gen: Generation, hang: dict[str, Any],
                      culprits: tuple[int, ...]) -> None:
        """Restart the stuck ranks' workers (all of the generation's when none stands out);
        the generation then ends as failed, with ``hang`` as its cause."""
        stuck = list(hang.get("culprit_ranks") or culprits)
        hang["culprits"] = stuck
        gen.hang = hang
        gen.probe = None
        targets = [gen.addresses[r] for r in stuck] or list(gen.addresses)
        self._restart_workers(targets, f"job {job.name} hung")

    def _force_end(self, job: LiveJob, gen: Generation) -> None:
        """Ranks still running long after a peer failed are stuck: give up on them and restart
        their workers (a Python thread cannot be killed; its process can)."""
        stuck = gen.unfinished()
        self._out.append(Cancel(job.id, gen.number, stuck))
        for rank in stuck:
            self._record_failure(gen, rank, RankFailureInfo(
                error="did not exit after a peer failed; its worker was restarted",
                traceback="(no traceback)", host=self.inventory.host_of(gen.slots[rank]),
                step=job.step, when=self.wall, peer=True))
        self._restart_workers([gen.addresses[r] for r in stuck],
                              f"job {job.name}: ranks stuck after a peer failed")
        self._end_generation(job)

    def _force_release(self, job: LiveJob, gen: Generation) -> None:
        """The preemption grace ran out: stop the ranks without their checkpoint."""
        stuck = gen.unfinished()
        self._out.append(Cancel(job.id, gen.number, stuck))
        gen.forced = True
        for rank in stuck:
            gen.outcomes[rank] = {"outcome": "preempted", "step": job.step, "forced": True}
        self._restart_workers([gen.addresses[r] for r in stuck],
                              f"job {job.name} did not release its slots within the "
                              "preemption grace period")
        self._end_generation(job)

    # ================================================================== ending a generation
    def _end_generation(self, job: LiveJob) -> None:
        gen = job.gen
        assert gen is not None
        job.gen = None
        self._live.pop(job.id, None)
        self._out.append(EndGeneration(job.id, gen.number))
        try:
            self._generation_ended(job, gen)
        finally:
            if self._deferred:
                self._launch_deferred()

    def _generation_ended(self, job: LiveJob, gen: Generation) -> None:
        if gen.failing:
            self._generation_failed(job, gen)
            return
        outcomes = {str(o.get("outcome")) for o in gen.outcomes.values()}
        step = max((int(o.get("step", 0)) for o in gen.outcomes.values()), default=job.step)
        if job.stop_requested:
            job.preempt = None
            self._end_job(job, JobState.CANCELLED, f"stopped by user at step {step}",
                          Cancelled(self.now, job.id))
        elif "preempted" in outcomes and job.preempt is not None:
            self._preempted(job, gen, step)
        elif "halted" in outcomes:
            job.preempt = None
            last = (f"the newest committed checkpoint is step {job.committed_step} "
                    "(resubmit with resume='latest' to continue from it)"
                    if job.committed_step else "no checkpoint was committed before it")
            self._end_job(job, JobState.FAILED, f"halted at step {step}: {job.halt_reason}; "
                                                f"{last}", Cancelled(self.now, job.id))
        elif outcomes == {"completed"}:
            self._end_job(job, JobState.SUCCEEDED, f"completed {step} steps",
                          Finished(self.now, job.id))
        else:
            self._end_job(job, JobState.CANCELLED, f"stopped at step {step} "
                                                   f"(outcomes: {sorted(outcomes)})",
                          Finished(self.now, job.id))

    def _preempted(self, job: LiveJob, gen: Generation, step: int) -> None:
        pre = job.preempt
        assert pre is not None
        job.preempt = None
        lost = 0
        if gen.forced:
            lost = job.ledger.rollback(job.committed_step)
            step = job.committed_step
        if pre.cause != "resize":
            self._publish(job, preemption_event(
                self.wall, cause=pre.cause, reason=pre.reason, for_job=pre.for_job,
                generation=gen.number, step=step, forced=gen.forced, lost_steps=lost))
        if pre.cause == "resize" and job.resize is not None:
            pending, job.resize = job.resize, None
            job.resizing = pending
            self._start(job, pending.placement)
            return
        if pre.cause == "user":
            self._publish_cluster({"kind": "preemption", "job": job.id,
                                   "reason": f"{job.name} preempted by its owner at step "
                                             f"{step}"})
            job.ledger.enter("queued", self.now)
            self._set_state(job, JobState.PREEMPTED, f"checkpointed at step {step} and released "
                                                     "its slots; resume() to continue")
            self._sched(Suspend(self.now, job.id))
        elif pre.cause == "replace":
            job.recovering = f"replacing a straggler ({pre.reason})"
            job.queue_note = job.recovering
            job.ledger.enter("recovery", self.now)
            self._set_state(job, JobState.QUEUED, f"{job.recovering}: waiting for slots")
            avoid = {pre.slot} if pre.slot else set()
            self._sched(Released(self.now, job.id, avoid=frozenset(avoid | self._avoid(job))))
        else:
            forced = f" (forced: {lost} uncommitted steps lost)" if gen.forced else ""
            job.queue_note = f"preempted for job {self._name(pre.for_job)} at step {step}{forced}"
            job.ledger.enter("queued", self.now)
            self._set_state(job, JobState.QUEUED, f"{job.queue_note}: waiting for slots")
            self._sched(Released(self.now, job.id, avoid=frozenset(self._avoid(job))))

    def _generation_failed(self, job: LiveJob, gen: Generation) -> None:
        job.resize = job.resizing = None  # recovery restarts at the largest size that fits
        fault = self._describe_fault(job, gen)
        if fault["host"]:
            self.health.record(str(fault["host"]), self.now)
        job.fault_log.append(fault)
        if fault["rank"] is not None:
            job.consume_faults(int(fault["rank"]), int(fault["step"]))
        public = {k: v for k, v in fault.items() if not k.startswith("_")}
        self._publish(job, public)
        job.error = fault["_report"]
        spec = job.spec
        if job.stop_requested:
            job.preempt = None
            self._end_job(job, JobState.CANCELLED,
                          f"stopped by user; a rank failed meanwhile: {fault['error']}",
                          Cancelled(self.now, job.id))
            return
        window = spec.restart_window_s
        recent = [t for t in job.restarts if self.now - t < window]
        if len(recent) >= spec.max_restarts:
            job.preempt = None
            faults = "; ".join(f"{f['what']} on rank {f['rank']} ({f['host']}) at step "
                               f"{f['step']}" for f in job.fault_log)
            budget = (f"restart budget spent (max_restarts={spec.max_restarts} within "
                      f"{window:.0f} s)" if spec.max_restarts else "max_restarts=0")
            job.error = f"{budget}; faults: {faults}\n\n{fault['_report']}"
            self._end_job(job, JobState.FAILED,
                          f"{fault['what']} on rank {fault['rank']} at step {fault['step']}: "
                          f"{fault['error']} ({budget})", Cancelled(self.now, job.id))
            return
        job.restarts.append(self.now)
        resume_step = job.committed_step
        fault["lost_steps"] = job.ledger.rollback(resume_step)
        fault["resume_step"] = resume_step
        avoid = set(self._avoid(job))
        if fault["rank"] is not None:
            avoid.add(gen.slots[int(fault["rank"])])
        if job.preempt is not None and job.preempt.cause == "user":
            job.preempt = None
            job.ledger.enter("queued", self.now)
            self._set_state(job, JobState.PREEMPTED,
                            f"preempted; a rank failed while it checkpointed ({fault['what']}), "
                            f"so it resumes from step {resume_step}: resume() to continue")
            self._sched(Suspend(self.now, job.id))
            return
        job.preempt = None
        job.recovering = (f"restart {len(recent) + 1}/{spec.max_restarts} after "
                          f"{fault['what']} on rank {fault['rank']}")
        job.queue_note = job.recovering
        job.ledger.enter("recovery", self.now)
        self._set_state(job, JobState.QUEUED, f"{job.recovering}: waiting for slots")
        self._sched(Failed(self.now, job.id, requeue=True, avoid=frozenset(avoid)))

    def _end_job(self, job: LiveJob, state: JobState, reason: str, event: SchedEvent) -> None:
        self._deferred.pop(job.id, None)
        job.ledger.enter("ended", self.now)
        job.ended = self.wall
        self._set_state(job, state, reason)
        if self.sched is not None:
            self._sched(event)
        elif job.id in self._pending:
            self._pending.remove(job.id)

    def _describe_fault(self, job: LiveJob, gen: Generation) -> dict[str, Any]:
        """What ended ``gen``, with one readable cause and the detection latency."""
        rank: int | None
        injected_when = None
        if gen.injected is not None:
            injected_when = float(gen.injected.get("when", 0)) or None
        if gen.hang is not None:
            hang = gen.hang
            culprits = hang.get("culprits") or []
            rank = culprits[0] if culprits else next(
                (r for r, f in gen.failures.items() if not f.peer), None)
            what = "hang"
            if hang.get("phase"):
                error = (f"rank {rank} made no progress in {hang['phase']} for "
                         f"{hang['silent_s']:.1f} s (bound {hang['limit_s']:.1f} s)")
            else:
                error = (f"no step progress for {hang['silent_s']:.1f} s "
                         f"(limit {hang['limit_s']:.1f} s)")
            who = ("" if culprits
                   else "; no rank could be told apart: every rank's worker was restarted")
            cause = f"{error} = {hang['why']}; {hang['evidence']}{who}"
            step = job.step
            detected_wall = float(hang["detected_wall"])
            detected_mono = float(hang["detected_mono"])
            if injected_when is None:
                injected_when = detected_wall - float(hang["silent_s"])
            report = f"job {job.name} hung at step {step}: {cause}"
        else:
            rank, primary = primary_failure(gen.failures)
            what = _LOST if primary.lost_worker else "exception"
            error, step = primary.error, primary.step
            if primary.lost_worker:
                note = (f" (a {gen.injected['fault']['kind']} fault was injected)"
                        if gen.injected else "")
                cause = f"rank {rank}'s {error}{note}"
            else:
                cause = f"rank {rank} raised at step {step}: {error}"
            detected_wall = gen.failed_wall if gen.failed_wall is not None else self.wall
            detected_mono = gen.failed_at if gen.failed_at is not None else self.now
            if injected_when is None and not primary.peer:
                injected_when = primary.when  # the rank's own clock when it raised
            peer = " (a peer rank went away)" if primary.peer else ""
            report = (f"rank {rank} on {primary.host} failed at step {step}{peer}: {error}\n"
                      f"--- remote traceback (rank {rank}) ---\n{primary.traceback}")
        host = self.inventory.host_of(gen.slots[rank]) if rank is not None else None
        detect_s = detected_wall - injected_when if injected_when is not None else None
        fault: dict[str, Any] = dict(fault_event(
            detected_wall, what=what, cause=cause, rank=rank, host=host, step=step,
            error=error, generation=gen.number, detect_s=detect_s))
        fault["_detected_mono"] = detected_mono
        fault["_report"] = report
        return fault

    def _avoid(self, job: LiveJob) -> set[str]:
        """Slots a restarting job should stay off when others fit: hosts that failed
        repeatedly, and what its straggler policy excluded."""
        names = self.health.excluded(self.now) | job.stragglers.excluded(self.now)
        if not names:
            return set()
        hosts = self.inventory.hosts()
        out = {s for h in names if h in hosts for s in hosts[h]}
        out |= {n for n in names if n not in hosts}
        return out

    # ================================================================== preemption
    def _preempt_for_scheduler(self, job: LiveJob, d: PreemptJob) -> None:
        if self._deferred.pop(job.id, None) is not None:  # never launched: nothing to save
            job.ledger.enter("queued", self.now)
            job.queue_note = f"preempted before it started ({d.reason})"
            self._set_state(job, JobState.QUEUED, f"{job.queue_note}: waiting for slots")
            self._sched_later.append(Released(self.now, job.id, avoid=frozenset()))
            return
        gen = job.gen
        if gen is None or gen.failing or job.preempt is not None or job.stop_requested:
            # The generation is ending anyway (a lost worker, a failure, a stop or another
            # preemption); the scheduler hears about it when it has.
            return
        job.preempt = Preemption(cause="scheduler", reason=d.reason,
                                 deadline=self.now + d.grace_s, for_job=d.for_job)
        self._publish_cluster({"kind": "preemption", "job": job.id,
                               "reason": f"{job.name} preempted: {d.reason}"})
        self._set_control(job, preempt=1)
        self._set_state(job, JobState.STOPPING,
                        f"{d.reason}: checkpointing at the next step boundary, then releasing "
                        f"its slots (grace {d.grace_s:.0f} s)")

    # ================================================================== requests
    def _on_request(self, ev: Request) -> None:
        job = self._jobs.get(ev.job_id)
        if job is None or job.state.terminal:
            return
        what = ev.what
        gen = job.gen
        if what == "stop":
            if gen is not None:
                job.stop_requested = True
                self._set_control(job, stop=1)
                self._set_state(job, JobState.STOPPING, "stop requested: ending at the next "
                                                        "step boundary")
            elif job.state is JobState.PREEMPTED:
                self._end_job(job, JobState.CANCELLED, "stopped by user while preempted",
                              Cancelled(self.now, job.id))
            else:
                self._end_job(job, JobState.CANCELLED, "stopped by user while queued",
                              Cancelled(self.now, job.id))
        elif what == "preempt":
            if gen is not None:
                if job.stop_requested:
                    return
                if job.preempt is None:
                    self._set_control(job, preempt=1)
                job.preempt = Preemption(
                    cause="user", reason="preempted by its user",
                    deadline=self.now + self.sched_config.preempt_grace_s)
                self._set_state(job, JobState.STOPPING, "preempting: checkpoint at the next "
                                                        "step boundary, then release the slots")
            elif job.state is JobState.QUEUED and self.sched is not None:
                job.ledger.enter("queued", self.now)
                self._set_state(job, JobState.PREEMPTED, "preempted while queued; resume() "
                                                         "queues it again")
                self._sched(Suspend(self.now, job.id))
        elif what == "resume":
            if job.parked:
                job.parked = False
                job.queue_note = "resuming"
                self._set_state(job, JobState.QUEUED, "resuming: waiting for slots")
                if self.sched is None:
                    self._pending.append(job.id)
                else:
                    self._admit(job)
            elif job.state is JobState.PREEMPTED and self.sched is not None:
                job.queue_note = "resuming"
                self._set_state(job, JobState.QUEUED, "resuming: waiting for slots")
                self._sched(Resume(self.now, job.id))
        elif what == "checkpoint":
            if gen is not None:
                job.checkpoint_seq += 1
                self._set_control(job, checkpoint=job.checkpoint_seq)
        elif what == "resize":
            arg = dict(ev.arg)
            self._request_resize(job, int(arg["size"]), bool(arg.get("wait_for_workers")))
        elif what == "stragglers":
            for event in job.stragglers.update(**dict(ev.arg)):
                self._publish(job, event)
        elif what == "inject":
            fault = ev.arg
            job.planned.append(fault)
            if gen is not None and fault.rank < len(gen.addresses):
                self._out.append(Deliver(job.id, gen.addresses[fault.rank], fault))
        else:
            raise ValueError(f"unknown request {what!r}")

    def _request_resize(self, job: LiveJob, size: int, wait_for_workers: bool) -> None:
        """The user asks for ``size`` ranks. Out of the job's bounds, or above the cluster's
        slots without ``wait_for_workers``: ``Rejected`` with the numbers. Otherwise the
        scheduler decides: at once when the slots are there (a shrink always is), else the
        job keeps its size and grows when enough slots are free at once."""
        spec = job.spec
        lo, hi = spec.bounds
        reject = ""
        if not spec.resizable:
            reject = (f"job {job.name} was submitted with a fixed size of {spec.world_size} "
                      "ranks: submit it with min_size= and/or max_size= to resize it")
        elif not lo <= size <= hi:
            reject = (f"job {job.name} may run with {lo} to {hi} ranks (min_size={lo}, "
                      f"max_size={hi}), not {size}")
        kind = self._kind_of(job) or self._job_kind(job.id)
        total = self._slot_counts(kind)[0]
        if not reject and size > total and not wait_for_workers:
            reject = (f"the cluster has {total} {self._unit(kind)}, fewer than the {size} "
                      f"asked for job {job.name}: add workers, or resize(..., "
                      "wait_for_workers=True) to grow when they join")
        if reject:
            self._out.append(Rejected(job.id, reject))
            return
        job.target = size
        if self.sched is None:
            return
        self._asking = job.id
        try:
            self._sched(ResizeRequested(self.now, job.id, size))
        finally:
            self._asking = None
        note = self._growth_note(job)
        if note and job.gen is not None and not any(isinstance(c, Rejected) for c in self._out):
            self._publish(job, resize_event(self.wall, phase="waiting", old=job.gen.size,
                                            new=size, reason=note, generation=job.gen.number))

    def _growth_note(self, job: LiveJob) -> str:
        """Why the job runs below the size its user asked for ("" when it does not)."""
        planned = (job.resize.placement.world_size if job.resize is not None
                   else job.gen.size if job.gen is not None else 0)
        note = ""
        if planned and job.target > planned:
            more = job.target - planned
            unit = self._unit(self._kind_of(job))
            unit, verb = (unit[:-1], "is") if more == 1 else (unit, "are")
            note = (f"growing to {job.target} ranks ({planned} now) when {more} more {unit} "
                    f"{verb} free")
        job.resize_note = note
        return note

    def _set_control(self, job: LiveJob, **flags: int) -> None:
        gen = job.gen
        if gen is None:
            return
        gen.control.update(flags)
        self._out.append(SetControl(job.id, gen.number, dict(gen.control)))

    # ================================================================== output
    def _set_state(self, job: LiveJob, state: JobState, reason: str) -> None:
        if job.state is state and job.reason == reason:
            return
        job.state = state
        job.reason = reason
        self._publish(job, state_event(self.wall, state.value, reason))

    def _publish(self, job: LiveJob, event: Mapping[str, Any]) -> None:
        event = dict(event)
        event.setdefault("time", self.wall)
        self._out.append(Publish(job.id, event))

    def _publish_cluster(self, event: dict[str, Any]) -> None:
        event.setdefault("time", self.wall)
        self._out.append(Publish(None, event))

    def _addresses(self, job: LiveJob) -> tuple[str, ...]:
        return job.gen.addresses if job.gen is not None else ()

    def _name(self, job_id: str | None) -> str:
        job = self._jobs.get(job_id or "")
        return job.name if job is not None else str(job_id)


def _top_frame(stack: str) -> str:
    """The innermost frame of a call stack text that is not the Python standard library's
    (``threading.Event().wait()`` in faults.py, not ``waiter.acquire()`` in threading.py),
    for a one-line cause."""
    frames = [f for f in stack.split('File "') if f.strip()]
    for frame in reversed(frames):
        path = frame.split('"', 1)[0]
        if "/lib/python" in path and "-packages/" not in path:
            continue
        where, _, code = frame.partition("\n")
        short = path.rsplit("/", 2)
        place = where.replace(path, "/".join(short[-2:])).replace('"', "").strip(" ,")
        text = f"{place}: {code.strip()}" if code.strip() else place
        return text[:200]
    lines = [line.strip() for line in stack.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no frames)"
