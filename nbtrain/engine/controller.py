"""The controller: one thread per ``Cluster`` that owns every job's state.

All decisions and state changes happen on this thread, fed by one queue: submissions and
control requests from the notebook, rank events from Dask's event stream, rank-task
completions from future callbacks, and a periodic tick (worker inventory, deadlines). Nothing
here runs on the kernel's thread, so no call from the notebook waits for training.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from distributed import Client, Future, Variable

from nbtrain.config import Settings
from nbtrain.core.job import JobState
from nbtrain.engine.inventory import Slot, by_host, read_slots
from nbtrain.engine.job import JobHandle
from nbtrain.engine.placement import place_gang
from nbtrain.runtime.control import control_name, empty_control
from nbtrain.runtime.errors import RankFailure
from nbtrain.runtime.events import topic_for
from nbtrain.runtime.loop import RankLaunch, rendezvous_name, run_rank

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
        self._subscribed: set[str] = set()
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

    def request(self, job: JobHandle, what: str) -> None:
        self._inbox.put(("request", job, what))

    def snapshot(self) -> tuple[dict[str, Slot], dict[str, str], list[JobHandle]]:
        """Slots, slot owners and jobs, for display."""
        with self._lock:
            return dict(self._slots), dict(self._owner), list(self._jobs.values())

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
            self._on_request(msg[1], msg[2])
        elif kind == "event":
            self._on_event(msg[1], msg[2])
        elif kind == "rank_done":
            self._on_rank_done(msg[1], msg[2], msg[3], msg[4])

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_inventory >= self.settings.inventory_refresh_s:
            self._refresh_inventory()
            self._check_lost_workers()
        for job_id, gen in list(self._gens.items()):
            job = self._jobs[job_id]
            if gen.failures and not gen.finished(job.spec.world_size):
                assert gen.failed_at is not None
                if now - gen.failed_at > self.settings.failure_grace_s:
                    self._force_end(job, gen)
        self._admit()

    # -- submission and admission ---------------------------------------------------------
    def _on_submit(self, job: JobHandle) -> None:
        spec = job.spec
        if not spec.queue:
            self._refresh_inventory()
            free = self._free_by_host()
            if place_gang(free, spec.world_size) is None:
                n_free = sum(len(v) for v in free.values())
                raise ValueError(
                    f"job {spec.name} needs {spec.world_size} slots at once but only {n_free} "
                    f"of the cluster's {len(self._slots)} are free (queue=False, so it is not "
                    f"queued): free slots, add workers, or submit with queue=True"
                )
        with self._lock:
            self._jobs[job.id] = job
        self._enqueue(job)
        self._admit()

    def _enqueue(self, job: JobHandle) -> None:
        self._queued.append(job)
        # Highest priority first; FIFO within a priority (sort is stable).
        self._queued.sort(key=lambda j: -j.spec.priority)
        job._set_state(JobState.QUEUED, "waiting for slots")

    def _free_by_host(self) -> dict[str, list[str]]:
        free = {a: s for a, s in self._slots.items() if a not in self._owner}
        return by_host(free)

    def _admit(self) -> None:
        """Start queued jobs in order while whole gangs fit. Strict order: a job that does
        not fit blocks the ones behind it, so big gangs are not starved by small ones."""
        while self._queued:
            job = self._queued[0]
            free = self._free_by_host()
            placement = place_gang(free, job.spec.world_size)
            if placement is None:
                n_free = sum(len(v) for v in free.values())
                total = len(self._slots)
                if job.spec.world_size > total:
                    why = (f"needs {job.spec.world_size} slots at once; the cluster has "
                           f"{total}: waiting for workers to join")
                else:
                    why = (f"needs {job.spec.world_size} slots at once; {n_free} of {total} "
                           f"free")
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
        job._set_state(JobState.STARTING, f"generation {number}: starting {len(slots)} ranks")
        if job.id not in self._subscribed:
            topic = topic_for(job.id)
            self.client.subscribe_topic(
                topic, lambda event, jid=job.id: self._inbox.put(("event", jid, event[1]))
            )
            self._subscribed.add(job.id)
        Variable(control_name(job.id), client=self.client).set(empty_control())
        host_slots = {h: len(v) for h, v in by_host(self._slots).items()}
        for rank, addr in enumerate(slots):
            launch = RankLaunch(
                job_id=job.id, rank=rank, world_size=spec.world_size, generation=number,
                recipe=job._recipe, steps=spec.steps, seed=spec.seed,
                host_slots=host_slots.get(self._slots[addr].host, 1), settings=self.settings,
            )
            fut = self.client.submit(
                run_rank, launch, key=f"nbtrain-{job.id}-g{number}-r{rank}",
                workers=[addr], allow_other_workers=False, pure=False, retries=0,
            )
            fut.add_done_callback(
                lambda f, jid=job.id, n=number, r=rank: self._inbox.put(("rank_done", jid, n, r, f))
            )
            gen.futures[rank] = fut

    # -- requests -------------------------------------------------------------------------
    def _on_request(self, job: JobHandle, what: str) -> None:
        if what != "stop":
            raise ValueError(f"unknown request {what!r}")
        if job.status.terminal:
            return
        if job in self._queued:
            self._queued.remove(job)
            job._set_state(JobState.CANCELLED, "stopped by user while queued")
            return
        if job.id in self._gens:
            self._set_control(job, stop=1)
            job._set_state(JobState.STOPPING, "stop requested: ending at the next step boundary")

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
        if kind == "steps":
            job._add_rows(int(msg["gen"]), int(msg["rank"]), msg["rows"])
            if job.status is JobState.STARTING and msg["gen"] == job.generation:
                job._set_state(JobState.RUNNING, f"training (generation {job.generation})")
            return
        job._add_event(dict(msg))

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

    def _record_failure(self, gen: Generation, rank: int, failure: RankFailure) -> None:
        gen.failures[rank] = failure
        if gen.failed_at is None:
            gen.failed_at = time.monotonic()

    def _check_lost_workers(self) -> None:
        for job_id, gen in list(self._gens.items()):
            job = self._jobs[job_id]
            for rank, addr in enumerate(gen.slots):
                if addr in self._slots or rank in gen.outcomes or rank in gen.failures:
                    continue
                self._record_failure(gen, rank, RankFailure(
                    rank, job.step, addr, f"worker {addr} left the cluster (process died?)",
                    "(no traceback: the worker process is gone)", time.time(), peer=False))
                gen.futures[rank].cancel()
            if gen.finished(job.spec.world_size):
                self._end_generation(job, gen)

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
        addrs = [gen.slots[r] for r in stuck if gen.slots[r] in self._slots]
        if addrs:
            with contextlib.suppress(Exception):
                self.client.restart_workers(addrs, raise_for_error=False)
        self._end_generation(job, gen)

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
        if gen.failures:
            primary = _primary_failure(gen.failures)
            with job._lock:
                job._error = str(primary)
            job._set_state(JobState.FAILED,
                           f"rank {primary.rank} failed at step {primary.step}: {primary.error}")
        else:
            outcomes = {o.get("outcome") for o in gen.outcomes.values()}
            step = max(int(o.get("step", 0)) for o in gen.outcomes.values())
            if outcomes == {"completed"}:
                job._set_state(JobState.SUCCEEDED, f"completed {step} steps")
            else:
                job._set_state(JobState.CANCELLED, f"stopped by user at step {step}")
        self._admit()

    # -- inventory and shutdown -----------------------------------------------------------
    def _refresh_inventory(self) -> None:
        self._last_inventory = time.monotonic()
        try:
            slots = read_slots(self.client)
        except Exception:
            logger.debug("could not read workers from the scheduler", exc_info=True)
            return
        with self._lock:
            self._slots = slots

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
