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
  the scheduler or for a straggler's replacement: queued again), then completion. What that
  does to the job is :mod:`nbtrain.core.jobflow`'s; what its ranks report,
  :mod:`nbtrain.core.progress`'s; the machine carries out what either says comes next.
- **Failures.** A rank that raised, a worker that died, a generation with no progress (the
  hang and startup watchdog, :mod:`nbtrain.core.watchdog`). Peers of a failed rank still
  blocked in a collective are released after ``peer_release_s``: on CPU slots (gloo) by
  restarting the failed rank's worker (gloo keeps its connections open while DDP holds the
  group), on GPU slots (NCCL) by aborting the peers' communicators, which keeps their
  processes and CUDA contexts; ranks still running ``failure_grace_s`` after a failure are
  stopped by restarting their workers. Every fault is recorded with one readable cause
  (:mod:`nbtrain.core.explain`).
- **Slots whose workers restart.** A slot whose worker is asked to restart is offline for the
  scheduler until a worker backs it again; one that does not come back within
  ``worker_return_s`` is reported lost (:mod:`nbtrain.core.slotbook`).
- **Preemption grace.** A job told to release its slots gets ``preempt_grace_s`` to
  checkpoint; after that its ranks are stopped and it resumes from its last committed
  checkpoint (the steps after it are counted as lost). A stopped job's ranks get the job's
  ``stop_grace_s`` to end (its final checkpoint included); then they are stopped the same
  way and the job ends CANCELLED, the reason naming them.
