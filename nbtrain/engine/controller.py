"""The controller: a Dask scheduler plugin, the thin shell around the pure job machine.

One per Dask cluster, registered (idempotently) by every ``nbtrain.connect()``, so all clients
share one queue and one book of slots, and jobs outlive the kernels that submitted them. It
runs on the scheduler's event loop and never blocks it: the machine's decisions are pure and
quick, and everything slow (submitting rank tasks, restarting workers, reading call stacks)
runs as tasks on the loop. It does no file I/O and never imports torch.

What flows through it:

- **Workers** join and leave through the plugin's ``add_worker``/``remove_worker`` hooks; a
  joining worker's labels (host, NVLink domain, leaf) are read from the worker first.
- **Rank events** (``Worker.log_event`` on topic ``nbtrain-ranks``) reach the ``log_event``
  hook directly: step rows are stored in the job's log and, like every rank event, fed to the
  machine. Rank tasks' ends come from the futures of an internal asynchronous client.
- **Clients** call handlers (:mod:`nbtrain.engine.handlers`): submit, requests, follow
  (long-poll for rows, events and status), listings. **Ranks** call two: the rendezvous and
  the control flags (long-polls too).
- **The journal** (:mod:`nbtrain.engine.store`): every submission, status change, result and
  the jobs' history go to SQLite in the state directory, written by a thread of its own;
  handlers wait for the write before they acknowledge. A controller that starts on a
  directory with a journal restores its jobs (:meth:`ClusterController._restore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from distributed import Client, Future, SchedulerPlugin

from nbtrain.config import Settings
from nbtrain.core.autoscale import (
    AutoscaleDecision,
    AutoscaleSettings,
    SlotUse,
    Waiting,
    decide,
)
from nbtrain.core.checkpoint_policy import parse_checkpoint_setting, preemption_commit_s
from nbtrain.core.clusterevents import (
    abort_event,
    controller_error_event,
    refused_event,
    restart_event,
    restored_event,
    shutdown_event,
    worker_refused_event,
)
from nbtrain.core.clustergoodput import ClusterGoodputSeries
from nbtrain.core.departing import ranks_on, waiting
from nbtrain.core.health import hung_ranks, rank_stacks
from nbtrain.core.job import JobState
from nbtrain.core.jobevents import generation_of, tracker_event
from nbtrain.core.lifecycle import JobMachine
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
    JobEnded,
    Launch,
    MachineConfig,
    Publish,
    RankExit,
    RankFailureInfo,
    Rejected,
    RestartWorkers,
    SetControl,
    Submitted,
    Tick,
    WorkerJoined,
    WorkerLeaving,
    WorkerLeft,
)
from nbtrain.core.machine_events import RankCheckpoint, RankSteps, UnknownKind, rank_from_wire
from nbtrain.core.rankseal import RankSeals
from nbtrain.core.sched_types import SchedulerConfig
from nbtrain.engine.assets import PLUGIN_NAME, JobAssets, token_hash
from nbtrain.engine.departures import memory_high
from nbtrain.engine.figures import decision_figures
from nbtrain.engine.inbox import Inbox
from nbtrain.engine.joblog import JobLog, Tail
from nbtrain.engine.store import TERMINAL, ControllerStore, StoredJob
from nbtrain.engine.tasks import run_rank_task
from nbtrain.runtime.events import RANK_TOPIC
from nbtrain.runtime.launch import CheckpointPlan, RankLaunch

logger = logging.getLogger(__name__)

__all__ = ["RANK_TOPIC", "ClusterController", "JobAssets", "token_hash"]

#: How long a handler or a launch waits for the journal's commit before it goes on.
JOURNAL_WAIT_S = 30.0
#: Events the controller keeps in its stimulus log.
STIMULI_KEPT = 2_000
#: The state directory's note holding the cluster's goodput series.
GOODPUT_NOTE = "cluster_goodput"


def default_state_dir(address: str) -> Path:
    """``~/.nbtrain/state/<host>-<port>``: one directory per scheduler address, so a
    scheduler restarted at the same address finds its journal."""
    where = address.split("://", 1)[-1].replace("/", "_").replace(":", "-") or "scheduler"
    return Path("~/.nbtrain/state").expanduser() / where


class ClusterController(SchedulerPlugin):
    """nbtrain's controller inside the Dask scheduler. See the module docstring."""

    name = PLUGIN_NAME
    idempotent = True  # a second connect() must not replace the running controller

    def __init__(self, settings: Settings | None = None, *, operator_hash: str | None = None
                 ) -> None:
        settings = settings or Settings.load()
        #: Only the operator token's hash comes here (the token stays in its client).
        self.operator_hash = (operator_hash if operator_hash is not None
                              else token_hash(settings.operator_token)
                              if settings.operator_token else "")
        self.settings = settings.replace(operator_token="")

    # ================================================================== lifecycle
    async def start(self, scheduler: Any) -> None:
        from nbtrain.engine import departures, handlers, pages
        from nbtrain.engine.tickets import ViewTicket

        if getattr(self, "scheduler", None) is scheduler:
            # Registered by a --preload, then started again at the end of the scheduler's
            # own startup (Dask starts every plugin it holds): keep the running controller.
            return
        s = self.settings
        self.scheduler = scheduler
        self.machine = JobMachine(
            MachineConfig(host_failure_limit=s.host_failure_limit,
                          host_failure_window_s=s.host_failure_window_s,
                          host_exclusion_s=s.host_exclusion_s,
                          worker_return_s=s.worker_return_s, slot_forget_s=s.slot_forget_s),
            SchedulerConfig(team_weights=s.team_weight_map(), preempt_grace_s=s.preempt_grace_s,
                            min_resize_interval_s=s.resize_interval_s,
                            goodput_interval_s=s.goodput_interval_s,
                            # no use looking at goodput-sized jobs more often than they move
                            goodput_check_s=min(SchedulerConfig.goodput_check_s,
                                                s.goodput_interval_s),
                            share_window_s=s.share_window_s),
        )
        self.assets: dict[str, JobAssets] = {}
        self.seals = RankSeals()
        #: Rank events refused (a wrong seal: not from the generation's ranks), per job.
        self.refused_events: dict[str, int] = {}
        self._refusal_logged: dict[str, float] = {}
        self._ignored_kinds: dict[str, set[str]] = {}  # job -> rank message kinds it sent
        self.cluster_log = Tail(2_000)
        self.ended: deque[str] = deque()
        self._news = asyncio.Event()  # set (and replaced) whenever a follower has news
        self._control_news = asyncio.Event()
        self._rdzv_news = asyncio.Event()
        self._pending_workers: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self.decision_s: deque[float] = deque(maxlen=10_000)
        #: The same decisions' CPU time on the loop's thread, and what each event was: wall
        #: time minus CPU time is time the thread waited (the GIL, the OS scheduler).
        self.decision_cpu_s: deque[tuple[float, str]] = deque(maxlen=10_000)
        #: The newest events fed to the machine, in order (its stimulus log, for debugging a
        #: decision: replay them into a fresh machine; the journal keeps what must survive).
        self.stimuli: deque[Event] = deque(maxlen=STIMULI_KEPT)
        self.inbox = Inbox(self._feed, self.wake)
        #: Each event's whole handling on the loop (the decision, its commands, journaling):
        #: (wall, CPU, what it was).
        self.feed_s: deque[tuple[float, float, str]] = deque(maxlen=10_000)
        self._client: Client | None = None
        self._client_ready = asyncio.Event()
        self.view_tickets: dict[str, ViewTicket] = {}
        self.pages = "none"  # until they are served (below)
        self.store = ControllerStore(s.state_dir or default_state_dir(scheduler.address))
        self.epoch = self.store.epoch
        self._last_journal = -1e18
        self._restore()
        #: The cluster's goodput over time (``core.clustergoodput``; the class view draws
        #: it): sampled by the tick, journaled at every sample, continued after a restart.
        self.goodput_series = ClusterGoodputSeries(points=self._goodput_points())
        handlers.install(self, scheduler)
        departures.install(self, scheduler, wait_s=s.retire_wait_s)
        #: Workers Dask's nanny killed for memory: address -> the fault's cause.
        self._memory_killed: dict[str, str] = {}
        #: Workers whose last heartbeat reported at least half their memory limit.
        self._memory_high: set[str] = set()
        #: When each free slot was first seen free by the autoscaling policy (monotonic).
        self._idle_since: dict[str, float] = {}
        #: Names of workers that announced they leave (by address), and of those gone since
        #: (the adaptive policy drops them from the cluster manager's plan).
        self._leaving_names: dict[str, Any] = {}
        self.departed: set[Any] = set()
        try:
            self.pages = pages.attach(scheduler)
        except Exception:  # the pages are a view: never keep the controller from starting
            logger.exception("nbtrain controller: serving its pages failed")
            self.pages = "none"
        # The internal client connects in the background: while a ``--preload`` runs, the
        # scheduler does not accept connections yet.
        self._spawn(self._connect_client())
        for address in list(scheduler.workers):
            self.add_worker(scheduler, address)
        self._spawn(self._tick_loop())

    async def _connect_client(self) -> None:
        while not self._closed:
            try:
                self._client = await Client(
                    self.scheduler.address, asynchronous=True, set_as_default=False,
                    security=getattr(self.scheduler, "security", None),
                    name="nbtrain-controller", timeout=10)
            except OSError:
                logger.warning("nbtrain controller: connecting its client failed; retrying",
                               exc_info=True)
                await asyncio.sleep(1.0)
                continue
            self._client_ready.set()
            return

    async def client(self) -> Client:
        """The controller's own Dask client (it submits rank tasks and runs functions on
        workers), once connected."""
        await self._client_ready.wait()
        assert self._client is not None
        return self._client

    async def close(self) -> None:
        self._closed = True
        inbox = getattr(self, "inbox", None)
        if inbox is not None:
            inbox.drain()  # what arrived is decided and journaled before the journal closes
        for job_id in list(self.assets):
            status = self.job_status(job_id)
            if status is not None and status["state"] not in ("SUCCEEDED", "FAILED",
                                                              "CANCELLED"):
                self.cluster_log.extend([shutdown_event(job_id)])
        for task in list(self._tasks):
            task.cancel()
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
        store = getattr(self, "store", None)
        if store is not None:
            await asyncio.to_thread(store.close)

    # ================================================================== the journal
    def _restore(self) -> None:
        """Take back what the journal holds: ended jobs are listed with their history; every
        other job is submitted to the fresh machine with what the last controller knew of it
        (``CarriedHistory``): queued ones queue again in their order, running ones resume
        from their newest committed checkpoint when slots return, held ones stay held."""
        t0 = time.perf_counter()
        stored = self.store.jobs(newest_ended=self.settings.jobs_kept)
        live = 0
        for sj in stored:
            try:
                if self._restore_one(sj):
                    live += 1
            except Exception:  # one unreadable record must not keep the others out
                logger.exception("nbtrain controller: restoring job %s failed", sj.job_id)
        if stored:
            self.cluster_log.extend([restored_event(
                jobs=len(stored), live=live, epoch=self.epoch, state_dir=str(self.store.dir),
                seconds=time.perf_counter() - t0)])
            logger.info("nbtrain controller: restored %d jobs (%d live) from %s in %.2f s",
                        len(stored), live, self.store.dir, time.perf_counter() - t0)

    def _restore_one(self, sj: StoredJob) -> bool:
        from nbtrain.engine.wire import submission_from_wire

        sub = submission_from_wire(sj.submission)
        assets = JobAssets(
            spec=sub.spec, recipe=sj.recipe,
            settings=Settings.from_dict(sj.settings, lenient=True),  # journaled under old rules
            checkpoint_url=sj.checkpoint_url,
            restore=(str(sj.restore[0]), None if sj.restore[1] is None else int(sj.restore[1]))
            if sj.restore else None,
            token_hash=sj.token_hash, log=self.job_log(sj.job_id, sj.ends))
        self.assets[sj.job_id] = assets
        if sj.state in TERMINAL:
            assets.final = sj.status
            assets.recipe = b""
            self.ended.append(sj.job_id)
            return False
        if sj.trackers:
            self.attach_trackers(assets, sj.trackers)
        carried = _carried_from(sj.carried)
        now, wall = self.now()
        self.feed(Submitted(now, wall, dataclasses.replace(sub, carried=carried)))
        return True

    def archive(self, sj: StoredJob) -> JobAssets:
        """An ended job read back from the journal on demand (an old one asked for by name)."""
        if sj.job_id not in self.assets:
            self._restore_one(sj)
            self._trim_ended()
        return self.assets[sj.job_id]

    def job_log(self, job_id: str, ends: Mapping[str, int] | None = None) -> JobLog:
        """A job's log, journaled at its positions (continuing at ``ends``)."""
        store = self.store
        return JobLog(rows_kept=self.settings.rows_kept, ends=ends,
                      sink=lambda table, start, items: store.add_history(table, job_id, start,
                                                                         items))

    def attach_trackers(self, assets: JobAssets,
                         trackers: Sequence[Mapping[str, Any]]) -> None:
        from nbtrain.engine.trackers import TrackerSink, TrackerSpec

        jid = assets.spec.job_id
        specs = [TrackerSpec(**dict(t)) for t in trackers]
        for spec in specs:
            if spec.where != "controller":
                raise ValueError(f"the {spec.kind} tracker at {spec.target} runs in the "
                                 "client (where='client'); the controller runs only "
                                 "TrackerSpec(..., where='controller')")
        assets.trackers = TrackerSink(
            specs, run=f"{assets.spec.name}-{jid}",
            params=assets.spec.describe(),
            on_error=lambda message: self.publish_from_thread(
                jid, dict(tracker_event(message))))

    def journal_status(self, job_id: str, *, live_only: bool = False) -> None:
        """Journal a job's status and what a restarted controller needs to continue it
        (``live_only``: nothing for an ended job)."""
        status = self.job_status(job_id)
        if status is None or job_id not in self.assets or self.assets[job_id].final:
            return
        if live_only and status["state"] in TERMINAL:
            return
        carried = self.machine.carry(job_id) if status["state"] not in TERMINAL else None
        self.store.put_status(job_id, status, carried)  # serialised on the writer thread

    async def journaled(self) -> bool:
        """Until everything journaled so far is on disk (without blocking the loop); False
        when the disk has not answered within ``JOURNAL_WAIT_S`` (logged: the controller
        goes on, a job never stalls behind its journal)."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.store.barrier()), JOURNAL_WAIT_S)
        except TimeoutError:
            logger.warning("nbtrain controller: the journal in %s did not commit within %.0f s "
                           "(%d write errors, last: %s); going on without waiting",
                           self.store.dir, JOURNAL_WAIT_S, self.store.write_errors,
                           self.store.last_error or "none")
            return False
        return True

    # ================================================================== feeding the machine
    def feed(self, event: Event) -> list[Command]:
        """Apply one event now, after everything waiting in the inbox, and carry out the
        machine's commands: for a caller that needs the answer (a submission, a request)."""
        self.inbox.drain()
        return self._feed(event)

    def put(self, event: Event, then: Callable[[], None] | None = None) -> None:
        """Queue one event for the machine (fed in order, in short slices; ``then`` runs
        right after it): for everything that needs no answer."""
        self.inbox.put(event, then)

    def _feed(self, event: Event) -> list[Command]:
        """Apply one event and carry out the machine's commands (on the event loop).

        Never raises: an exception inside the machine fails the one job the event concerns
        (its traceback as the cause) and the controller goes on; jobs whose state changed
        are journaled."""
        self.stimuli.append(event)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            commands = self.machine.handle(event)
        except Exception:
            commands = self._machine_failed(event, traceback.format_exc())
        self.decision_s.append(time.perf_counter() - t0)
        label = _label(event)
        self.decision_cpu_s.append((time.thread_time() - c0, label))
        touched: set[str] = set()
        for command in commands:
            try:
                self._do(command)
            except Exception:  # one command failing must not stop the others
                logger.exception("nbtrain controller: carrying out %r failed", command)
            job_id = getattr(command, "job_id", None)
            if job_id is not None and isinstance(command, Publish | Launch):
                touched.add(job_id)
        for job_id in touched:
            self.journal_status(job_id)
        self.feed_s.append((time.perf_counter() - t0, time.thread_time() - c0, label))
        return commands

    def _machine_failed(self, event: Event, tb: str) -> list[Command]:
        job_id = _job_of(event)
        logger.error("nbtrain controller: handling %s failed (job %s):\n%s",
                     type(event).__name__, job_id, tb)
        self.cluster_log.extend([controller_error_event(
            job=job_id, event=type(event).__name__, error=tb.strip().splitlines()[-1])])
        if job_id is None:
            return []
        now, wall = self.now()
        try:
            return self.machine.handle(ControllerFailed(now, wall, job_id, tb))
        except Exception:
            logger.exception("nbtrain controller: failing job %s after an error failed", job_id)
            return []

    def now(self) -> tuple[float, float]:
        return time.monotonic(), time.time()

    def _do(self, c: Command) -> None:
        if isinstance(c, Publish):
            if c.job_id is None:
                self.cluster_log.extend([dict(c.event)])
            elif c.job_id in self.assets:
                self.assets[c.job_id].log.add_event(c.event)
                sink = self.assets[c.job_id].trackers
                if sink is not None:
                    sink.event(c.event)
            self.wake()
        elif isinstance(c, JobEnded):
            if c.job_id in self.assets:
                self._job_ended(c.job_id)
        elif isinstance(c, Launch):
            self.seals.open(c.job_id, c.generation, secrets.token_hex(16))
            self._spawn(self._launch(c))
        elif isinstance(c, SetControl):
            self._wake_control()  # the machine holds the flags: control_state reads them
        elif isinstance(c, EndGeneration):
            self._end_generation(c.job_id, c.generation)
        elif isinstance(c, Cancel):
            self._spawn(self._cancel(c))
        elif isinstance(c, RestartWorkers):
            self._spawn(self._restart(c.addresses, c.reason))
        elif isinstance(c, AbortCollectives):
            self._spawn(self._abort_collectives(c))
        elif isinstance(c, Diagnose):
            self._spawn(self._diagnose(c.job_id, c.generation))
        elif isinstance(c, Deliver):
            self._spawn(self._deliver(c))
        elif isinstance(c, Rejected):
            pass  # the submit handler reads it from the commands it got
        else:  # pragma: no cover - a new command type without a branch here
            raise TypeError(f"unknown command {c!r}")

    # The events long-polls wait on: each is set, and replaced, when there is news.
    @property
    def news(self) -> asyncio.Event:
        """Set when a job's rows, events or state change (followers wait on it)."""
        return self._news

    @property
    def control_news(self) -> asyncio.Event:
        """Set when a generation's control flags change (rank 0's long-poll)."""
        return self._control_news

    @property
    def rendezvous_news(self) -> asyncio.Event:
        """Set when a rank 0 publishes its rendezvous or a generation ends."""
        return self._rdzv_news

    @property
    def pending_workers(self) -> int:
        """Workers that joined Dask and whose labels are still being read."""
        return len(self._pending_workers)

    def wake(self) -> None:
        """Tell long-polling followers that something changed."""
        news, self._news = self._news, asyncio.Event()
        news.set()

    def _wake_control(self) -> None:
        news, self._control_news = self._control_news, asyncio.Event()
        news.set()

    def publish_from_thread(self, job_id: str, event: dict[str, Any]) -> None:
        """Add an event to a job's log from another thread (a tracker reporting trouble)."""
        self._loop.call_soon_threadsafe(self._do, Publish(job_id, event))

    def wake_rendezvous(self) -> None:
        news, self._rdzv_news = self._rdzv_news, asyncio.Event()
        news.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("nbtrain controller task failed", exc_info=task.exception())

    async def _tick_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.settings.controller_tick_s)
            try:
                now, wall = self.now()
                self.put(Tick(now, wall))
                self._memory_high = memory_high(self.scheduler.workers)
                if now - self._last_journal >= self.settings.journal_interval_s:
                    self._last_journal = now
                    for job_id in self.machine.job_ids():
                        self.journal_status(job_id, live_only=True)  # their step progress
                if self.goodput_series.due(now):
                    self._sample_goodput(now, wall)
            except Exception:  # the clock must keep going for every other job
                logger.exception("nbtrain controller: a tick failed")

    def _sample_goodput(self, now: float, wall: float) -> None:
        jobs = [s for s in map(self.job_status, self.job_ids()) if s is not None]
        if self.goodput_series.sample(now, wall, self.slots(), jobs) is not None:
            self.store.put_note(GOODPUT_NOTE, self.goodput_series.points())

    def _goodput_points(self) -> list[Mapping[str, Any]]:
        """The goodput series an earlier controller on this state directory journaled."""
        points = self.store.note(GOODPUT_NOTE)
        return [p for p in points if isinstance(p, Mapping)] if isinstance(points, list) else []

    # ================================================================== workers
    def add_worker(self, scheduler: Any, worker: str) -> None:
        self._pending_workers.add(worker)
        self._spawn(self._admit_worker(worker))

    def remove_worker(self, scheduler: Any, worker: str, *, stimulus_id: str = "",
                      **kwargs: Any) -> None:
        # feed() never raises; nothing else here can.
        if worker in self._pending_workers:
            self._pending_workers.discard(worker)
            return
        now, wall = self.now()
        self._idle_since.pop(worker, None)
        if worker in self._leaving_names:
            self.departed.add(self._leaving_names.pop(worker))
        if worker in self._memory_high and worker not in self._memory_killed:
            # Near its memory limit: the nanny's event saying it killed the worker for
            # memory may still be on its way (it races the worker's own connection).
            self._spawn(self._worker_left_later(worker))
            return
        self.put(WorkerLeft(now, wall, worker, cause=self._memory_killed.pop(worker, "")))

    async def _worker_left_later(self, worker: str) -> None:
        deadline = time.monotonic() + self.settings.exit_cause_wait_s
        while worker not in self._memory_killed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        now, wall = self.now()
        self.put(WorkerLeft(now, wall, worker, cause=self._memory_killed.pop(worker, "")))

    async def _admit_worker(self, address: str) -> None:
        """Read the worker's labels, then offer it as a slot."""
        from nbtrain.engine.workers import SLOT_ABOUT, worker_labels

        client = await self.client()
        try:
            labels = (await client.run(worker_labels, workers=[address],
                                       on_error="return")).get(address)
        except Exception as exc:  # the worker went away, or cannot import nbtrain
            labels = exc
        if address not in self._pending_workers:
            return  # it left meanwhile
        self._pending_workers.discard(address)
        ws = self.scheduler.workers.get(address)
        if ws is None:
            return
        if not isinstance(labels, Mapping):
            self.cluster_log.extend([worker_refused_event(
                address=address, time=time.time(),
                reason=f"cannot run nbtrain ranks: {type(labels).__name__}: {labels}; "
                       "install nbtrain (and torch) in the workers' environment")])
            self.wake()
            return
        now, wall = self.now()
        about = tuple((k, str(labels[k])) for k in SLOT_ABOUT if k in labels)
        self.put(WorkerJoined(now, wall, address, str(labels.get("host") or ws.host),
                               str(ws.name), str(labels.get("nvlink", "")),
                               str(labels.get("leaf", "")), str(labels.get("gpu", "")),
                               about=about))

    async def _restart(self, addresses: tuple[str, ...], reason: str) -> None:
        results: Any
        try:
            results = await self.scheduler.restart_workers(
                workers=list(addresses), timeout=self.settings.worker_restart_timeout_s,
                wait_for_workers=False, on_error="return",
                stimulus_id=f"nbtrain-restart-{time.time()}")
        except Exception as exc:
            results = {a: f"{type(exc).__name__}: {exc}" for a in addresses}
        self.cluster_log.extend([restart_event(addresses=addresses, reason=reason,
                                               results=results)])
        self.wake()

    async def _abort_collectives(self, c: AbortCollectives) -> None:
        from nbtrain.runtime.nccl import abort_generation

        client = await self.client()
        try:
            results: Any = await client.run(abort_generation, c.job_id, c.generation,
                                            workers=list(c.addresses), on_error="return")
        except Exception as exc:
            results = {a: f"{type(exc).__name__}: {exc}" for a in c.addresses}
        self.cluster_log.extend([abort_event(job=c.job_id, generation=c.generation,
                                             addresses=c.addresses, reason=c.reason,
                                             results=results)])
        self.wake()

    # ================================================================== rank tasks
    async def _launch(self, c: Launch) -> None:
        client = await self.client()
        # The generation's number is on disk before any of its ranks runs: a restarted
        # controller numbers its generations above it (the fence against stale ranks).
        await self.journaled()
        assets = self.assets.get(c.job_id)
        live = self.machine.control(c.job_id)
        if assets is None or live is None or live.generation != c.generation:
            return  # the generation ended (a stop, a lost worker) before it was launched
        spec = assets.spec
        hosts = [self.scheduler.workers[a].host if a in self.scheduler.workers else a
                 for a in c.addresses]
        per_host: dict[str, int] = {}
        for ws in self.scheduler.workers.values():
            per_host[ws.host] = per_host.get(ws.host, 0) + 1
        plan = self._checkpoint_plan(assets)
        futures: dict[int, Future] = {}
        for rank, address in enumerate(c.addresses):
            launch = RankLaunch(
                job_id=c.job_id, rank=rank, world_size=len(c.addresses),
                generation=c.generation, recipe=assets.recipe, steps=spec.steps,
                seed=spec.seed, host_slots=per_host.get(hosts[rank], 1),
                settings=assets.settings, checkpoint=plan,
                faults=tuple(f for f in c.faults if f.rank == rank), job_info=spec.describe(),
                control=dict(c.control), halt_on_nonfinite=spec.on_nonfinite == "halt",
                device=c.device, mesh=c.mesh, secret=self.seals.secret(c.job_id, c.generation),
                knobs=dict(c.knobs))
            fut = client.submit(
                run_rank_task, launch, key=f"nbtrain-{c.job_id}-g{c.generation}-r{rank}",
                workers=[address], allow_other_workers=False, pure=False, retries=0)
            futures[rank] = fut
            self._spawn(self._await_rank(c.job_id, c.generation, rank, hosts[rank], fut))
        assets.futures[c.generation] = futures

    def _checkpoint_plan(self, assets: JobAssets) -> CheckpointPlan:
        s = assets.settings
        restore: list[tuple[str, int | None]] = [(assets.checkpoint_url, None)]
        if assets.restore is not None:
            restore.append(assets.restore)
        return CheckpointPlan(
            url=assets.checkpoint_url,
            policy=parse_checkpoint_setting(assets.spec.checkpoint, mtbf_s=s.mtbf_s),
            keep=s.checkpoint_keep, restore_from=tuple(restore),
            commit_timeout_s=s.checkpoint_commit_timeout_s,
            preempt_commit_s=preemption_commit_s(s.checkpoint_commit_timeout_s,
                                                 s.preempt_grace_s))

    async def _await_rank(self, job_id: str, generation: int, rank: int, host: str,
                          fut: Future) -> None:
        outcome: dict[str, Any] | None = None
        failure: RankFailureInfo | None = None
        try:
            outcome = dict(await fut)
            assets = self.assets.get(job_id)
            if assets is not None and ("result" in outcome or "result_error" in outcome):
                # Kept as bytes: the scheduler never unpickles user objects.
                assets.result = outcome.pop("result", None)
                assets.result_error = outcome.pop("result_error", None)
                self.store.put_result(job_id, assets.result, assets.result_error)
        except asyncio.CancelledError:
            if self._closed:
                raise
            failure = RankFailureInfo(error="rank task cancelled", traceback="(no traceback)",
                                      host=host, step=0, when=time.time(), peer=True)
        except Exception as exc:
            failure = _failure_info(exc, host)
        now, wall = self.now()
        self.put(RankExit(now, wall, job_id, generation, rank, outcome, failure))

    async def _cancel(self, c: Cancel) -> None:
        client = await self.client()
        assets = self.assets.get(c.job_id)
        futures = assets.futures.get(c.generation, {}) if assets else {}
        chosen = [futures[r] for r in c.ranks if r in futures]
        if chosen:
            await client.cancel(chosen)

    def _end_generation(self, job_id: str, generation: int) -> None:
        assets = self.assets.get(job_id)
        if assets is None:
            return
        self.seals.close(job_id, generation - 1)  # its own stays open for late messages
        for fut in assets.futures.pop(generation, {}).values():
            with contextlib.suppress(Exception):
                fut.release()
        assets.rendezvous.pop(generation, None)
        self._wake_control()  # its rank 0's long poll: the machine has no such generation now
        self.wake_rendezvous()

    async def _diagnose(self, job_id: str, generation: int) -> None:
        assets = self.assets.get(job_id)
        futures = assets.futures.get(generation, {}) if assets else {}
        keys = {rank: fut.key for rank, fut in futures.items()}
        try:
            stacks = await self.scheduler.get_call_stack(keys=list(keys.values()))
        except Exception:
            stacks = {}
        now, wall = self.now()
        self.put(HangDiagnosed(now, wall, job_id, generation,
                                tuple(hung_ranks(keys, stacks)), rank_stacks(keys, stacks)))

    async def _deliver(self, c: Deliver) -> None:
        from nbtrain.runtime.faults import deliver

        client = await self.client()
        with contextlib.suppress(Exception):
            await client.run(deliver, c.job_id, c.fault.to_dict(), workers=[c.address])

    # ================================================================== rank events
    def log_event(self, topic: str, msg: Any) -> None:
        if topic == "worker-restart-memory" and isinstance(msg, Mapping):
            self._note_memory_kill(msg)
            return
        if topic != RANK_TOPIC or not isinstance(msg, Mapping) or not self._sealed(msg):
            return
        try:
            self._rank_event(msg)
        except Exception:  # a malformed message: fail its job, never Dask's event handling
            job_id = str(msg.get("job"))
            tb = traceback.format_exc()
            if job_id in self.assets:
                now, wall = self.now()
                self.put(ControllerFailed(now, wall, job_id, tb))
            logger.error("nbtrain controller: a rank event of job %s failed:\n%s", job_id, tb)

    def _note_memory_kill(self, msg: Mapping[str, Any]) -> None:
        """Dask's nanny is killing a worker for its memory (its ``worker-restart-memory``
        event comes before the worker leaves): the fault of a rank there says so."""
        import dask.config

        from nbtrain.engine.departures import memory_cause

        address = str(msg.get("worker"))
        ws = self.scheduler.workers.get(address)
        limit = getattr(ws, "memory_limit", None)
        fraction = dask.config.get("distributed.worker.memory.terminate", 0.95)
        self._memory_killed[address] = memory_cause(address, msg.get("rss"), limit, fraction)

    # ================================================================== leaving workers
    def worker_leaving(self, address: str, reason: str) -> None:
        """A worker is about to be retired (``nbtrain.engine.departures``): the machine
        preempts a job with a rank there and takes its slot out of the schedule."""
        ws = self.scheduler.workers.get(address)
        if ws is not None:
            self._leaving_names[address] = ws.name
            now, wall = self.now()
            self.put(WorkerLeaving(now, wall, address, reason))

    def slot_busy(self, address: str) -> bool:
        """Whether a rank still runs on the worker at ``address``."""
        self.inbox.drain()
        slot = self.machine.inventory.slot_of(address)
        return slot is not None and bool(ranks_on(self.machine.live_jobs(), slot))

    def take_departed(self) -> list[Any]:
        """Names of workers that announced they leave and have gone (once each)."""
        out, self.departed = list(self.departed), set()
        return out

    def autoscale(self, settings: AutoscaleSettings) -> AutoscaleDecision:
        """What nbtrain's adaptive policy says for this cluster now
        (:mod:`nbtrain.core.autoscale`): the workers to run and the names that may retire."""
        self.inbox.drain()
        now = time.monotonic()
        owners = {v["slot"]: v for v in self.machine.slots()}
        uses: list[SlotUse] = []
        for address, ws in list(self.scheduler.workers.items()):
            slot = self.machine.inventory.slot_of(address)
            view = owners.get(slot) if slot is not None else None
            if view is None:  # joining (its labels being read): free, and idle from now
                uses.append(SlotUse(str(ws.name), busy=False, idle_since=now))
                continue
            if view["device"] != settings.kind:
                continue
            if view["state"] == "offline":  # announced it is leaving (still connected)
                uses.append(SlotUse(str(ws.name), busy=False, leaving=True))
                continue
            busy = view["job"] is not None or self.slot_busy(address)
            if busy:
                self._idle_since.pop(address, None)
            since = self._idle_since.setdefault(address, now) if not busy else now
            uses.append(SlotUse(str(ws.name), busy=busy, idle_since=since))
        return decide(uses, [Waiting(j, need) for j, need in waiting(self._queued(),
                                                                     settings.kind)],
                      settings, now)

    def _queued(self) -> list[tuple[str, JobState, str, int]]:
        """Queued jobs in the order served, then those submitted before any slot existed:
        ``(id, state, device kind or "auto", smallest gang)``."""
        served = self.queue()
        order = served + [j for j in self.machine.job_ids() if j not in set(served)]
        out: list[tuple[str, JobState, str, int]] = []
        for job_id in order:
            if self.machine.status(job_id).state != JobState.QUEUED.value:
                continue
            spec = self.assets[job_id].spec if job_id in self.assets else None
            kind = (self.machine.sched.kind_of(job_id) if self.machine.sched is not None
                    else "") or (spec.device if spec is not None else "auto")
            out.append((job_id, JobState.QUEUED, kind, spec.bounds[0] if spec else 1))
        return out

    def _sealed(self, msg: Mapping[str, Any]) -> bool:
        """Whether a rank event comes from its generation's ranks (``nbtrain.core.rankseal``);
        others are counted per job and noted in the cluster's log at most every 10 s."""
        job_id, gen, rank = msg.get("job"), generation_of(msg), msg.get("rank")
        if (isinstance(job_id, str) and isinstance(gen, int) and isinstance(rank, int)
                and self.seals.admits(job_id, gen, rank, msg.get("seq"), str(msg.get("kind")),
                                      msg.get("seal"))):
            return True
        if isinstance(job_id, str) and job_id in self.assets:
            self.refused_events[job_id] = self.refused_events.get(job_id, 0) + 1
            now = time.monotonic()
            if now - self._refusal_logged.get(job_id, -1e18) >= 10.0:
                self._refusal_logged[job_id] = now
                self.cluster_log.extend([refused_event(
                    job=job_id, count=self.refused_events[job_id],
                    reason="rank events not sealed by that job's running generation "
                           "(sent by another client, or by a rank of an older generation)")])
        return False

    def _rank_event(self, msg: Mapping[str, Any]) -> None:
        """A sealed rank message: the rank's output to its log, anything else turned into the
        machine's typed event once, here. A kind no event stands for (a rank runtime of
        another version) is ignored, and said once per job and kind; fields the event cannot
        read raise (the caller fails the job: its own rank sent them)."""
        job_id = str(msg.get("job"))
        assets = self.assets.get(job_id)
        if assets is None:
            return
        if msg.get("kind") == "log":  # the rank's output: for the views, nothing to decide
            assets.log.add_output(msg)
            self.wake()
            return
        now, wall = self.now()
        try:
            event = rank_from_wire(now, wall, job_id, msg)
        except UnknownKind as exc:
            self._ignored_kind(job_id, str(msg.get("kind")), str(exc))
            return
        if isinstance(event, RankSteps):
            assets.log.add_rows(event.generation, event.rank, event.rows)
            if assets.trackers is not None:
                assets.trackers.rows([(event.generation, event.rank, *row)
                                      for row in event.rows])
        committed = isinstance(event, RankCheckpoint) and event.phase == "committed"
        # a restart resumes from a committed checkpoint: journal it as soon as it is fed
        self.put(event, (lambda: self.journal_status(job_id)) if committed else None)
        self.wake()

    def _ignored_kind(self, job_id: str, kind: str, reason: str) -> None:
        """A rank message of an unknown kind: dropped, noted once per job and kind."""
        noted = self._ignored_kinds.setdefault(job_id, set())
        if kind in noted or len(noted) >= 16:
            return
        noted.add(kind)
        logger.warning("nbtrain controller: job %s: %s (ignored)", job_id, reason)
        self.cluster_log.extend([{"kind": "refused", "job": job_id, "time": time.time(),
                                  "count": 1, "reason": f"{reason}: ignored"}])

    # ================================================================== bookkeeping
    def _job_ended(self, job_id: str) -> None:
        self.ended.append(job_id)
        self.assets[job_id].recipe = b""  # journaled; nothing will launch it again
        self._trim_ended()

    def _trim_ended(self) -> None:
        """Keep ``jobs_kept`` ended jobs in memory; older ones live in the journal only."""
        while len(self.ended) > self.settings.jobs_kept:
            old = self.ended.popleft()
            self.machine.forget(old)
            self.assets.pop(old, None)
            self.seals.forget(old)
            self.refused_events.pop(old, None)
            self._ignored_kinds.pop(old, None)
            self._refusal_logged.pop(old, None)

    def job_ids(self) -> list[str]:
        """Jobs in memory (live, and the newest ended), in submit order."""
        return list(self.assets)

    def job_status(self, job_id: str) -> dict[str, Any] | None:
        """A job's status as clients see it (None: not in memory)."""
        try:
            return self.machine.status(job_id).to_dict()
        except KeyError:
            assets = self.assets.get(job_id)
            return dict(assets.final) if assets is not None and assets.final else None


    # ================================================================== for handlers, pages
    # (what ``nbtrain.engine.port.ControllerPort`` promises besides the attributes above)
    def generation_of(self, job_id: str) -> int | None:
        """The job's current (or last) generation number; None when the machine does not
        hold the job (unknown, or an ended job it forgot)."""
        try:
            return self.machine.status(job_id).generation
        except KeyError:
            return None

    def live_jobs(self) -> int:
        """Jobs queued, held or running (in memory and not ended)."""
        return len(self.assets) - len(self.ended)

    def queue(self) -> list[str]:
        """Queued job ids in the order the scheduler serves them."""
        return [] if self.machine.sched is None else self.machine.sched.queued()

    def slots(self) -> list[dict[str, Any]]:
        """Every slot the cluster has had, as the machine sees it."""
        return list(self.machine.slots())

    def team_usage(self) -> dict[str, float]:
        return self.machine.team_usage()

    def team_window(self) -> tuple[float, dict[str, tuple[float, float]]]:
        """The recent window's length and, per team, its slot-seconds in it and its weight."""
        return (self.machine.sched_config.share_window_s,
                self.machine.team_window(time.monotonic()))

    def decision_ms(self) -> dict[str, Any]:
        """The machine's decision times and the inbox's slices (``cluster.snapshot()``)."""
        return decision_figures(self.decision_s, self.decision_cpu_s, self.feed_s,
                                self.inbox.slice_s_seen)

    def rank_secret(self, job_id: str, generation: int) -> str:
        """The secret a generation's ranks were launched with ("" once it is closed)."""
        return self.seals.secret(job_id, generation)

    def control_state(self, job_id: str) -> Mapping[str, Any]:
        """The control flags of the job's live generation as its rank 0 reads them (the
        machine's): ``generation``, ``version``, ``flags``, ``knobs``; empty when the job has
        no live generation (or is unknown)."""
        live = self.machine.control(job_id)
        if live is None:
            return {}
        return {"generation": live.generation, "version": live.version, "flags": live.flags,
                "knobs": list(live.knobs)}


