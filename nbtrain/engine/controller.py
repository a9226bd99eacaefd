"""The controller: one thread per ``Cluster`` that owns every job's state.

All decisions and state changes happen on this thread, fed by one queue: submissions and
control requests from the notebook, rank events from Dask's event stream, rank-task
completions from future callbacks, and a periodic tick (worker inventory, hang watchdog,
deadlines). Nothing here runs on the kernel's thread, so no call from the notebook waits for
training. Slow cluster operations (restarting a stuck worker) run on helper threads and report
back through the same queue.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from distributed import Client, Future, Variable

from nbtrain.config import Settings
from nbtrain.core.checkpoint_policy import parse_checkpoint_setting
from nbtrain.core.job import JobState
from nbtrain.core.mitigation import ActionKind, SlotInfo
from nbtrain.engine.checkpoints import resolve_resume
from nbtrain.engine.health import HostHealth, hung_ranks
from nbtrain.engine.inventory import Slot, by_host, read_slots
from nbtrain.engine.job import JobHandle
from nbtrain.engine.placement import place_gang
from nbtrain.engine.stragglers import mitigation_event
from nbtrain.runtime.checkpointing import CheckpointPlan
from nbtrain.runtime.control import control_name, empty_control
from nbtrain.runtime.errors import RankFailure
from nbtrain.runtime.events import topic_for
from nbtrain.runtime.faults import Fault, deliver
from nbtrain.runtime.loop import RankLaunch, rendezvous_name, run_rank
from nbtrain.runtime.storage import CheckpointStore

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One (re)start of a job's gang."""

    number: int
    slots: list[str]
    futures: dict[int, Future] = field(default_factory=dict)
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    failed_at: float | None = None  # monotonic time of the first failure
    failed_wall: float | None = None
    last_progress: float = field(default_factory=time.monotonic)
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    hang: dict[str, Any] | None = None  # set when the watchdog declared this generation hung
    injected: dict[str, Any] | None = None  # the last fault injected in this generation
    running: bool = False
    released: bool = False  # failed ranks' workers restarted to free their peers

    def finished(self, world_size: int) -> bool:
        return len(self.outcomes) + len(self.failures) >= world_size