- **Resizes.** A new size decided by the scheduler ends the generation through the
  preemption path and starts the next one at that size; a placement on slots a shrinking job
  still holds waits until they are handed over (:mod:`nbtrain.core.resizeplan`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import replace

from nbtrain.core import clusterevents as ce
from nbtrain.core import departing, jobflow, knobflow, progress
from nbtrain.core.explain import (
    describe_fault,
    gpu_shared_reason,
    labels_refused_reason,
    rejected_reason,
    resize_rejected,
    slot_forgotten_reason,
    slot_lost_reason,
    unit,
)
from nbtrain.core.health import HostHealth
from nbtrain.core.invariants import machine_problems
from nbtrain.core.inventory import WorkerInfo
from nbtrain.core.job import JobState
from nbtrain.core.jobevents import resize_event, slow_event, state_event
from nbtrain.core.jobrecord import Generation, GenerationControl, JobStatus, LiveJob
from nbtrain.core.lifecycle_types import (
    AbortCollectives,
    Cancel,
    CarriedHistory,
    Command,
    ControllerFailed,
    Diagnose,
    EndGeneration,
    Event,
    HangDiagnosed,
    JobSubmission,
    Launch,
    MachineConfig,
    RankExit,
    RankFailureInfo,
    Rejected,
    RestartWorkers,
    Submitted,
    Tick,
    WorkerJoined,
    WorkerLeaving,
    WorkerLeft,
)
from nbtrain.core.machine_events import KnobChangeRequested, RankEvent, SizeRequested, UserRequest
from nbtrain.core.mesh import MeshPlan, RankPlace, mesh_plan
from nbtrain.core.mitigation import SlotInfo
from nbtrain.core.outbox import Outbox
from nbtrain.core.placement import Placement
from nbtrain.core.pools import CPU, GPU, DevicePools
from nbtrain.core.queuenotes import queue_reasons, slot_counts
from nbtrain.core.sched_types import (
    Cancelled,
    Checkpointed,
    Decision,
    Finished,
    JobRequest,
    PreemptJob,
    RejectJob,
    Released,
    ResizeJob,
    ResizeRequested,
    SchedulerConfig,
    StartJob,
    Submit,
    WorkersAdded,
    WorkersRemoved,
)
from nbtrain.core.sched_types import Event as SchedEvent
from nbtrain.core.sched_types import Tick as SchedTick
from nbtrain.core.slotbook import SlotBook, SlotView
from nbtrain.core.watchdog import GenerationWatch, Hang, Slow

__all__ = ["JobMachine", "SlotView"]


class JobMachine:
    """Lifecycle of every job on one cluster. See the module docstring."""

    def __init__(self, config: MachineConfig | None = None,
                 scheduler: SchedulerConfig | None = None) -> None:
        self.config = config or MachineConfig()
        self.sched_config = replace(scheduler or SchedulerConfig(), can_grow=True)
        self.sched: DevicePools | None = None  # made when the first worker joins
        self.book = SlotBook(self.config.worker_return_s, self.config.slot_forget_s)
        self.inventory = self.book.inventory
        self.health = HostHealth(self.config.host_failure_limit,
                                 self.config.host_failure_window_s, self.config.host_exclusion_s)
        self.now = 0.0
        self.wall = 0.0
        self._jobs: dict[str, LiveJob] = {}
        self._live: dict[str, LiveJob] = {}  # jobs with a generation (ticks walk only these)
        self._pending: list[str] = []  # submitted before any worker joined
        self._last_sched_tick = -1e18
        self._out = Outbox()
        self._queue_dirty = False
        self._in_pass = False
        self._asking: str | None = None  # the job whose user request the scheduler decides
        self._deferrals = 0  # launches deferred so far (they are tried in this order)
        self._sched_later: list[SchedEvent] = []  # fed after the decisions being carried out

    # ================================================================== the API
    def handle(self, event: Event) -> list[Command]:
        """Apply one event; returns the commands to carry out, in order."""
        self.now, self.wall = event.now, event.wall
        self._out.begin(event.wall)
        self._dispatch(event)
        if self._queue_dirty:
            self._explain_queue()
        return self._out.take()

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, RankEvent):
            self._on_rank_message(event)
        elif isinstance(event, RankExit):
            self._on_rank_exit(event)
        elif isinstance(event, Tick):
            self._on_tick()
        elif isinstance(event, Submitted):
            self._on_submitted(event.job)
        elif isinstance(event, UserRequest):
            self._on_request(event)
        elif isinstance(event, WorkerJoined | WorkerLeft | WorkerLeaving):
            self._on_worker_event(event)
        elif isinstance(event, HangDiagnosed):
            self._on_hang_diagnosed(event)
        elif isinstance(event, ControllerFailed):
            self._on_controller_failed(event)
        else:
            raise TypeError(f"unknown event {event!r}; see nbtrain.core.lifecycle_types.Event")

    def status(self, job_id: str) -> JobStatus:
        """Snapshot of one job; ``KeyError`` for an unknown (or forgotten) id."""
        job = self._jobs[job_id]
        status = job.status(self.now, self._addresses(job))
        model = None if self.sched is None else self.sched.goodput_model(job_id)
        return status if model is None else replace(status, speedup=model.points_between(
            status.min_size, status.max_size, job.spec.layout.replica))

    def control(self, job_id: str) -> GenerationControl | None:
        """The job's live generation's control flags (None: no live generation, or unknown)."""
        job = self._jobs.get(job_id)
        return None if job is None else job.control()

    def job_ids(self) -> list[str]:
        """Known jobs in submit order."""
        return list(self._jobs)

    def live_jobs(self) -> list[LiveJob]:
        """Jobs with a generation (read-only: for views such as ``departing.ranks_on``)."""
        return list(self._live.values())

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
        return self.book.views(owners)

    def team_usage(self) -> dict[str, float]:
        """Slot-seconds held per team so far (the scheduler's fair-share ledger)."""
        return {} if self.sched is None else self.sched.team_usage()

    def team_window(self, now: float) -> dict[str, tuple[float, float]]:
        """Per team: slot-seconds over the scheduler's recent window, and its weight."""
        return {} if self.sched is None else self.sched.team_window(now)

    def validate(self) -> None:
        """``AssertionError`` naming every broken invariant of the machine (see
        :mod:`nbtrain.core.invariants`) and of its gang scheduler; run by the tests after
        every event."""
        owners = self.sched.owner_map() if self.sched is not None else None
        problems = machine_problems(self._jobs, self._live, self._pending, owners)
        if problems:
            raise AssertionError("; ".join(problems))
        if self.sched is not None:
            self.sched.check_invariants()

    # ================================================================== submission
    def _on_submitted(self, sub: JobSubmission) -> None:
        spec = sub.spec
        if spec.job_id in self._jobs:
            self._out.add(Rejected(spec.job_id, f"job id {spec.job_id!r} is already in use"))
            return
        job = LiveJob(sub, self.now, self.wall)
        self._jobs[job.id] = job
        if sub.carried is not None:
            jobflow.restore(job, sub.carried, now=self.now, out=self._out)
            if job.parked or job.state.terminal:
                return
        self._out.publish(job, state_event(self.wall, job.state.value, job.reason))
        if self.sched is None:
            if not spec.queue and sub.carried is None:
                self._reject(job, 0, 0)
                return
            self._pending.append(job.id)
            self._out.set_state(job, JobState.QUEUED, f"needs {spec.world_size} slots at once; the "
                                                      "cluster has 0: waiting for workers to join")
            return
        self._admit(job)

    def carry(self, job_id: str) -> CarriedHistory:
        """What a restarted controller needs to continue a job (``KeyError`` if unknown)."""
        return self._jobs[job_id].carry(self.now, self.wall)

    def _admit(self, job: LiveJob) -> None:
        spec = job.spec
        # ``target``: the size asked for, the world size unless a resize (carried over a
        # controller restart) asked for another.
        goodput = spec.sizing == "goodput"
        request = JobRequest(job_id=job.id, size=job.plan.target if spec.resizable
                             else spec.world_size, priority=spec.priority,
                             team=spec.team, layout=spec.layout,
                             min_size=spec.bounds[0] if spec.resizable else None,
                             sizing=spec.sizing, max_size=spec.bounds[1] if goodput else None)
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
        kind = self.sched.kind_of(job.id) if self.sched is not None else ""
        self._out.add(Rejected(job.id, rejected_reason(
            job.name, job.spec.world_size, self._unit(kind), free, online)))

    def _job_kind(self, job_id: str) -> str:
        """The device kind a job needs: its ``device``, or for ``auto`` GPU slots when the
        cluster has any (asked once, when the job enters the gang scheduler)."""
        device = self._jobs[job_id].spec.device
        if device != "auto":
            return device
        return GPU if self.book.has_gpu() else CPU

    def _kind_of(self, job: LiveJob) -> str:
        return self.sched.kind_of(job.id) if self.sched is not None else ""

    def _slot_counts(self, kind: str) -> tuple[int, int]:
        return slot_counts(self.sched, self.book, kind)

    def _unit(self, kind: str) -> str:
        return unit(kind, self.sched.kinds() if self.sched is not None else [])

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
                self._out.add(Rejected(job.id, d.reason))  # a request the user made now
            elif job is not None and job.gen is None and job.state is JobState.QUEUED:
                del self._jobs[job.id]
                self._out.add(Rejected(job.id, d.reason))
            elif job is not None:
                self._out.publish_cluster(ce.job_line_event("scheduler", job.id, d.reason))
        elif isinstance(d, ResizeJob) and job is not None:
            self._resize(job, d)

    def _start(self, job: LiveJob, placement: Placement) -> None:
        busy = self._busy_slots() & {str(s) for s in placement.slots}
        if busy:
            # The scheduler frees a shrinking job's slots when it decides the shrink; its
            # ranks leave them at the next step boundary. Launch when they have.
            job.plan.defer(placement, self._deferrals)
            self._deferrals += 1
            holders = sorted({j.name for j in self._live.values() if j.gen is not None
                              and busy & set(j.gen.slots)})
            self._out.set_state(job, JobState.STARTING, f"waiting for {', '.join(holders)} to "
                                                        f"hand over {len(busy)} slot(s)")
            return
        number = job.generation + 1
        slots = tuple(str(s) for s in placement.slots)
        addresses = tuple(self.inventory.address_of(s) or "" for s in slots)
        assert all(addresses), f"the scheduler placed job {job.id} on an offline slot"
        gen = Generation(number=number, slots=slots, addresses=addresses,
                         watch=GenerationWatch(job.watchdog, started=self.now))
        self._live[job.id] = job
        jobflow.launched(job, gen, placement, now=self.now, unit=self._unit(self._kind_of(job)),
                         out=self._out)
        self._out.add(Launch(job.id, number, addresses, job.unfired_faults(),
                             dict(gen.control), device=self._kind_of(job),
                             mesh=self._mesh_plan(job, slots), knobs=job.knobs.wire()))

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
        """Launch the deferred jobs whose slots have been handed over, in deferral order."""
        waiting = sorted((j for j in self._jobs.values() if j.plan.deferred is not None),
                         key=lambda j: j.plan.deferred_order)
        for job in waiting:
            placement = job.plan.deferred
            if placement is None:
                continue
            if job.state.terminal:
                job.plan.deferred = None
            elif not self._busy_slots() & {str(s) for s in placement.slots}:
                self._start(job, placement)

    def _resize(self, job: LiveJob, d: ResizeJob) -> None:
        if job.plan.deferred is not None:  # not launched yet: launch it there instead
            job.plan.deferred = d.placement
            self._launch_deferred()
            return
        jobflow.resize_decided(job, d.placement, d.reason, now=self.now,
                               grace_s=self.sched_config.preempt_grace_s,
                               unit=self._unit(self._kind_of(job)), out=self._out)

    def _explain_queue(self) -> None:
        """Say why each queued job waits (:mod:`nbtrain.core.queuenotes`)."""
        self._queue_dirty = False
        if self.sched is not None:
            for job, reason in queue_reasons(self.sched, self._jobs, self._live.values(),
                                             self.book):
                self._out.set_state(job, JobState.QUEUED, reason)

    # ================================================================== workers
    def _on_worker_event(self, event: WorkerJoined | WorkerLeft | WorkerLeaving) -> None:
        if isinstance(event, WorkerJoined):
            self._on_worker_joined(event)
        elif isinstance(event, WorkerLeft):
            self._on_worker_left(event.address, event.cause)
        else:
            self._on_worker_leaving(event)

    def _on_worker_joined(self, ev: WorkerJoined) -> None:
        sharing = self.book.sharing(ev.gpu)
        if sharing is not None and sharing.address != ev.address:
            # Two workers on one GPU: ranks on both would share it by accident.
            self._out.publish_cluster(ce.worker_refused_event(
                address=ev.address, host=ev.host,
                reason=gpu_shared_reason(ev.gpu, str(sharing.address), sharing.slot)))
            return
        rec = self.book.join(WorkerInfo(address=ev.address, host=ev.host, name=ev.name,
                                        nvlink=ev.nvlink, leaf=ev.leaf, gpu=ev.gpu,
                                        about=ev.about))
        self._out.publish_cluster(ce.worker_joined_event(slot=rec.slot, address=ev.address,
                                                      host=rec.host))
        first = self.sched is None
        if self.sched is None:
            self.sched = DevicePools(self.sched_config, slot_kind=self.book.kind_of,
                                     job_kind=self._job_kind)
        nvlink: dict[Hashable, str] = {rec.slot: rec.nvlink} if rec.nvlink else {}
        leaf = {rec.host: rec.leaf} if rec.leaf else {}
        try:
            self._sched(WorkersAdded(self.now, {rec.host: (rec.slot,)}, nvlink_of=nvlink,
                                     leaf_of=leaf))
        except ValueError as exc:
            # Labels that make no topology (a multi-host NVLink domain across leaf switches,
            # a host split between such a domain and others): the topology is unchanged,
            # so keep the worker out rather than stop the controller.
            self.book.refuse(ev.address, rec.slot)
            self._out.publish_cluster(ce.worker_refused_event(
                address=ev.address, host=ev.host,
                reason=labels_refused_reason(ev.nvlink or ev.host, ev.leaf, str(exc))))
            return
        if first:
            pending, self._pending = self._pending, []
            for job_id in pending:
                job = self._jobs.get(job_id)
                if job is not None and job.state is JobState.QUEUED:
                    self._admit(job)

    def _on_worker_left(self, address: str, cause: str = "") -> None:
        rec = self.book.leave(address)
        if rec is None:
            return
        slot = rec.slot
        self._out.publish_cluster(ce.worker_left_event(slot=slot, address=address, host=rec.host,
                                                    restarting=self.book.restarting(slot)))
        hit = departing.ranks_on(list(self._live.values()), slot)
        for job, rank in hit:
            assert job.gen is not None
            self._record_failure(job.gen, rank, RankFailureInfo(
                error=f"worker {address} left the cluster ({cause or 'its process died'})",
                traceback="(no traceback: the worker process is gone)", host=rec.host,
                step=job.step, when=self.wall, peer=False, lost_worker=True))
            self._out.add(Cancel(job.id, job.gen.number, (rank,)))
        self._take_offline([slot])
        for job, _ in hit:
            if job.gen is not None and job.gen.finished():
                self._end_generation(job)

    def _on_worker_leaving(self, ev: WorkerLeaving) -> None:
        slot = self.inventory.slot_of(ev.address)  # see nbtrain.core.departing
        if slot is not None:
            departing.leaving(self._live.values(), slot, ev.reason, now=self.now,
                              grace_s=self.sched_config.preempt_grace_s, out=self._out)
            self._take_offline([slot])

    def _take_offline(self, slots: Iterable[str]) -> None:
        if self.sched is None:
            return
        new = self.book.take_offline(slots, self.now)
        if new:
            self._sched(WorkersRemoved(self.now, new))

    def _restart_workers(self, addresses: Iterable[str], reason: str) -> None:
        """Restart workers through their nannies; their slots stay offline until a worker
        backs them again (a slot is never offered while its worker restarts)."""
        todo, slots = self.book.restart(addresses, self.now)
        if not todo:
            return
        self._take_offline(slots)
        self._out.add(RestartWorkers(tuple(todo), reason))

    # ================================================================== rank events
    def _on_rank_message(self, ev: RankEvent) -> None:
        job = self._jobs.get(ev.job_id)
        if job is None:
            return
        after = progress.message(job, ev, self.now, self._out)
        if after is progress.After.COMMITTED and self.sched is not None:
            self._sched(Checkpointed(self.now, job.id))
        elif after is progress.After.MITIGATE:
            self._mitigate(job)
            timing = progress.step_times(job, ev, self.now)
            if timing is not None:
                self._sched(timing)

    def _mitigate(self, job: LiveJob) -> None:
        """The straggler policy's turn, with the job's placement and the spare slots."""
        assert self.sched is not None and job.gen is not None
        placement = {r: SlotInfo(s, self.inventory.host_of(s))
                     for r, s in enumerate(job.gen.slots)}
        spares = [SlotInfo(str(s), self.inventory.host_of(str(s)))
                  for s in self.sched.free_slot_ids(self._kind_of(job))]
        progress.mitigate(job, self.now, placement, spares, self.sched_config.preempt_grace_s,
                          self._out)

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
                self._out.add(Cancel(job.id, gen.number, stuck))
                self._restart_workers([gen.addresses[r] for r in stuck],
                                      f"job {job.name}: nbtrain controller error")
            self._out.add(EndGeneration(job.id, gen.number))
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
            if job.gen is not None:
                self._tick_job(job, job.gen)
        for slot in self.book.lost(self.now):
            self._queue_dirty = True
            self._out.publish_cluster(ce.slot_lost_event(
                slot=slot, host=self.inventory.host_of(slot),
                reason=slot_lost_reason(self.config.worker_return_s)))
        if self.sched is not None and self.now - self._last_sched_tick >= (
                self.config.scheduler_tick_s):
            self._last_sched_tick = self.now
            held = {s for job in self._live.values() if job.gen for s in job.gen.slots}
            for rec in self.book.forget_departed(self.now, held, self._sched,
                                                 self.sched.has_slot):
                self._out.publish_cluster(ce.worker_slot_event(
                    "forgotten", slot=rec.slot, host=rec.host,
                    reason=slot_forgotten_reason(self.book.forget_s)))
            self._sched(SchedTick(self.now))

    def _tick_job(self, job: LiveJob, gen: Generation) -> None:
        """Deadlines of one generation: a failure's grace, a preemption's, a stop's, the hang
        and startup watchdog."""
        if gen.failures and not gen.finished():
            self._tick_failing(job, gen)
        elif job.preempt is not None and self.now > job.preempt.deadline and not gen.failing:
            gen.forced = True  # stopped without their checkpoint
            self._force_off(job, gen, "did not release its slots within the preemption grace "
                                      "period", "preempted")
        elif (job.stop_deadline is not None and self.now > job.stop_deadline
              and not gen.failing):
            gen.stop_forced = gen.unfinished()
            what, end = ("stop request", "stopped") if job.stop_requested else ("halt", "halted")
            self._force_off(job, gen, f"did not end within stop_grace_s "
                                      f"({job.sub.policy.stop_grace_s:g} s) of its {what}", end)
        else:
            self._watch(job, gen)

    def _watch(self, job: LiveJob, gen: Generation) -> None:
        """The hang and startup watchdog's tick: ask for the ranks' call stacks when it
        wants them (a startup bound that ran out knows its culprits: they are for the
        record)."""
        watch = gen.watch
        if gen.running and job.state is JobState.RUNNING and watch.hang is None:
            look = watch.look(self.now, job.longest_step)
        elif not gen.running and not gen.failing and job.preempt is None:
            look = watch.check_startup(self.now, self.wall, gen.unfinished())
        else:
            look = False
        if look:
            self._out.add(Diagnose(job.id, gen.number))

    def _tick_failing(self, job: LiveJob, gen: Generation) -> None:
        """A rank failed and others still run: release the peers, then give up on them."""
        assert gen.failed_at is not None
        policy = job.sub.policy
        waited = self.now - gen.failed_at
        if waited > policy.failure_grace_s:
            self._force_off(job, gen, "had ranks stuck after a peer failed")
        elif waited > policy.peer_release_s and not gen.released:
            gen.released = True
            if self._kind_of(job) == GPU:  # NCCL has an abort; gloo does not
                self._out.add(AbortCollectives(
                    job.id, gen.number, tuple(gen.addresses[r] for r in gen.unfinished()),
                    f"free the peers of job {job.name}'s failed rank"))
            else:
                self._restart_workers(
                    [gen.addresses[r] for r, f in gen.failures.items()
                     if not f.peer and not f.lost_worker],
                    f"free the peers of job {job.name}'s failed rank")

    def _on_hang_diagnosed(self, ev: HangDiagnosed) -> None:
        job = self._jobs.get(ev.job_id)
        gen = job.gen if job is not None else None
        if job is None or gen is None or gen.number != ev.generation:
            return
        verdict = gen.watch.diagnosed(self.now, self.wall, ev.culprits, ev.stacks, gen.size)
        if isinstance(verdict, Hang):
            # Restart the stuck ranks' workers (all of the generation's when none stands
            # out); the generation then ends as failed, with the hang as its cause.
            targets = [gen.addresses[r] for r in verdict.culprits] or list(gen.addresses)
            self._restart_workers(targets, f"job {job.name} hung")
        elif isinstance(verdict, Slow):
            self._out.publish(job, slow_event(self.wall, generation=gen.number,
                                              silent_s=verdict.silent_s, limit_s=verdict.limit_s))

    def _force_off(self, job: LiveJob, gen: Generation, why: str,
                   outcome: str | None = None) -> None:
        """A grace ran out with ranks still running: cancel them and restart their workers (a
        Python thread cannot be killed; its process can), then end the generation.
        ``outcome``: what they count as ("preempted", "stopped"); None: failed (stuck after
        a peer failed)."""
        stuck = gen.unfinished()
        self._out.add(Cancel(job.id, gen.number, stuck))
        for rank in stuck:
            if outcome is not None:
                gen.outcomes[rank] = {"outcome": outcome, "step": job.step, "forced": True}
                continue
            self._record_failure(gen, rank, RankFailureInfo(
                error="did not exit after a peer failed; its worker was restarted",
                traceback="(no traceback)", host=self.inventory.host_of(gen.slots[rank]),
                step=job.step, when=self.wall, peer=True))
        self._restart_workers([gen.addresses[r] for r in stuck], f"job {job.name} {why}")
        self._end_generation(job)

    # ================================================================== ending a generation
    def _end_generation(self, job: LiveJob) -> None:
        gen = job.gen
        assert gen is not None
        job.gen = None
        self._live.pop(job.id, None)
        self._out.add(EndGeneration(job.id, gen.number))
        try:
            self._generation_ended(job, gen)
        finally:
            self._launch_deferred()

    def _generation_ended(self, job: LiveJob, gen: Generation) -> None:
        if gen.failing:
            job.plan.decided = job.plan.launched = None  # recovery restarts at the largest size
            fault = describe_fault(gen, name=job.name, step=job.step, wall=self.wall,
                                   now=self.now, host_of=self.inventory.host_of)
            if fault["host"]:
                self.health.record(str(fault["host"]), self.now)
            nxt = jobflow.generation_failed(job, gen, fault, now=self.now,
                                            avoid=frozenset(self._avoid(job)), out=self._out)
        else:
            nxt = jobflow.generation_ended(job, gen, now=self.now,
                                           avoid=frozenset(self._avoid(job)),
                                           name_of=self._name, out=self._out)
        self._follow(job, nxt)

    def _follow(self, job: LiveJob, nxt: jobflow.Next) -> None:
        """Carry out what comes next for a job (see :data:`nbtrain.core.jobflow.Next`)."""
        if isinstance(nxt, jobflow.EndJob):
            event = (Finished if nxt.finished else Cancelled)(self.now, job.id)
            self._end_job(job, nxt.state, nxt.reason, event)
        elif isinstance(nxt, jobflow.Relaunch):
            self._start(job, nxt.placement)
        elif isinstance(nxt, jobflow.Admit):
            if self.sched is None:
                self._pending.append(job.id)
            else:
                self._admit(job)
        elif nxt is not None:
            self._sched(nxt)

    def _end_job(self, job: LiveJob, state: JobState, reason: str, event: SchedEvent) -> None:
        job.plan.deferred = None
        job.ledger.enter("ended", self.now)
        job.ended = self.wall
        self._out.set_state(job, state, reason)
        if self.sched is not None:
            self._sched(event)
        elif job.id in self._pending:
            self._pending.remove(job.id)

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
        if job.plan.deferred is not None:  # never launched: nothing to save
            job.plan.deferred = None
            job.ledger.enter("queued", self.now)
            job.queue_note = f"preempted before it started ({d.reason})"
            self._out.set_state(job, JobState.QUEUED, f"{job.queue_note}: waiting for slots")
            self._sched_later.append(Released(self.now, job.id, avoid=frozenset()))
            return
        jobflow.preempted_for(job, d.reason, for_job=d.for_job, grace_s=d.grace_s,
                              now=self.now, out=self._out,
                              by=None if d.for_job is None else self._jobs.get(d.for_job))

    # ================================================================== requests
    def _on_request(self, ev: UserRequest) -> None:
        job = self._jobs.get(ev.job_id)
        if job is None:
            return
        if isinstance(ev, KnobChangeRequested):  # live knobs (core/knobflow.py), ended too
            knobflow.request_set(job, ev, self._out)
            return
        if job.state.terminal:  # nothing to do, but say so for what cannot be done at all
            refused = jobflow.refused_when_ended(job, ev)
            if refused:
                self._out.add(Rejected(job.id, refused))
            return
        if isinstance(ev, SizeRequested):
            self._request_resize(job, ev)
            return
        self._follow(job, jobflow.request(
            job, ev, now=self.now, grace_s=self.sched_config.preempt_grace_s,
            scheduled=self.sched is not None, out=self._out))

    def _request_resize(self, job: LiveJob, ev: SizeRequested) -> None:
        """The user asks for ``size`` ranks. Out of the job's bounds, or above the cluster's
        slots without ``wait_for_workers``: ``Rejected`` with the numbers. Otherwise the
        scheduler decides: at once when the slots are there (a shrink always is), else the
        job keeps its size and grows when enough slots are free at once."""
        size, wait_for_workers = ev.size, ev.wait_for_workers
        spec = job.spec
        kind = self._kind_of(job) or self._job_kind(job.id)
        reject = resize_rejected(
            name=job.name, resizable=spec.resizable, world_size=spec.world_size,
            bounds=spec.bounds, size=size, total=self._slot_counts(kind)[0],
            unit=self._unit(kind), wait_for_workers=wait_for_workers)
        if reject:
            self._out.add(Rejected(job.id, reject))
            return
        job.plan.target = size
        if self.sched is None:
            return
        self._asking = job.id
        try:
            self._sched(ResizeRequested(self.now, job.id, size))
        finally:
            self._asking = None
        note = self._growth_note(job)
        rejected = any(isinstance(c, Rejected) for c in self._out.commands)
        if note and job.gen is not None and not rejected:
            self._out.publish(job, resize_event(self.wall, phase="waiting", old=job.gen.size,
                                                new=size, reason=note, generation=job.gen.number))

    def _growth_note(self, job: LiveJob) -> str:
        """Why the job runs below the size its user asked for ("" when it does not)."""
        running = job.gen.size if job.gen is not None else 0
        return job.plan.update_note(running, self._unit(self._kind_of(job)))

    # ================================================================== views
    def _addresses(self, job: LiveJob) -> tuple[str, ...]:
        return job.gen.addresses if job.gen is not None else ()

    def _name(self, job_id: str | None) -> str:
        job = self._jobs.get(job_id or "")
        return job.name if job is not None else str(job_id)
