"""The gang scheduler's books: jobs, queue, who holds which slot, and fitting primitives.

``JobBook`` keeps the state the scheduler (``nbtrain.core.scheduler``) decides on and the
operations that change it consistently: enqueue/dequeue in priority-team-submit order, start,
move (resize), preempt and release, each updating the slot owners, the free counts and the
teams' fair-share usage together. It decides nothing; ``Scheduler`` does.

A controller lives for weeks and sees every job ever submitted, so a decision must never walk
the whole book: besides ``_jobs`` (every job, for lookups by id) the book keeps indices of the
live jobs only, updated where a job changes state: the queue buckets, the running jobs by
estimated end (the reservation replays ends in that order), the jobs being stopped, the
running jobs per priority (preemption candidates) and the running jobs with a ``min_size``
(shrink and grow candidates). ``work`` counts what decisions looked at, so tests can check
that the cost of a decision follows the live state and not the history.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Hashable, Iterator
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from nbtrain.core.fairshare import FairShare
from nbtrain.core.goodputmodel import GoodputModel
from nbtrain.core.placement import Placement, place_indices, tp_capacity
from nbtrain.core.sched_types import (
    JobRequest,
    PreemptJob,
    ResizeJob,
    SchedulerConfig,
    StartJob,
)
from nbtrain.core.slotstate import FREE, SlotState
from nbtrain.core.topology import Topology

__all__ = ["JobBook", "JobRecord", "JobView", "Work"]

IntArray = npt.NDArray[np.int64]
EMPTY: IntArray = np.zeros(0, dtype=np.int64)
_AVOIDED = -4  # owner marker for slots a job is kept off in a trial placement


@dataclasses.dataclass(frozen=True)
class JobView:
    """A read-only snapshot of one job, for the UI, the simulator and tests."""

    job_id: str
    state: str  # "queued", "running", "stopping", "held" (suspended by its user), "done"
    size: int  # slots held now (0 when queued or done)
    slots: tuple[Hashable, ...]
    request: JobRequest
    submit_t: float
    first_start_t: float | None
    preemptions: int


@dataclasses.dataclass
class Work:
    """Work units a scheduler has spent so far, by kind; deterministic (no clock), so tests can
    compare the cost of early and late decisions of a long run exactly.

    ``queued``: queued jobs a scheduling pass walked; ``fits``: placement attempts;
    ``running``: running or stopping jobs looked at (reservation, shrink, grow, preemption
    candidates); ``slot_entries``: slot entries copied or scanned in bulk (state copies,
    releases, victim search), which at a fixed cluster size is bounded but not free. (A
    count; ``slots`` elsewhere is always a tuple of slot ids.)
    """

    events: int = 0
    queued: int = 0
    fits: int = 0
    running: int = 0
    slot_entries: int = 0

    def total(self) -> int:
        """All units but ``events``, each weighted 1: a coarse cost of the decisions so far."""
        return self.queued + self.fits + self.running + self.slot_entries


class PreemptionRecord(NamedTuple):
    by: str
    victim: str
    by_priority: int
    victim_priority: int
    overrun: bool  # the victim had overrun the estimate that let it backfill


class JobRecord:
    """The scheduler's record of one job (internal; read it through ``JobView``)."""

    __slots__ = (
        "avoid", "claim", "end", "first_start_t", "idx", "last_ckpt_t", "num",
        "preempted_for", "preemptions", "promise", "req", "seq", "start_t", "state", "submit_t",
    )

    def __init__(self, req: JobRequest, num: int, seq: int, now: float) -> None:
        self.req = req
        self.num = num
        self.seq = seq
        self.state = "queued"
        self.submit_t = now
        self.start_t = now
        self.first_start_t: float | None = None
        self.last_ckpt_t = now
        self.idx: IntArray = EMPTY
        self.preempted_for: str | None = None
        self.preemptions = 0
        self.avoid: frozenset[Hashable] = frozenset()  # slot ids to stay off at the next start
        # Queued behind the head, it preempted jobs for itself: it may take their slots.
        self.claim = False
        # Started by backfill on the head's reserved slots on the strength of its estimate:
        # the time it promised to be done by (past it, the head may preempt it).
        self.promise: float | None = None
        self.end = math.inf  # estimated end while running (see JobBook._end_of)

    @property
    def size(self) -> int:
        return int(self.idx.shape[0])