def _label(event: Event) -> str:
    """What an event was, for the decision figures (step rows with their count)."""
    if isinstance(event, RankSteps):
        return f"RankSteps {len(event.rows)} rows"
    return type(event).__name__


def _job_of(event: Event) -> str | None:
    """The job an event concerns (None: the cluster's)."""
    if isinstance(event, Submitted):
        return event.job.spec.job_id
    job_id = getattr(event, "job_id", None)
    return None if job_id is None else str(job_id)


def _carried_from(data: Mapping[str, Any] | None) -> CarriedHistory:
    """A journaled ``CarriedHistory`` (JSON: lists for tuples); empty for a job the last
    controller had not journaled beyond its submission."""
    if not data:
        return CarriedHistory()
    known = {f.name for f in dataclasses.fields(CarriedHistory)}
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                              for k, v in data.items() if k in known}
    return CarriedHistory(**values)


def _failure_info(exc: BaseException, host: str) -> RankFailureInfo:
    """A rank task's exception as the machine wants it (``RankFailure`` carries it all)."""
    from nbtrain.runtime.errors import RankFailure

    if isinstance(exc, RankFailure):
        return RankFailureInfo(error=exc.error, traceback=exc.traceback, host=exc.host,
                               step=exc.step, when=exc.when, peer=exc.peer)
    return RankFailureInfo(error=f"{type(exc).__name__}: {exc}",
                           traceback="(no traceback: the rank task ended outside nbtrain's "
                                     "loop)", host=host, step=0, when=time.time(), peer=False)