class Controller:
    def __init__(self, client: Client, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self._inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._lock = threading.Lock()
        self._jobs: dict[str, JobHandle] = {}
        self._queued: list[JobHandle] = []
        self._gens: dict[str, Generation] = {}
        self._slots: dict[str, Slot] = {}
        self._owner: dict[str, str] = {}  # slot address -> job id
        self._restarting: dict[str, float] = {}  # slot address -> monotonic time asked
        self._subscribed: set[str] = set()
        self._health = HostHealth(settings.host_failure_limit, settings.host_failure_window_s,
                                  settings.host_exclusion_s)
        self._closed = threading.Event()
        self._last_inventory = 0.0
        self._refresh_inventory()
        self._thread = threading.Thread(target=self._run, name="nbtrain-controller", daemon=True)
        self._thread.start()

    # -- API used by Cluster and JobHandle (any thread) -----------------------------------
    def submit(self, job: JobHandle) -> None:
        """Queue or start ``job``; raises ValueError at once for a fail-fast job that
        cannot be placed now."""
        reply: queue.Queue[BaseException | None] = queue.Queue()
        self._inbox.put(("submit", job, reply))
        error = reply.get(timeout=60)
        if error is not None:
            raise error

    def request(self, job: JobHandle, what: str, arg: Any = None) -> None:
        self._inbox.put(("request", job, what, arg))

    def snapshot(self) -> tuple[dict[str, Slot], dict[str, str], list[JobHandle]]:
        """Slots, slot owners (a job id, or "(restarting)") and jobs, for display."""
        with self._lock:
            owner = dict(self._owner)
            for addr in self._restarting:
                owner.setdefault(addr, "(restarting)")
            return dict(self._slots), owner, list(self._jobs.values())

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._inbox.put(("close",))
        self._thread.join(timeout=30)
        self._closed.set()

    # -- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        tick = self.settings.controller_tick_s
        while True:
            try:
                msg: tuple[Any, ...] | None = self._inbox.get(timeout=tick)
            except queue.Empty:
                msg = None
            try:
                while msg is not None:
                    if msg[0] == "close":
                        self._shutdown()
                        return
                    self._handle(msg)
                    msg = self._inbox.get_nowait() if not self._inbox.empty() else None
                self._tick()
            except Exception:  # the controller must survive anything a job throws at it
                logger.exception("nbtrain controller error")

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "submit":
            _, job, reply = msg
            try:
                self._on_submit(job)
            except BaseException as exc:
                reply.put(exc)
            else:
                reply.put(None)
        elif kind == "request":
            self._on_request(msg[1], msg[2], msg[3])
        elif kind == "event":
            self._on_event(msg[1], msg[2])
        elif kind == "rank_done":
            self._on_rank_done(msg[1], msg[2], msg[3], msg[4])
        elif kind == "request_restart":
            self._restart_workers(msg[1])
        elif kind == "restarted":
            self._refresh_inventory()

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_inventory >= self.settings.inventory_refresh_s:
            self._refresh_inventory()
            self._check_lost_workers()
        for job_id, gen in list(self._gens.items()):
            job = self._jobs[job_id]
            if gen.failures and not gen.finished(job.spec.world_size):
                assert gen.failed_at is not None
                waited = now - gen.failed_at
                if waited > self.settings.failure_grace_s:
                    self._force_end(job, gen)
                elif waited > self.settings.peer_release_s and not gen.released:
                    self._release_peers(gen)
            elif gen.running and job.status is JobState.RUNNING and gen.hang is None:
                self._watch_for_hang(job, gen, now)
        self._admit()

    # -- submission and admission ---------------------------------------------------------
    def _on_submit(self, job: JobHandle) -> None:
        spec = job.spec
        parse_checkpoint_setting(spec.checkpoint)  # raises ValueError naming the fix
        if spec.resume is not None:
            job._restore = resolve_resume(self.settings.checkpoint_root, spec.name, spec.resume)
        if not spec.queue:
            self._refresh_inventory()
            free = self._free_by_host()
            if self._place(job, free) is None:
                n_free = sum(len(v) for v in free.values())
                raise ValueError(
                    f"job {spec.name} needs {spec.world_size} slots at once but only {n_free} "
                    f"of the cluster's {len(self._slots)} are free (queue=False, so it is not "
                    f"queued): free slots, add workers, or submit with queue=True"
                )
        with self._lock:
            self._jobs[job.id] = job
        self._enqueue(job, "waiting for slots")
        self._admit()

    def _enqueue(self, job: JobHandle, reason: str, *, front: bool = False) -> None:
        if front:
            self._queued.insert(0, job)
        else:
            self._queued.append(job)
        # Highest priority first; FIFO within a priority (sort is stable).
        self._queued.sort(key=lambda j: -j.spec.priority)
        job._set_state(JobState.QUEUED, reason)

    def _free_by_host(self) -> dict[str, list[str]]:
        free = {a: s for a, s in self._slots.items()
                if a not in self._owner and a not in self._restarting}
        return by_host(free)

    def _place(self, job: JobHandle, free: dict[str, list[str]]) -> list[str] | None:
        now = time.monotonic()
        excluded = job._stragglers.excluded(now)
        return place_gang(free, job.spec.world_size, all_by_host=by_host(self._slots),
                          avoid_hosts=self._health.excluded(now) | excluded,
                          avoid_slots=job._avoid_slots | excluded)

    def _admit(self) -> None:
        """Start queued jobs in order while whole gangs fit. Strict order: a job that does
        not fit blocks the ones behind it, so big gangs are not starved by small ones."""
        while self._queued:
            job = self._queued[0]
            free = self._free_by_host()
            placement = self._place(job, free)
            if placement is None:
                n_free = sum(len(v) for v in free.values())
                total = len(self._slots)
                if job.spec.world_size > total:
                    why = (f"needs {job.spec.world_size} slots at once; the cluster has "
                           f"{total}: waiting for workers to join")
                else:
                    why = (f"needs {job.spec.world_size} slots at once; {n_free} of {total} "
                           f"free")
                if job._recovering:
                    why = f"{job._recovering}; {why}"
                job._set_state(JobState.QUEUED, why)
                for behind in self._queued[1:]:
                    behind._set_state(JobState.QUEUED, f"waiting behind job {job.name} ({why})")
                return
            self._queued.pop(0)
            self._launch(job, placement)

    def _launch(self, job: JobHandle, slots: list[str]) -> None:
        spec = job.spec
        number = job.generation + 1
        gen = Generation(number=number, slots=slots)
        with self._lock:
            for addr in slots:
                self._owner[addr] = job.id
        with job._lock:
            job._generation = number
            job._slots = list(slots)
            if job.started_at is None:
                job.started_at = time.time()
        self._gens[job.id] = gen
        now = time.monotonic()
        job._ledger.enter("recovery" if job._recovering else "startup", now)
        what = f"recovering ({job._recovering})" if job._recovering else "starting"
        job._set_state(JobState.STARTING,
                       f"generation {number}: {what}, {len(slots)} ranks")
        if job.id not in self._subscribed:
            self.client.subscribe_topic(
                topic_for(job.id),
                lambda event, jid=job.id: self._inbox.put(("event", jid, event[1])))
            self._subscribed.add(job.id)
        Variable(control_name(job.id), client=self.client).set(empty_control())
        plan = self._checkpoint_plan(job)
        host_slots = {h: len(v) for h, v in by_host(self._slots).items()}
        unfired = tuple(f for f in job._faults if f.id not in job._fired)
        for rank, addr in enumerate(slots):
            launch = RankLaunch(
                job_id=job.id, rank=rank, world_size=spec.world_size, generation=number,
                recipe=job._recipe, steps=spec.steps, seed=spec.seed,
                host_slots=host_slots.get(self._slots[addr].host, 1), settings=self.settings,
                checkpoint=plan, faults=tuple(f for f in unfired if f.rank == rank),
                job_info=spec.describe(),
            )
            fut = self.client.submit(
                run_rank, launch, key=f"nbtrain-{job.id}-g{number}-r{rank}",
                workers=[addr], allow_other_workers=False, pure=False, retries=0,
            )
            fut.add_done_callback(
                lambda f, jid=job.id, n=number, r=rank: self._inbox.put(("rank_done", jid, n, r, f))
            )
            gen.futures[rank] = fut

    def _checkpoint_plan(self, job: JobHandle) -> CheckpointPlan:
        """Write to the job's own directory; restore from it when it has a committed
        checkpoint, else from the ``resume=`` source, else start fresh."""
        restore: tuple[str, int | None] | None = job._restore
        own = CheckpointStore(job._ckpt_url, keep=self.settings.checkpoint_keep)
        if own.latest() is not None:
            restore = (job._ckpt_url, None)
        return CheckpointPlan(
            url=job._ckpt_url,
            policy=parse_checkpoint_setting(job.spec.checkpoint, mtbf_s=self.settings.mtbf_s),
            keep=self.settings.checkpoint_keep,
            restore_url=restore[0] if restore else None,
            restore_at_or_before=restore[1] if restore else None,
            commit_timeout_s=self.settings.checkpoint_commit_timeout_s,
        )

    # -- requests -------------------------------------------------------------------------
    def _on_request(self, job: JobHandle, what: str, arg: Any) -> None:
        if job.status.terminal:
            return
        running = job.id in self._gens
        if what == "stop":
            job._stop_requested = True
            if job in self._queued:
                self._queued.remove(job)
                job._ledger.enter("ended", time.monotonic())
                job._set_state(JobState.CANCELLED, "stopped by user while queued")
            elif job.status is JobState.PREEMPTED:
                job._ledger.enter("ended", time.monotonic())
                job._set_state(JobState.CANCELLED, "stopped by user while preempted")
            elif running:
                self._set_control(job, stop=1)
                job._set_state(JobState.STOPPING, "stop requested: ending at the next step "
                                                  "boundary")
        elif what == "preempt":
            if job in self._queued:
                self._queued.remove(job)
                job._set_state(JobState.PREEMPTED, "preempted while queued; resume() queues "
                                                   "it again")
            elif running:
                job._preempt_requested = True
                self._set_control(job, preempt=1)
                job._set_state(JobState.STOPPING, "preempting: checkpoint at the next step "
                                                  "boundary, then release the slots")
        elif what == "resume":
            if job.status is JobState.PREEMPTED:
                job._preempt_requested = False
                self._enqueue(job, "resuming: waiting for slots")
                self._admit()
        elif what == "checkpoint":
            if running:
                job._checkpoint_seq += 1
                self._set_control(job, checkpoint=job._checkpoint_seq)
        elif what == "stragglers":
            for event in job._stragglers.update(**arg):
                job._add_event(event)
        elif what == "inject":
            fault: Fault = arg
            job._faults.append(fault)
            gen = self._gens.get(job.id)
            if gen is not None and fault.rank < len(gen.slots):
                with contextlib.suppress(Exception):
                    self.client.run(deliver, job.id, fault.to_dict(),
                                    workers=[gen.slots[fault.rank]])
        else:
            raise ValueError(f"unknown request {what!r}")

    def _set_control(self, job: JobHandle, **flags: int) -> None:
        var = Variable(control_name(job.id), client=self.client)
        try:
            value = dict(var.get(timeout=5))
        except Exception:
            value = empty_control()
        value.update(flags)
        var.set(value)

    # -- rank events and completions --------------------------------------------------------
    def _on_event(self, job_id: str, msg: dict[str, Any]) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            return
        kind = msg.get("kind")
        gen = self._gens.get(job_id)
        current = gen is not None and msg.get("gen") == gen.number
        if kind == "steps":
            rank = int(msg["rank"])
            job._add_rows(int(msg["gen"]), rank, msg["rows"])
            if not current:
                return
            assert gen is not None
            gen.last_progress = time.monotonic()
            if rank == 0:
                for row in msg["rows"]:
                    job._ledger.step(int(row[0]), float(row[2]))
                    gen.step_times.append(float(row[2]))
            self._watch_stragglers(job, gen, rank, msg["rows"])
            if not gen.running:
                gen.running = True
                job._ledger.enter("training", time.monotonic())
                if job._recovering:
                    self._finish_recovery(job, gen, msg["rows"])
                if job.status is JobState.STARTING:
                    job._set_state(JobState.RUNNING, f"training (generation {gen.number})")
            return
        if kind == "checkpoint":
            phase = msg.get("phase")
            if phase == "committed":
                job._ledger.committed(int(msg["step"]))
            elif phase == "snapshot" and msg.get("rank") == 0:
                job._ledger.checkpoint_blocked(
                    (float(msg.get("blocking_ms", 0)) + float(msg.get("wait_ms", 0))) / 1e3)
        elif kind == "rank_started" and current and msg.get("rank") == 0:
            for event in job._stragglers.restart(job.spec.world_size, int(msg["start_step"])):
                job._add_event(event)
        elif kind == "fault_injected" and current:
            assert gen is not None
            job._fired.add(str(msg["fault"]["id"]))
            gen.injected = msg
        job._add_event(dict(msg))

    def _watch_stragglers(self, job: JobHandle, gen: Generation, rank: int,
                          rows: list[Any]) -> None:
        try:
            events = job._stragglers.observe(rank, rows)
        except ValueError:  # malformed timing (e.g. clock jumps): skip, never break the job
            return
        for event in events:
            job._add_event(event)
        if rank != 0 or job.status is not JobState.RUNNING:
            return
        placement = {r: SlotInfo(a, self._slots[a].host) for r, a in enumerate(gen.slots)
                     if a in self._slots}
        free = self._free_by_host()
        spares = [SlotInfo(a, h) for h, addrs in free.items() for a in addrs]
        for action in job._stragglers.decide(time.monotonic(), job.step, placement, spares):
            job._add_event(mitigation_event(action))
            if action.kind is ActionKind.REPLACE and action.slot is not None:
                # Through the preemption path: checkpoint, end the generation, start again
                # without the slow slot. No committed step is lost.
                job._replace = {"slot": action.slot.slot, "reason": action.reason}
                self._set_control(job, preempt=1)
                job._set_state(JobState.STOPPING, f"replacing slow rank {action.rank}: "
                                                  "checkpoint at the next step boundary")

    def _finish_recovery(self, job: JobHandle, gen: Generation, rows: list[Any]) -> None:
        fault = job._fault_log[-1] if job._fault_log else {}
        start = fault.get("detected_mono")
        recovery_s = time.monotonic() - start if start is not None else None
        info = {"kind": "recovery", "generation": gen.number, "recovery_s": recovery_s,
                "resumed_step": int(rows[0][0]) - 1 if rows else None,
                "lost_steps": fault.get("lost_steps"), "fault": fault.get("what")}
        fault["recovery_s"] = recovery_s
        job._recovering = ""
        job._add_event(info)

    def _on_rank_done(self, job_id: str, number: int, rank: int, fut: Future) -> None:
        gen = self._gens.get(job_id)
        if gen is None or gen.number != number:
            return  # a late callback from an ended generation
        job = self._jobs[job_id]
        if rank in gen.outcomes or rank in gen.failures:
            return
        if fut.status == "finished":
            gen.outcomes[rank] = fut.result()
        elif fut.status == "error":
            exc = fut.exception()
            failure = exc if isinstance(exc, RankFailure) else RankFailure(
                rank, job.step, gen.slots[rank], f"{type(exc).__name__}: {exc}",
                "(no traceback: the rank task ended outside nbtrain's loop)", time.time(),
                peer=False)
            self._record_failure(gen, rank, failure)
        else:  # cancelled or lost
            self._record_failure(gen, rank, RankFailure(
                rank, job.step, gen.slots[rank], f"rank task {fut.status}",
                "(no traceback)", time.time(), peer=True))
        if gen.finished(job.spec.world_size):
            self._end_generation(job, gen)
        elif rank in gen.failures and gen.failures[rank].peer:
            # A peer's collective failed: perhaps a worker died. Look now rather than at the
            # next periodic inventory refresh.
            self._refresh_inventory()
            self._check_lost_workers()

    def _record_failure(self, gen: Generation, rank: int, failure: RankFailure) -> None:
        gen.failures[rank] = failure
        if gen.failed_at is None:
            gen.failed_at = time.monotonic()
            gen.failed_wall = time.time()

    def _check_lost_workers(self) -> None:
        for job_id, gen in list(self._gens.items()):
            job = self._jobs[job_id]
            for rank, addr in enumerate(gen.slots):
                if addr in self._slots or rank in gen.outcomes or rank in gen.failures:
                    continue
                self._record_failure(gen, rank, RankFailure(
                    rank, job.step, addr, f"worker {addr} left the cluster (process died)",
                    "(no traceback: the worker process is gone)", time.time(), peer=False))
                gen.futures[rank].cancel()
            if gen.finished(job.spec.world_size):
                self._end_generation(job, gen)

    def _watch_for_hang(self, job: JobHandle, gen: Generation, now: float) -> None:
        median = statistics.median(gen.step_times) if gen.step_times else 0.0
        limit = max(self.settings.hang_factor * median, self.settings.hang_floor_s)
        silent = now - gen.last_progress
        if silent <= limit:
            return
        gen.hang = {"silent_s": silent, "limit_s": limit, "detected_wall": time.time(),
                    "detected_mono": now}
        keys = {rank: fut.key for rank, fut in gen.futures.items()}
        slots = list(gen.slots)
        threading.Thread(target=self._restart_hung, args=(job, keys, slots), daemon=True,
                         name="nbtrain-hang-restart").start()

    def _restart_hung(self, job: JobHandle, keys: dict[int, Any], slots: list[str]) -> None:
        """Helper thread: find the ranks stuck outside a collective, restart their workers
        (their peers' collectives then fail at once); all of the job's when unsure."""
        try:
            stacks = self.client.call_stack(keys=list(keys.values()))
        except Exception:
            stacks = {}
        culprits = hung_ranks(keys, slots, stacks)
        targets = [slots[r] for r in culprits] or slots
        logger.warning("nbtrain: job %s hung; restarting workers %s", job.name, targets)
        self._inbox.put(("request_restart", targets))

    def _force_end(self, job: JobHandle, gen: Generation) -> None:
        """Ranks still running long after a peer failed are stuck: cancel them and restart
        their workers (a Python thread cannot be killed; its process can)."""
        stuck = [r for r in range(job.spec.world_size)
                 if r not in gen.outcomes and r not in gen.failures]
        for rank in stuck:
            gen.futures[rank].cancel()
            self._record_failure(gen, rank, RankFailure(
                rank, job.step, gen.slots[rank], "did not exit after a peer failed; "
                "its worker was restarted", "(no traceback)", time.time(), peer=True))
        self._restart_workers([gen.slots[r] for r in stuck])
        self._end_generation(job, gen)

    def _release_peers(self, gen: Generation) -> None:
        """A rank raised and its peers still wait in a collective. Gloo only fails them when
        the failed rank's connections close, which (measured, torch 2.13) destroying its
        process group does not do while DDP holds it: restart that rank's worker instead.
        The peers keep their processes (a warm restart for them)."""
        gen.released = True
        self._restart_workers([gen.slots[r] for r, f in gen.failures.items() if not f.peer])

    def _restart_workers(self, addrs: list[str]) -> None:
        """Restart workers through their nannies on a helper thread; until they are gone
        from the inventory their slots are not offered to any job."""
        addrs = [a for a in addrs if a in self._slots and a not in self._restarting]
        if not addrs:
            return
        now = time.monotonic()
        with self._lock:
            for addr in addrs:
                self._restarting[addr] = now
        threading.Thread(target=self._restart_quietly, args=(addrs,), daemon=True,
                         name="nbtrain-restart-workers").start()

    def _restart_quietly(self, addrs: list[str]) -> None:
        with contextlib.suppress(Exception):
            self.client.restart_workers(addrs, raise_for_error=False)
        self._inbox.put(("restarted", addrs))

    def _end_generation(self, job: JobHandle, gen: Generation) -> None:
        del self._gens[job.id]
        with self._lock:
            for addr in gen.slots:
                if self._owner.get(addr) == job.id:
                    del self._owner[addr]
        with job._lock:
            job._slots = []
        with contextlib.suppress(Exception):
            Variable(rendezvous_name(job.id, gen.number), client=self.client).delete()
        for fut in gen.futures.values():
            fut.release()
        now = time.monotonic()
        if gen.failures or gen.hang is not None:
            self._on_generation_failed(job, gen)
        else:
            outcomes = {o.get("outcome") for o in gen.outcomes.values()}
            step = max(int(o.get("step", 0)) for o in gen.outcomes.values())
            if "preempted" in outcomes and job._replace is not None:
                replace, job._replace = job._replace, None
                job._avoid_slots = {replace["slot"]}
                job._recovering = f"replacing a straggler ({replace['reason']})"
                job._ledger.enter("recovery", now)
                self._enqueue(job, f"{job._recovering}: waiting for slots", front=True)
            elif "preempted" in outcomes:
                job._ledger.enter("queued", now)
                job._set_state(JobState.PREEMPTED,
                               f"checkpointed at step {step} and released its slots; "
                               "resume() to continue")
            elif outcomes == {"completed"}:
                job._ledger.enter("ended", now)
                job._set_state(JobState.SUCCEEDED, f"completed {step} steps")
            else:
                job._ledger.enter("ended", now)
                job._set_state(JobState.CANCELLED, f"stopped by user at step {step}")
        self._admit()

    def _on_generation_failed(self, job: JobHandle, gen: Generation) -> None:
        now = time.monotonic()
        primary = _primary_failure(gen.failures) if gen.failures else None
        fault = self._describe_fault(job, gen, primary)
        host = fault.get("host")
        if host:
            self._health.record(str(host), now)
        job._fault_log.append(fault)
        # A planned fault that this failure consumed must not fire again after the restart,
        # even if its announcement was lost with the process.
        if fault["rank"] is not None:
            for planned in job._faults:
                if (planned.rank == fault["rank"] and planned.kind != "slow"
                        and (planned.step is None or planned.step <= int(fault["step"]) + 1)):
                    job._fired.add(planned.id)
        job._add_event({"kind": "fault", **{k: v for k, v in fault.items()
                                            if k != "detected_mono"}})
        if primary is not None:
            with job._lock:
                job._error = str(primary)
        if job._stop_requested:
            job._ledger.enter("ended", now)
            job._set_state(JobState.CANCELLED, f"stopped by user; a rank failed meanwhile: "
                                               f"{fault['error']}")
            return
        window = job.spec.restart_window_s
        recent = [t for t in job._restarts if now - t < window]
        if len(recent) >= job.spec.max_restarts:
            job._ledger.enter("ended", now)
            faults = "; ".join(f"{f['what']} on rank {f['rank']} ({f['host']}) at step "
                               f"{f['step']}" for f in job._fault_log)
            budget = (f"restart budget spent (max_restarts={job.spec.max_restarts} within "
                      f"{window:.0f} s)" if job.spec.max_restarts else "max_restarts=0")
            with job._lock:
                job._error = (f"{budget}; faults: {faults}\n\n"
                              + (str(primary) if primary else ""))
            job._set_state(JobState.FAILED, f"{fault['what']} on rank {fault['rank']} at step "
                                            f"{fault['step']}: {fault['error']} ({budget})")
            return
        job._restarts.append(now)
        resume_step = self._newest_committed(job)
        fault["lost_steps"] = job._ledger.rollback(resume_step)
        fault["resume_step"] = resume_step
        job._recovering = (f"restart {len(recent) + 1}/{job.spec.max_restarts} after "
                           f"{fault['what']} on rank {fault['rank']}")
        job._avoid_slots = {gen.slots[int(fault["rank"])]} if fault["rank"] is not None else set()
        job._ledger.enter("recovery", now)
        self._enqueue(job, f"{job._recovering}: waiting for slots", front=True)

    def _describe_fault(self, job: JobHandle, gen: Generation,
                        primary: RankFailure | None) -> dict[str, Any]:
        detected_wall = (gen.hang or {}).get("detected_wall") or gen.failed_wall or time.time()
        injected_when = None
        if gen.injected is not None:
            injected_when = float(gen.injected.get("when", 0)) or None
        if gen.hang is not None:
            culprit = next((r for r, f in gen.failures.items() if not f.peer), None)
            what, rank = "hang", culprit
            error = (f"no step progress for {gen.hang['silent_s']:.1f} s "
                     f"(limit {gen.hang['limit_s']:.1f} s)")
            host = self._slots[gen.slots[rank]].host if (
                rank is not None and gen.slots[rank] in self._slots) else None
            step = job.step
        else:
            assert primary is not None
            lost = "left the cluster" in primary.error
            what = "worker died" if lost else "exception"
            rank, error, step = primary.rank, primary.error, primary.step
            host = primary.host
            if host and "://" in host and host in self._slots:
                host = self._slots[host].host
            elif host and "://" in host:
                host = host.split("://", 1)[1].rsplit(":", 1)[0]
        if injected_when is None and gen.hang is not None:
            # Without an injection time, detection latency is counted from the last progress.
            injected_when = detected_wall - gen.hang["silent_s"]
        elif injected_when is None and primary is not None and not primary.peer:
            injected_when = primary.when  # the rank's own clock when it raised
        detect_s = detected_wall - injected_when if injected_when is not None else None
        detected_mono = (gen.hang or {}).get("detected_mono") or gen.failed_at
        return {"what": what, "rank": rank, "host": host, "step": step, "error": error,
                "generation": gen.number, "time": detected_wall, "detect_s": detect_s,
                "detected_mono": detected_mono if detected_mono is not None
                else time.monotonic()}

    def _newest_committed(self, job: JobHandle) -> int:
        for url in (job._ckpt_url, job._restore[0] if job._restore else None):
            if url is None:
                continue
            with contextlib.suppress(Exception):
                latest = CheckpointStore(url).latest()
                if latest is not None:
                    return latest
        return 0

    # -- inventory and shutdown -----------------------------------------------------------
    def _refresh_inventory(self) -> None:
        self._last_inventory = time.monotonic()
        try:
            slots = read_slots(self.client)
        except Exception:
            logger.debug("could not read workers from the scheduler", exc_info=True)
            return
        now = time.monotonic()
        with self._lock:
            self._slots = slots
            # A restarted worker comes back under a new address; the old one is gone for good.
            # One that never went away (a failed restart) is offered again after a minute.
            self._restarting = {a: t for a, t in self._restarting.items()
                                if a in slots and now - t < 60.0}

    def _shutdown(self) -> None:
        for job_id, gen in list(self._gens.items()):
            job = self._jobs[job_id]
            for fut in gen.futures.values():
                fut.cancel()
            job._set_state(JobState.CANCELLED, "the cluster was closed")
        self._gens.clear()
        for job in self._queued:
            job._set_state(JobState.CANCELLED, "the cluster was closed")
        self._queued.clear()
        for job_id in self._subscribed:
            with contextlib.suppress(Exception):
                self.client.unsubscribe_topic(topic_for(job_id))


def _primary_failure(failures: dict[int, RankFailure]) -> RankFailure:
    """The cause, not the consequences: the earliest failure that is not a peer's reaction."""
    causes = [f for f in failures.values() if not f.peer] or list(failures.values())
    return min(causes, key=lambda f: f.when)