class JobBook:
    """State of the gang scheduler and the operations that keep it consistent."""

    def __init__(self, topology: Topology, config: SchedulerConfig | None = None) -> None:
        self.topo = topology
        self.config = config or SchedulerConfig()
        self.now = -math.inf
        self._state = SlotState(topology)
        self._jobs: dict[str, JobRecord] = {}
        self._active: dict[str, JobRecord] = {}  # running or stopping: the jobs holding slots
        self._by_num: dict[int, JobRecord] = {}
        self._buckets: dict[int, dict[str, list[JobRecord]]] = {}  # priority -> team -> by seq
        self._n_queued = 0
        self._queued_slots = 0  # the queued jobs' minimum sizes, summed
        self._next_num = 0
        self._fair = FairShare(self.config.weight, self.config.fair_share_half_life_s,
                               self.config.share_window_s)
        self._rng = np.random.default_rng(self.config.seed)
        self._cap_cache: dict[tuple[int, int], int] = {}
        self._avail: SlotState | None = None  # the backfill view during a pass
        self._shrunk = False
        self._later_failed: dict[tuple[int, int], int] = {}  # per pass: (priority, tp) -> size
        #: Recent preemptions (bounded: ended jobs may be forgotten), for invariant checks.
        self.preemption_log: deque[PreemptionRecord] = deque(maxlen=10_000)
        # Live indices (see the module docstring); each holds only jobs that hold slots.
        self._ends: list[tuple[float, int, JobRecord]] = []  # running, by (end, seq)
        self._stopping: dict[int, JobRecord] = {}  # seq -> job told to stop, not yet released
        self._running_at: dict[int, dict[str, JobRecord]] = {}  # priority -> running jobs
        self._flex: dict[str, JobRecord] = {}  # running jobs with a min_size
        #: Goodput models of goodput-sized jobs (``JobRequest.sizing``), fed ``StepTimes``.
        self._models: dict[str, GoodputModel] = {}
        #: Per goodput-sized job: (when, seconds of its run left then, at what size), from
        #: the newest ``StepTimes`` that knew its steps left.
        self._left: dict[str, tuple[float, float, int]] = {}
        self._goodput_next = -math.inf  # when the scheduler next looks at goodput sizing
        self.work = Work()

    def job(self, job_id: str) -> JobView:
        j = self._jobs[job_id]
        return JobView(
            job_id=job_id,
            state=j.state,
            size=j.size,
            slots=tuple(self.topo.slot_ids[i] for i in j.idx.tolist()),
            request=j.req,
            submit_t=j.submit_t,
            first_start_t=j.first_start_t,
            preemptions=j.preemptions,
        )

    def forget(self, job_id: str) -> None:
        """Drop an ended job's record (a long-lived scheduler keeps only live jobs); its id
        may not be submitted again. Unknown ids and live jobs are left alone."""
        j = self._jobs.get(job_id)
        if j is not None and j.state == "done":
            del self._jobs[job_id]
            del self._by_num[j.num]
            self._models.pop(job_id, None)
            self._left.pop(job_id, None)

    def goodput_model(self, job_id: str) -> GoodputModel | None:
        """The goodput model of a goodput-sized job (``None`` for other jobs)."""
        return self._models.get(job_id)

    def job_ids(self, state: str | None = None) -> list[str]:
        """Ids of known jobs (optionally only those in ``state``), in submit order."""
        return [k for k, j in self._jobs.items() if state is None or j.state == state]

    def queued(self) -> list[str]:
        """Queued job ids in the order the next pass will consider them."""
        return [j.req.job_id for j in self._queue_order()]

    @property
    def n_free(self) -> int:
        return self._state.n_free

    @property
    def n_online(self) -> int:
        """Slots whose worker is there now (free or held)."""
        return int(self.topo.n_slots - int(self._state.gone.sum()))

    def free_slot_ids(self) -> list[Hashable]:
        """Ids of the slots free now (online and held by no job)."""
        return [self.topo.slot_ids[i] for i in self._state.free_indices().tolist()]

    def owners(self) -> list[str | None]:
        """Per slot index: the id of the job holding it, or ``None``."""
        return [
            self._by_num[o].req.job_id if o >= 0 else None for o in self._state.owner.tolist()
        ]

    def team_usage(self) -> dict[str, float]:
        """Undecayed slot-seconds held per team so far."""
        return dict(self._fair.total)

    def team_window(self, now: float) -> dict[str, tuple[float, float]]:
        """Per team that held slots: (slot-seconds over the last ``share_window_s`` before
        ``now``, its weight); teams with jobs here that never held a slot count 0."""
        used = self._fair.window_usage(now)
        for j in self._jobs.values():
            used.setdefault(j.req.team, 0.0)
        return {team: (slot_s, self.config.weight(team)) for team, slot_s in used.items()}

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping breaks a guarantee (used by tests)."""
        owner = self._state.owner
        held = 0
        for j in self._jobs.values():
            if j.state in ("queued", "held", "done"):
                assert j.size == 0, f"{j.req.job_id} is {j.state} but holds {j.size} slots"
                continue
            assert j.size >= j.req.min_slots or j.state == "stopping", (
                f"{j.req.job_id} holds {j.size} < min {j.req.min_slots}"
            )
            assert j.size % j.req.layout.replica == 0 or j.state == "stopping"
            assert (owner[j.idx] == j.num).all(), f"{j.req.job_id}: owner array disagrees"
            held += j.size
            if self.config.placement == "topology" and j.req.layout.tp > 1 and (
                j.state == "running"
            ):
                groups = self.topo.dom["nvlink"][j.idx].reshape(-1, j.req.layout.tp)
                assert (groups == groups[:, :1]).all(), f"{j.req.job_id}: TP group off NVLink"
        assert held == int((owner >= 0).sum()), "slots held by unknown jobs"
        fresh = SlotState(self.topo, owner.copy())
        for name, counts in self._state.free_count.items():
            assert np.array_equal(counts, fresh.free_count[name]), f"free counts of {name} stale"
        for rec in self.preemption_log:
            assert rec.by_priority > rec.victim_priority or (
                rec.overrun and rec.by_priority >= rec.victim_priority), (
                f"{rec.by} (priority {rec.by_priority}) preempted {rec.victim} (priority "
                f"{rec.victim_priority})")
        running = {k for k, j in self._active.items() if j.state == "running"}
        assert {e[2].req.job_id for e in self._ends} == running, "end index stale"
        assert all(e[0] == self._end_of(e[2]) for e in self._ends), "end estimates stale"
        assert self._ends == sorted(self._ends, key=lambda e: (e[0], e[1])), "end index unsorted"
        assert {j.req.job_id for j in self._stopping.values()} == set(self._active) - running
        assert {k for v in self._running_at.values() for k in v} == running
        assert set(self._flex) == {k for k in running
                                   if self._active[k].req.min_size is not None}
        assert self._n_queued == sum(len(b) for t in self._buckets.values() for b in t.values())
        assert self._queued_slots == sum(j.req.min_slots for t in self._buckets.values()
                                         for b in t.values() for j in b)

    # ================================================================== bookkeeping
    def _enqueue(self, j: JobRecord) -> None:
        j.state = "queued"
        bucket = self._buckets.setdefault(j.req.priority, {}).setdefault(j.req.team, [])
        bisect.insort(bucket, j, key=lambda x: x.seq)
        self._n_queued += 1
        self._queued_slots += j.req.min_slots

    def _dequeue(self, j: JobRecord) -> None:
        teams = self._buckets.get(j.req.priority, {})
        bucket = teams.get(j.req.team)
        if not bucket:
            return
        i = bisect.bisect_left(bucket, j.seq, key=lambda x: x.seq)
        if i < len(bucket) and bucket[i] is j:
            del bucket[i]
            self._n_queued -= 1
            self._queued_slots -= j.req.min_slots
            if not bucket:
                del teams[j.req.team]
                if not teams:
                    del self._buckets[j.req.priority]

    def _release(self, j: JobRecord) -> None:
        if j.state == "running":
            self._unindex(j)
        elif j.state == "stopping":
            self._stopping.pop(j.seq, None)
        if j.size:
            self._state.release(j.idx)
            self.work.slot_entries += j.size
            self._fair.hold(j.req.team, -j.size)
            self._cap_cache.clear()
        j.idx = EMPTY
        j.preempted_for = None
        self._active.pop(j.req.job_id, None)

    # ------------------------------------------------------------ live indices
    @staticmethod
    def _end_of(j: JobRecord) -> float:
        """When a running job will end at its estimate (never, without one): the reservation
        replays ends in this order. Elastic jobs run longer at a smaller size."""
        est = j.req.est_duration_s
        return math.inf if est is None else j.start_t + est * j.req.size / j.size

    def _index(self, j: JobRecord) -> None:
        """Add a job that has just become running (or changed size, start or request)."""
        j.end = self._end_of(j)
        bisect.insort(self._ends, (j.end, j.seq, j))
        self._running_at.setdefault(j.req.priority, {})[j.req.job_id] = j
        if j.req.min_size is not None:
            self._flex[j.req.job_id] = j

    def _unindex(self, j: JobRecord) -> None:
        i = bisect.bisect_left(self._ends, (j.end, j.seq))
        if i == len(self._ends) or self._ends[i][2] is not j:
            raise RuntimeError(f"job {j.req.job_id!r} missing from the end index: "
                               "bookkeeping bug")
        del self._ends[i]
        at = self._running_at[j.req.priority]
        del at[j.req.job_id]
        if not at:
            del self._running_at[j.req.priority]
        self._flex.pop(j.req.job_id, None)

    def _set_request(self, j: JobRecord, req: JobRequest) -> None:
        """Change a job's request, keeping the indices that read it in step."""
        if j.state == "running":
            self._unindex(j)
            j.req = req
            self._index(j)
        else:
            if j.state == "queued":
                self._queued_slots += req.min_slots - j.req.min_slots
            j.req = req

    def _end_order(self) -> Iterator[tuple[float, JobRecord]]:
        """Jobs holding slots, in the order they let go of them, with the time: running jobs
        at their estimated end (now, when overdue), stopping ones a grace period from now;
        ties in submit order. Lazy, since the reservation usually needs only the first few."""
        now = self.now
        k = bisect.bisect_right(self._ends, (now, math.inf))  # overdue: end <= now
        overdue = sorted((e[1], e[2]) for e in self._ends[:k])
        soon = now + self.config.preempt_grace_s
        streams: tuple[Iterator[tuple[float, int, JobRecord]], ...] = (
            ((now, seq, j) for seq, j in overdue),
            (self._ends[i] for i in range(k, len(self._ends))),
            ((soon, seq, self._stopping[seq]) for seq in sorted(self._stopping)),
        )
        for t, _, j in heapq.merge(*streams):
            yield t, j

    def _copy(self, st: SlotState) -> SlotState:
        self.work.slot_entries += self.topo.n_slots
        return st.copy()

    def _placement(self, j: JobRecord, idx: IntArray) -> Placement:
        return Placement(
            slots=tuple(self.topo.slot_ids[i] for i in idx.tolist()),
            indices=tuple(idx.tolist()),
            layout=j.req.layout,
            mesh_shape=j.req.layout.mesh_shape(int(idx.shape[0])),
        )

    def _start(self, j: JobRecord, idx: IntArray, avail: SlotState | None) -> StartJob:
        self._dequeue(j)
        self._state.take(idx, j.num)
        if avail is not None:
            avail.take(idx[avail.owner[idx] == FREE], j.num)
        self._cap_cache.clear()
        self._fair.hold(j.req.team, int(idx.shape[0]))
        j.idx = idx
        j.state = "running"
        j.avoid = frozenset()
        j.claim = False
        j.promise = None
        self._active[j.req.job_id] = j
        j.start_t = self.now
        j.last_ckpt_t = self.now
        if j.first_start_t is None:
            j.first_start_t = self.now
        self._index(j)
        self.work.slot_entries += int(idx.shape[0])
        return StartJob(j.req.job_id, self._placement(j, idx))

    def _move(self, j: JobRecord, idx: IntArray, reason: str) -> ResizeJob:
        old = j.size
        self._unindex(j)
        self._state.release(j.idx)
        self._state.take(idx, j.num)
        self._fair.hold(j.req.team, int(idx.shape[0]) - old)
        self._cap_cache.clear()
        j.idx = idx
        j.start_t = self.now
        j.last_ckpt_t = self.now
        self._index(j)
        self.work.slot_entries += old + int(idx.shape[0])
        return ResizeJob(j.req.job_id, self._placement(j, idx), old, reason)

    def _preempt(
        self, j: JobRecord, head: JobRecord | None, reason: str, grace: float
    ) -> PreemptJob:
        self._unindex(j)
        self._stopping[j.seq] = j
        j.state = "stopping"
        j.preemptions += 1
        j.preempted_for = head.req.job_id if head else None
        if head is not None:
            self.preemption_log.append(PreemptionRecord(
                head.req.job_id, j.req.job_id, head.req.priority, j.req.priority,
                self.overran(j)))
        return PreemptJob(j.req.job_id, grace, reason, j.preempted_for)

    def overran(self, j: JobRecord) -> bool:
        """Started by backfill on the strength of its estimate, and past it now."""
        return j.promise is not None and self.now > j.promise

    def _lost_work(self, j: JobRecord) -> float:
        """Slot-seconds a preemption of ``j`` now would throw away, restart included."""
        last = max(j.start_t, j.last_ckpt_t)
        every = j.req.checkpoint_every_s
        if every:
            last = max(last, j.start_t + math.floor((self.now - j.start_t) / every) * every)
        return j.size * (self.now - last + self.config.restart_cost_s)

    def _retopologize(self, topo: Topology) -> None:
        """Move to ``topo``: slots it adds are free, slots it drops must be unowned."""
        old_ids = self.topo.slot_ids
        owner = np.full(topo.n_slots, FREE, dtype=np.int64)
        gone = np.zeros(topo.n_slots, dtype=bool)
        kept = np.array([i for i, s in enumerate(old_ids) if s in topo.index], dtype=np.int64)
        new_pos = np.full(len(old_ids), -1, dtype=np.int64)
        new_pos[kept] = topo.indices([old_ids[i] for i in kept.tolist()])
        owner[new_pos[kept]] = self._state.owner[kept]
        gone[new_pos[kept]] = self._state.gone[kept]
        for j in self._active.values():  # the only jobs holding slots
            j.idx = new_pos[j.idx]
            assert (j.idx >= 0).all(), f"{j.req.job_id} held a slot the topology dropped"
        self.topo = topo
        self._state = SlotState(topo, owner)
        self._state.gone = gone
        self._cap_cache.clear()

    # ================================================================== fitting
    def _queue_order(self) -> Iterator[JobRecord]:
        return iter(self._queue_list())

    def _queue_list(self) -> list[JobRecord]:
        """Queued jobs in the order a pass considers them (see ``Scheduler``). Built from
        slices of the sorted buckets, so a long queue costs list copies, not Python steps."""
        cfg = self.config
        if cfg.order == "fifo":
            lists = [b for teams in self._buckets.values() for b in teams.values()]
            return list(heapq.merge(*lists, key=lambda x: x.seq))
        out: list[JobRecord] = []
        for prio in sorted(self._buckets, reverse=True):
            teams = self._buckets[prio]
            n_aged: dict[str, int] = {}
            if cfg.max_wait_s is not None:
                # Jobs queued longer than max_wait_s go first; a bucket is in submit order, so
                # they are its prefix.
                cutoff = self.now - cfg.max_wait_s
                aged: list[JobRecord] = []
                for team, bucket in teams.items():
                    n = 0
                    for x in bucket:
                        if x.submit_t > cutoff:
                            break
                        n += 1
                    if n:
                        n_aged[team] = n
                        aged.extend(bucket[:n])
                aged.sort(key=lambda x: x.seq)
                out.extend(aged)
            names = self._fair.order(teams) if cfg.fair_share else sorted(teams)
            for team in names:
                out.extend(teams[team][n_aged.get(team, 0):])
        return out

    def _capacity(self, st: SlotState, tp: int) -> int:
        """Most slots ``st`` can give in whole TP groups; cached for the live state and the
        backfill view until the next change (other states are short-lived trials)."""
        if self.config.placement != "topology":
            return st.n_free
        cacheable = st is self._state or st is self._avail
        key = (id(st), tp)
        if cacheable and key in self._cap_cache:
            return self._cap_cache[key]
        got = int(tp_capacity(st, tp)[self.topo.tree[-1]].sum()) * tp
        if cacheable:
            self._cap_cache[key] = got
        return got

    def _fit(self, st: SlotState, j: JobRecord, size: int | None = None) -> IntArray | None:
        """Placement of ``j`` on ``st`` at the largest allowed size, or ``None``. Slots the job
        should avoid (``Failed``/``Released`` with ``avoid``) are used only when nothing else
        fits."""
        if j.avoid:
            known = [s for s in j.avoid if s in self.topo.index]
            idx = self.topo.indices(known) if known else EMPTY
            idx = idx[st.owner[idx] == FREE]
            if idx.shape[0]:
                trial = self._copy(st)
                trial.take(idx, _AVOIDED)
                got = self._fit_free(trial, j, size)
                if got is not None:
                    return got
        return self._fit_free(st, j, size)

    def _fit_free(self, st: SlotState, j: JobRecord, size: int | None = None) -> IntArray | None:
        req = j.req
        r = req.layout.replica
        want = req.size if size is None else size
        self.work.fits += 1
        if req.min_slots > st.n_free:
            return None
        cap = self._capacity(st, req.layout.tp)
        n = min(want, cap // r * r)
        if n < min(req.min_slots, want) or n < r:
            return None
        return place_indices(st, n, req.layout, policy=self.config.placement, rng=self._rng)

    def _ends_by(self, j: JobRecord, size: int, deadline: float) -> bool:
        est = j.req.est_duration_s
        if est is None:
            return False
        return self.now + est * j.req.size / max(size, 1) <= deadline

    def _own_fit(self, j: JobRecord, size: int) -> IntArray | None:
        """Placement of ``j`` at ``size`` inside the slots it holds now."""
        self.work.fits += 1
        self.work.slot_entries += self.topo.n_slots
        own = np.zeros(self.topo.n_slots, dtype=np.int64)
        own[j.idx] = FREE
        return place_indices(SlotState(self.topo, own), size, j.req.layout,
                             policy=self.config.placement, rng=self._rng)
