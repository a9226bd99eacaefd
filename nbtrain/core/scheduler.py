"""The gang scheduler: a pure state machine, events in, decisions out.

``Scheduler(topology, config).handle(event) -> list[Decision]`` is the whole API. The live
engine and the simulator (``nbtrain.sim``) both drive it and carry the decisions out in order;
neither decides anything itself. The event and decision types are in
``nbtrain.core.sched_types``; the books it keeps (jobs, queue, slot owners) in
``nbtrain.core.jobbook``.

What one scheduling pass does, after the event is applied:

1. Walk the queue in order: priority, then (within a priority) jobs waiting longer than
   ``max_wait_s``, then teams by fair share, then submit order; ``order="fifo"`` uses submit
   order alone. Start every job whose whole gang can be placed now (all or nothing; elastic
   jobs at the largest size that fits, at least ``min_size``).
2. The first job that does not fit is the *head*. For it, in turn: wait if jobs being stopped
   will make room; shrink elastic jobs of no higher priority as far as needed (never below
   their minimum) if that lets it start now; preempt whole
   lower-priority jobs, chosen so that the freed slots form a domain the head can use (checked
   by placing it before anyone is preempted); otherwise reserve the slots it will get when
   running jobs end at their estimates (the shadow time).
3. Backfill: later jobs start only on slots outside the head's reservation, unless their
   estimate says they end before the shadow time.
4. When nobody waits, grow elastic jobs into idle slots.

Goodput-sized jobs (``JobRequest.sizing="goodput"``, fed ``StepTimes``) are sized by
``nbtrain.core.goodput_sizing`` at most every ``goodput_check_s``: before the pass, while jobs
wait, they give back ranks past their knee (no more than the waiting jobs need); when nobody
waits, slots move between them to where they add most speedup, instead of step 4. A blocked
head shrinks them first, the cheapest in lost speedup per slot first. A scheduler with no
such job takes none of these paths (its schedules are the pinned ones).

Engine use (one queue shared by many notebooks)::

    sched = Scheduler(Topology.from_hosts(workers_by_host), SchedulerConfig(team_weights=w))
    for d in sched.handle(Submit(now, JobRequest(job_id="j1", size=4, layout=Layout(tp=2)))):
        StartJob   -> launch rank r on d.placement.slots[r]
        PreemptJob -> checkpoint, stop within d.grace_s, then handle(Released(now, d.job_id))
        ResizeJob  -> restart the job's next generation on d.placement
        RejectJob  -> tell the user d.reason
    handle(Finished(now, id)) when a job ends; WorkersAdded / WorkersRemoved as workers come and
    go; Checkpointed after each committed checkpoint; Tick now and then.

Guarantees the tests check: a job holds either no slots or a complete gang of at least its
minimum; every start comes with a placement on free slots; a job only preempts jobs of strictly
lower priority (so preemption can never cycle); fair share only orders, never preempts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterable, Iterator

import numpy as np
import numpy.typing as npt

from nbtrain.core import goodput_sizing
from nbtrain.core.goodputmodel import GoodputModel
from nbtrain.core.jobbook import EMPTY, JobBook, JobRecord, JobView
from nbtrain.core.placement import check_feasible, place_indices
from nbtrain.core.preemption import choose_victims
from nbtrain.core.reservation import releases_needed
from nbtrain.core.sched_types import (
    Cancelled,
    Checkpointed,
    Decision,
    Event,
    Failed,
    Finished,
    JobRequest,
    RejectJob,
    Released,
    ResizeRequested,
    Resume,
    StepTimes,
    Submit,
    Suspend,
    Tick,
    WorkersAdded,
    WorkersForgotten,
    WorkersRemoved,
)
from nbtrain.core.slotstate import FREE, OFFLINE, SlotState

__all__ = ["JobView", "Scheduler"]

IntArray = npt.NDArray[np.int64]
_RESERVED = -3  # owner marker for the head's reserved slots in the backfill view
_NEVER = 1 << 62  # a min_slots no job reaches


class Scheduler(JobBook):
    """Gang scheduler over one ``Topology``; see the module docstring for the policy.

    ``Scheduler(topology, config)``; ``handle(event) -> list[Decision]``; read-only views:
    ``job(id)``, ``job_ids(state)``, ``queued()``, ``owners()``, ``n_free``, ``team_usage()``.
    """

    MAX_SHRINK = 16  # elastic jobs considered for shrinking per blocked head (bounds a pass)
    MAX_LATER_PREEMPTORS = 4  # queued jobs behind a blocked head that may preempt, per pass

    def handle(self, event: Event) -> list[Decision]:
        """Apply one event and run a scheduling pass; returns the decisions, in order."""
        if event.now < self.now:
            raise ValueError(
                f"event {type(event).__name__} at now={event.now} is earlier than the last "
                f"event at {self.now}: feed events in time order"
            )
        self.now = event.now
        self.work.events += 1
        self._fair.advance(event.now)
        out: list[Decision] = []
        self._apply(event, out)
        self._schedule(out)
        return out

    # ================================================================== events
    def _apply(self, ev: Event, out: list[Decision]) -> None:
        if isinstance(ev, Submit):
            self._submit(ev.job, out)
        elif isinstance(ev, Finished | Cancelled | Failed | Released | Suspend | Resume
                        | Checkpointed | StepTimes):
            j = self._jobs.get(ev.job_id)
            if j is not None:
                self._job_event(j, ev)
        elif isinstance(ev, ResizeRequested):
            self._resize_request(ev, out)
        elif isinstance(ev, WorkersAdded):
            self._workers_added(ev)
        elif isinstance(ev, WorkersRemoved):
            self._workers_removed(ev, out)
        elif isinstance(ev, WorkersForgotten):
            self._workers_forgotten(ev)
        elif not isinstance(ev, Tick):
            raise TypeError(f"unknown event {ev!r}; see nbtrain.core.sched_types.Event")

    def _job_event(self, j: JobRecord, ev: Finished | Cancelled | Failed | Released | Suspend
                   | Resume | Checkpointed | StepTimes) -> None:
        """What the engine says about one of the jobs it was told to run."""
        if isinstance(ev, Finished | Cancelled | Suspend):
            if j.state != "done":
                self._release(j)
                self._dequeue(j)
                j.state = "held" if isinstance(ev, Suspend) else "done"
        elif isinstance(ev, Failed | Released):
            if j.state in ("running", "stopping"):
                self._release(j)
                if isinstance(ev, Failed) and not ev.requeue:
                    j.state = "done"
                else:
                    j.avoid = ev.avoid
                    self._enqueue(j)
        elif isinstance(ev, Resume):
            if j.state == "held":
                self._enqueue(j)
        elif isinstance(ev, StepTimes):
            self._step_times(ev)
        else:
            j.last_ckpt_t = ev.now

    def _step_times(self, ev: StepTimes) -> None:
        """Measured step times feed a goodput-sized job's model (other jobs have none)."""
        model = self._models.get(ev.job_id)
        if model is not None:
            model.observe(ev.size, ev.step_s, ev.steps, compute_s=ev.compute_s,
                          comm_s=ev.comm_s)
            if ev.noise_scale is not None:
                model.noise_scale = ev.noise_scale
            if ev.steps_left is not None and ev.steps_left >= 0 and ev.step_s > 0:
                self._left[ev.job_id] = (ev.now, ev.steps_left * ev.step_s, ev.size)

    def _submit(self, req: JobRequest, out: list[Decision]) -> None:
        if req.job_id in self._jobs:
            out.append(RejectJob(req.job_id, f"job id {req.job_id!r} is already in use; "
                                             "submit under a new id"))
            return
        try:
            check_feasible(self.topo, req.min_slots, req.layout,
                           check_size=not self.config.can_grow)
        except ValueError as err:
            out.append(RejectJob(req.job_id, str(err)))
            return
        j = JobRecord(req, self._next_num, self._next_num, self.now)
        self._next_num += 1
        self._jobs[req.job_id] = j
        self._by_num[j.num] = j
        if req.goodput_sized:
            self._models[req.job_id] = GoodputModel(ref_size=req.size)
        self._enqueue(j)

    def _resize_request(self, ev: ResizeRequested, out: list[Decision]) -> None:
        j = self._jobs.get(ev.job_id)
        if j is None or j.state == "done":
            out.append(RejectJob(ev.job_id, f"no live job {ev.job_id!r} to resize"))
            return
        r = j.req.layout.replica
        if ev.size < r or ev.size % r:
            out.append(RejectJob(ev.job_id, f"resize to {ev.size} ranks: must be a positive "
                                            f"multiple of tp*cp*pp={r}"))
            return
        new_min = None if j.req.min_size is None else min(j.req.min_size, ev.size)
        new_max = None if j.req.max_size is None else max(j.req.max_size, ev.size)
        if j.state != "running":
            # Nothing to place now, so nothing else refuses it: a size the cluster can never
            # hold would leave the job queued for ever (refused at submit, as it would be).
            try:
                check_feasible(self.topo, ev.size if new_min is None else new_min,
                               j.req.layout, check_size=not self.config.can_grow)
            except ValueError as err:
                out.append(RejectJob(ev.job_id, f"cannot resize {ev.job_id!r} to {ev.size} "
                                                f"ranks: {err}; it keeps {j.req.size}"))
                return
        old_req = j.req
        self._set_request(j, dataclasses.replace(j.req, size=ev.size, min_size=new_min,
                                                 max_size=new_max))
        if j.state != "running" or j.size == ev.size:
            return
        if ev.size < j.size:
            own = SlotState(self.topo, np.where(self._state.owner == j.num, FREE, 0))
            idx = place_indices(own, ev.size, j.req.layout, policy=self.config.placement,
                                rng=self._rng)
        else:
            trial = self._copy(self._state)
            trial.release(j.idx)
            idx = place_indices(trial, ev.size, j.req.layout, policy=self.config.placement,
                                rng=self._rng)
        if idx is None:
            if ev.size > j.size and j.req.elastic and (self.config.can_grow
                                                       or ev.size <= self.n_online):
                # The cluster can hold it: keep the new size and grow when enough slots are
                # free at once (``_grow_elastic``), never onto part of them.
                return
            self._set_request(j, old_req)
            out.append(RejectJob(ev.job_id, f"cannot resize {ev.job_id!r} to {ev.size} ranks "
                                            f"now ({self._state.n_free} slots free); it keeps "
                                            f"{j.size}"))
            return
        out.append(self._move(j, idx, "resize requested"))

    def _workers_added(self, ev: WorkersAdded) -> None:
        unknown = {h: [s for s in slots if s not in self.topo.index]
                   for h, slots in ev.hosts.items()}
        unknown = {h: s for h, s in unknown.items() if s}
        if unknown:
            self._retopologize(self.topo.with_hosts(unknown, nvlink_of=ev.nvlink_of,
                                                    leaf_of=ev.leaf_of))
        known = [s for slots in ev.hosts.values() for s in slots]
        self._state.set_online(self.topo.indices(known))

    def has_slot(self, slot: Hashable) -> bool:
        """Whether the topology has ``slot`` (online or not)."""
        return slot in self.topo.index

    def _workers_forgotten(self, ev: WorkersForgotten) -> None:
        known = [s for s in ev.slots if s in self.topo.index]
        idx = self.topo.indices(known)
        ok = self._state.owner[idx] == OFFLINE  # offline and nobody's
        drop = [s for s, fine in zip(known, ok.tolist(), strict=True) if fine]
        if not drop or len(drop) >= self.topo.n_slots:
            return
        self._retopologize(self.topo.without_slots(drop))

    def _workers_removed(self, ev: WorkersRemoved, out: list[Decision]) -> None:
        idx = self.topo.indices([s for s in ev.slots if s in self.topo.index])
        hit = sorted({int(o) for o in self._state.owner[idx] if o >= 0})
        self._state.set_offline(idx)
        self._cap_cache.clear()
        for num in hit:
            j = self._by_num[num]
            if j.state != "running":
                continue
            keep = j.idx[~self._state.gone[j.idx]]
            r = j.req.layout.replica
            size = min(j.req.size, keep.shape[0] // r * r)
            new = None
            if j.req.elastic and size >= j.req.min_slots:
                own = np.zeros(self.topo.n_slots, dtype=np.int64)
                own[keep] = FREE
                new = place_indices(SlotState(self.topo, own), size, j.req.layout,
                                    policy=self.config.placement, rng=self._rng)
            if new is not None:
                out.append(self._move(j, new, "worker lost"))
            else:
                out.append(self._preempt(j, None, "worker lost", grace=0.0))

    # ================================================================== the pass
    def _schedule(self, out: list[Decision]) -> None:
        self._shrunk = False  # set when a shrink let a job start: no regrowth in the same pass
        goodput = bool(self._models) and self.now >= self._goodput_next
        if goodput:
            self._goodput_next = self.now + self.config.goodput_check_s
        if self._n_queued == 0:
            if goodput:
                self._goodput_rebalance(out)
            self._grow_elastic(out)
            return
        if goodput:
            self._goodput_for_queue(out)
        head = self._pass(out)
        if head is None and not self._shrunk:
            if goodput and self._n_queued == 0:
                self._goodput_rebalance(out)
            self._grow_elastic(out)

    # ================================================================== goodput sizing
    def _goodput_candidates(self) -> list[tuple[JobRecord, goodput_sizing.Candidate]]:
        """Running goodput-sized jobs past their resize interval and measured at the size
        they run at (a job not yet measured there would be moved blind: a first step can
        take longer than the interval), with their models."""
        cfg = self.config
        wait = max(cfg.goodput_interval_s, cfg.min_resize_interval_s)
        out = []
        for j in self._flex.values():
            model = self._models.get(j.req.job_id)
            if model is None or self.now - j.start_t < wait or j.size not in model.sizes:
                continue
            out.append((j, goodput_sizing.Candidate(
                job_id=j.req.job_id, model=model, size=j.size, min_size=j.req.min_slots,
                max_size=j.req.max_slots, replica=j.req.layout.replica,
                priority=j.req.priority, left_s=self._left_s(j, model))))
        self.work.running += len(self._flex)
        return out

    def goodput_left_s(self, job_id: str) -> float | None:
        """Seconds of a goodput-sized job's run left at its current size, as goodput sizing
        sees it (None: not known, or not such a job)."""
        j, model = self._jobs.get(job_id), self._models.get(job_id)
        return None if j is None or model is None else self._left_s(j, model)

    def _left_s(self, j: JobRecord, model: GoodputModel) -> float | None:
        """Seconds of a goodput-sized job's run left at its current size, from its newest
        step times that knew its steps left (None: none did)."""
        got = self._left.get(j.req.job_id)
        if got is None:
            return None
        t, left, size = got
        left = max(0.0, left - (self.now - t))
        return left if size == j.size else left * model.speedup(size) / model.speedup(j.size)

    def _goodput_for_queue(self, out: list[Decision]) -> None:
        """Jobs wait: goodput-sized jobs give back ranks past their knee (or are probed), in
        ``goodput_sizing.queue_order``, until the waiting jobs' minimum sizes fit in the
        free slots (each give-back is a restart: no more than the queue needs)."""
        cfg = self.config
        need = self._queued_slots - self._state.n_free
        if need <= 0:
            return
        recs: dict[str, JobRecord] = {}
        changes = []
        for j, c in self._goodput_candidates():
            change = goodput_sizing.for_queue(c, threshold=cfg.goodput_knee,
                                              min_confidence=cfg.goodput_min_confidence)
            if change is not None:
                recs[c.job_id] = j
                changes.append((c, change))
        for c, change in goodput_sizing.queue_order(changes):
            if need <= 0:
                break
            j = recs[c.job_id]
            small = self._own_fit(j, change.new)
            if small is not None:
                need -= j.size - int(small.shape[0])
                out.append(self._move(j, small, change.reason))

    def _goodput_rebalance(self, out: list[Decision]) -> None:
        """Nobody waits: move slots between goodput-sized jobs (and free ones) to where they
        add most speedup."""
        cfg = self.config
        cands = self._goodput_candidates()
        if not cands:
            return
        recs = {c.job_id: j for j, c in cands}
        plan = goodput_sizing.rebalance([c for _, c in cands], self._state.n_free,
                                        min_gain=cfg.goodput_min_gain,
                                        min_confidence=cfg.goodput_min_confidence,
                                        value_ranks=cfg.goodput_value_ranks)
        for change in plan:
            j = recs[change.job_id]
            if change.new < j.size:
                idx = self._own_fit(j, change.new)
            else:
                trial = self._copy(self._state)
                trial.release(j.idx)
                idx = self._fit(trial, j, size=change.new)
            if idx is None or int(idx.shape[0]) == j.size:
                continue  # the slots do not fit a placement now: it keeps its size
            got = int(idx.shape[0])
            note = "" if got == change.new else f" ({got} fit now)"
            out.append(self._move(j, idx, change.reason + note))

    def _shrink_key(self, j: JobRecord) -> tuple[int, int, tuple[int, float], int]:
        """Order of elastic jobs to shrink for a blocked head: lower priority first; within a
        priority goodput-sized jobs first, those losing least speedup per slot at their
        minimum for the time they have left first (``goodput_sizing.shrink_key``); then the
        others with the most ranks above their minimum first."""
        model = self._models.get(j.req.job_id)
        spare = j.size - j.req.min_slots
        if model is None or not spare:
            return (j.req.priority, 1, (0, float(-spare)), j.seq)
        loss = goodput_sizing.loss_per_slot(model, j.size, j.req.min_slots)
        return (j.req.priority, 0, goodput_sizing.shrink_key(loss, self._left_s(j, model)),
                j.seq)

    def _shrink_reason(self, j: JobRecord, new: int, head: JobRecord) -> str:
        model = self._models.get(j.req.job_id)
        why = f"shrunk for {head.req.job_id!r}"
        if model is None:
            return why
        lost = goodput_sizing.shrink_cost(model, j.size, new)
        how = (f"costs {lost:.0%} of its speedup" if lost >= 0
               else f"raises its speedup by {-lost:.0%}")
        return f"{why}: {j.size}->{new} ranks {how}, it starts"

    def _pass(self, out: list[Decision]) -> JobRecord | None:
        """One pass over the queue: start what fits, make way for the first blocked job (the
        head: reserve its slots, backfill behind it); returns the head (None: none blocked)."""
        cfg = self.config
        avail: SlotState | None = None
        shadow = math.inf
        head: JobRecord | None = None
        # Per target, per TP degree: the smallest min_slots that failed to fit. A pass only
        # takes slots, so any job at least that big fails too and is not tried again.
        fail_live: dict[int, int] = {}
        fail_view: dict[int, int] = {}
        reserved: IntArray | None = None
        later_preemptors = self.MAX_LATER_PREEMPTORS
        self._later_failed: dict[tuple[int, int], int] = {}
        queue = self._queue_list()
        self.work.queued += len(queue)
        later_ok = cfg.preemption and cfg.order == "priority"
        for j in queue:
            # Nothing more can start once the slots are gone; jobs behind the head may still
            # preempt.
            full = self._state.n_free == 0 and head is not None
            if full and not (later_ok and later_preemptors):
                break
            if not full and self._try_start(j, avail, shadow, fail_live, fail_view, out):
                continue
            if head is not None:
                if later_ok and later_preemptors:
                    later_preemptors -= 1
                    self._preempt_for_later(j, reserved, shadow, out)
                continue
            head = j
            if not cfg.backfill and cfg.order == "fifo":
                break
            reserved, shadow = self._head_blocked(j, out)
            if reserved is None:  # the head started after elastic shrinks
                head = None
                continue
            if not cfg.backfill:
                break
            avail = self._copy(self._state)
            keep = reserved[avail.owner[reserved] == FREE]
            avail.take(keep, _RESERVED)
            self._avail = avail
        self._avail = None
        self._cap_cache.clear()
        return head

    def _try_start(self, j: JobRecord, avail: SlotState | None, shadow: float,
                   fail_live: dict[int, int], fail_view: dict[int, int],
                   out: list[Decision]) -> bool:
        """Start ``j`` where it fits: the live state, or behind a blocked head the backfill
        view (``avail``) and the live state only for a job that ends before the ``shadow``
        time. True when the pass is done with it (started, or known not to fit); False when
        it is blocked."""
        req = j.req
        tp = req.layout.tp
        need = req.min_slots
        now = self.now
        if avail is not None and need >= fail_view.get(tp, _NEVER) and not j.claim:
            # Cannot fit the backfill view; the live state only takes it if it ends before
            # the shadow time (``_ends_by``, inlined: a long queue is mostly such jobs).
            est = req.est_duration_s
            if need >= fail_live.get(tp, _NEVER) or est is None or not (
                now + est * req.size / max(need, 1) <= shadow
            ):
                return True
        targets = [(self._state, fail_live)] if avail is None else [(avail, fail_view)]
        if avail is not None and (self._ends_by(j, need, shadow)
                                  or (j.claim and not math.isfinite(shadow))):
            targets.append((self._state, fail_live))
        for st, fails in targets:
            if need >= fails.get(tp, _NEVER):
                continue
            idx = self._fit(st, j)
            if idx is None:
                fails[tp] = min(fails.get(tp, _NEVER), need)
                continue
            on_reserved = st is self._state and avail is not None
            claimed = j.claim and not math.isfinite(shadow)
            if on_reserved and not claimed and not self._ends_by(
                j, int(idx.shape[0]), shadow
            ):
                continue  # uses reserved slots and might outlive the shadow time
            est = req.est_duration_s
            promise = (now + est * req.size / int(idx.shape[0])
                       if on_reserved and not claimed and est is not None else None)
            out.append(self._start(j, idx, avail))
            j.promise = promise
            return True
        return False

    def _head_blocked(self, head: JobRecord, out: list[Decision]) -> tuple[IntArray | None, float]:
        """Make way for the blocked head; return its reserved slots and the shadow time
        (``None`` slots when it could start right away)."""
        cfg = self.config
        soon = self._state
        if self._stopping:
            # Without jobs being stopped ``soon`` is the live state, on which the head has just
            # failed to fit: no need to copy it or to try again.
            soon = self._copy(self._state)
            soon.release(np.concatenate([j.idx for j in self._stopping.values()]))
            self.work.running += len(self._stopping)
            idx = self._fit(soon, head)
            if idx is not None:
                return idx, self.now
        if cfg.order == "priority":
            started = self._shrink_elastic_for(head, out)
            if started:
                return None, self.now
        if cfg.preemption and cfg.order == "priority":
            idx = self._preempt_for_head(head, soon, out)
            if idx is not None:
                return idx, self.now
        return self._shadow(head)

    def _preempt_for_head(self, head: JobRecord, soon: SlotState,
                          out: list[Decision]) -> IntArray | None:
        """Preempt (and shrink) for the blocked head; its slots when that makes room, else
        None (nothing is preempted)."""
        req = head.req
        # Victims: preemptible jobs of lower priority, and (whatever their priority, up to
        # the head's) jobs that backfilled on the head's slots and overran the estimate
        # that let them.
        cost = {
            j.num: self._lost_work(j)
            for prio, running in self._running_at.items() if prio <= req.priority
            for j in running.values()
            if j.req.preemptible and (prio < req.priority or self.overran(j))
        }
        self.work.running += len(cost)
        plan = None
        if cost:
            self.work.slot_entries += self.topo.n_slots
            plan = choose_victims(soon, req.min_slots, req.layout, cost)
        idx = None
        if plan is not None:
            trial = self._copy(soon)
            trial.release(np.concatenate([self._by_num[n].idx for n in plan.victims]))
            idx = self._fit(trial, head)
        # Shrinking elastic jobs with preemptions on top is tried when preemptions alone
        # fail, or would stop an elastic job whole.
        stops_elastic = plan is not None and any(
            self._by_num[n].req.elastic for n in plan.victims)
        combined = (self._shrink_and_preempt(head, soon, cost)
                    if self._flex and (idx is None or stops_elastic) else None)
        if combined is not None and (idx is None or plan is None
                                     or combined[3] <= plan.lost):
            shrinks, victims, head_idx, _ = combined
            for j, small in shrinks:
                out.append(self._move(j, small, self._shrink_reason(j, int(small.shape[0]),
                                                                    head)))
            self._shrunk = True
            self._preempt_all(victims, head, out)
            return head_idx
        if plan is not None and idx is not None:
            self._preempt_all(plan.victims, head, out)
            return idx
        return None

    def _preempt_all(self, victims: Iterable[int], head: JobRecord,
                     out: list[Decision]) -> None:
        for num in victims:
            out.append(self._preempt(self._by_num[num], head,
                                     self._why_preempted(self._by_num[num], head),
                                     self.config.preempt_grace_s))

    def _why_preempted(self, victim: JobRecord, by: JobRecord) -> str:
        reason = f"preempted for {by.req.job_id!r} (priority {by.req.priority})"
        if self.overran(victim) and victim.req.priority >= by.req.priority:
            reason += (f": it overran the estimate ({victim.req.est_duration_s:g} s) that let "
                       "it run on slots reserved for that job")
        return reason

    def _shrink_and_preempt(
        self, head: JobRecord, soon: SlotState, cost: dict[int, float]
    ) -> tuple[list[tuple[JobRecord, IntArray]], tuple[int, ...], IntArray, float] | None:
        """Shrink elastic jobs (priority <= head's) to their minimum and preempt whole jobs
        on top, when the two together make room: an elastic job keeps running smaller instead
        of being stopped whole. Shrinks are added one at a time (the cheapest candidates
        first) until the head fits. Returns (shrinks, victims, the head's slots, lost work).

        A shrink keeps the leading ``min_size`` ranks of the job's placement: ranks are
        numbered with data parallelism outermost, so that prefix holds whole replicas (TP
        groups stay inside their NVLink domains)."""
        req = head.req
        cands = sorted(
            (j for j in self._flex.values()
             if j.req.elastic and j.size > j.req.min_slots and j.req.priority <= req.priority),
            key=self._shrink_key,
        )[: self.MAX_SHRINK]
        shrunk_nums = {j.num for j in cands}
        reclaimable = sum(int(self._by_num[n].idx.shape[0]) for n in cost
                          if n not in shrunk_nums)
        surplus = sum(j.size - j.req.min_slots for j in cands)
        if not cands or soon.n_free + surplus + reclaimable < req.min_slots:
            return None
        trial = self._copy(soon)
        shrinks: list[tuple[JobRecord, IntArray]] = []
        for j in cands:
            small = j.idx[: j.req.min_slots]
            trial.release(j.idx[j.req.min_slots:])
            shrinks.append((j, small))
            taken = {jj.num for jj, _ in shrinks}
            rest = {n: c for n, c in cost.items() if n not in taken}
            victims: tuple[int, ...] = ()
            fits = trial
            if trial.n_free < req.min_slots:
                if not rest:
                    continue
                plan = choose_victims(trial, req.min_slots, req.layout, rest)
                if plan is None:
                    continue
                victims = plan.victims
                fits = self._copy(trial)
                fits.release(np.concatenate([self._by_num[n].idx for n in victims]))
            idx = self._fit(fits, head)
            if idx is None:
                continue
            lost = sum(cost[n] for n in victims) + sum(
                int(sm.shape[0]) * self.config.restart_cost_s for _, sm in shrinks)
            return shrinks, victims, idx, lost
        return None

    def _preempt_for_later(self, j: JobRecord, reserved: IntArray | None, shadow: float,
                           out: list[Decision]) -> None:
        """A job behind a head that cannot start may preempt jobs of strictly lower priority
        for itself (Kueue #5243: otherwise a high-priority small job waits behind a blocked
        big head while low-priority jobs run). When the head will start at a known time, the
        slots reserved for it are left alone: the head must not end up waiting behind it."""
        req = j.req
        if j.claim:
            if any(v.preempted_for == req.job_id for v in self._stopping.values()):
                return  # its victims are still releasing
            j.claim = False
        if not self._running_at or min(self._running_at) >= req.priority:
            return
        # Within a pass, a bigger job of the same priority and TP degree finds no victims
        # where a smaller one found none.
        key = (req.priority, req.layout.tp)
        if req.min_slots >= self._later_failed.get(key, _NEVER):
            return
        binding = math.isfinite(shadow) and reserved is not None and reserved.shape[0] > 0
        held = np.zeros(self.topo.n_slots, dtype=bool)
        if binding:
            assert reserved is not None
            held[reserved] = True
        cost = {
            v.num: self._lost_work(v)
            for prio, running in self._running_at.items() if prio < req.priority
            for v in running.values()
            if v.req.preemptible and not (binding and held[v.idx].any())
        }
        self.work.running += len(cost)
        base = self._avail if binding and self._avail is not None else self._state
        plan = choose_victims(base, req.min_slots, req.layout, cost) if cost else None
        if plan is not None and not plan.victims:
            plan = None  # nothing to preempt: preempting cannot make it fit sooner
        trial = None
        if plan is not None:
            trial = self._copy(base)
            trial.release(np.concatenate([self._by_num[n].idx for n in plan.victims]))
        if plan is None or trial is None or self._fit(trial, j) is None:
            self._later_failed[key] = min(self._later_failed.get(key, _NEVER), req.min_slots)
            return
        self._later_failed.clear()  # slots are changing hands
        for num in plan.victims:
            out.append(self._preempt(self._by_num[num], j, self._why_preempted(
                self._by_num[num], j), self.config.preempt_grace_s))
        j.claim = True

    def _shadow(self, head: JobRecord) -> tuple[IntArray, float]:
        """Reserve where the head will run when running jobs end at their estimates."""
        tp = head.req.layout.tp if self.config.placement == "topology" else 1
        units = head.req.min_slots // tp
        read: list[tuple[float, JobRecord]] = []

        def releases() -> Iterator[IntArray]:
            for t, j in self._end_order():
                read.append((t, j))
                yield j.idx

        m = releases_needed(self._state, tp, units, releases())
        self.work.running += len(read)
        if m is None:
            return EMPTY, math.inf
        trial = self._copy(self._state)
        if m:
            trial.release(np.concatenate([j.idx for _, j in read[:m]]))
        idx = self._fit(trial, head, size=head.req.min_slots)
        shadow = read[m - 1][0] if m else self.now
        return (EMPTY if idx is None else idx), shadow

    def _shrink_elastic_for(self, head: JobRecord, out: list[Decision]) -> bool:
        """Shrink elastic jobs (priority <= head's) no further than needed, never below their
        minimum, if that lets the head start now; all or nothing. Returns whether it started."""
        self.work.running += len(self._flex)
        cands = sorted(
            (j for j in self._flex.values()
             if j.req.elastic and j.size > j.req.min_slots
             and j.req.priority <= head.req.priority),
            key=self._shrink_key,
        )[: self.MAX_SHRINK]
        surplus = sum(j.size - j.req.min_slots for j in cands)
        if not cands or self._state.n_free + surplus < head.req.min_slots:
            return False
        trial = self._copy(self._state)
        plan: list[tuple[JobRecord, IntArray]] = []
        for j in cands:
            r = j.req.layout.replica
            # Largest size of j (multiple of r, >= min) at which the head fits: binary search.
            lo, hi = j.req.min_slots // r, j.size // r - 1
            best: tuple[IntArray, IntArray] | None = None  # (j's slots, head's slots)
            while lo <= hi:
                mid = (lo + hi) // 2
                got = self._shrunk_fit(trial, j, mid * r, head)
                if got is None:
                    hi = mid - 1
                else:
                    best, lo = got, mid + 1
            if best is not None:
                plan.append((j, best[0]))
                for jj, small_idx in plan:
                    out.append(self._move(jj, small_idx, self._shrink_reason(
                        jj, int(small_idx.shape[0]), head)))
                out.append(self._start(head, best[1], None))
                self._shrunk = True
                return True
            small = self._own_fit(j, j.req.min_slots)
            if small is None:
                continue
            trial.release(j.idx)
            trial.take(small, j.num)
            plan.append((j, small))
        return False

    def _shrunk_fit(
        self, trial: SlotState, j: JobRecord, size: int, head: JobRecord
    ) -> tuple[IntArray, IntArray] | None:
        small = self._own_fit(j, size)
        if small is None:
            return None
        t2 = self._copy(trial)
        t2.release(j.idx)
        t2.take(small, j.num)
        idx = self._fit(t2, head)
        return None if idx is None else (small, idx)

    def _grow_elastic(self, out: list[Decision]) -> None:
        if not self.config.elastic_grow or self._state.n_free == 0:
            return
        self.work.running += len(self._flex)
        grow = sorted(
            (j for j in self._flex.values()
             if j.size < j.req.size and not j.req.goodput_sized),
            key=lambda j: (-j.req.priority, self._fair.key(j.req.team), j.seq),
        )
        wait = self.config.min_resize_interval_s
        for j in grow:
            if self._state.n_free < j.req.layout.replica:
                break
            if wait and self.now - j.start_t < wait:
                continue  # resized (or started) too recently: a flapping worker must not thrash it
            trial = self._copy(self._state)
            trial.release(j.idx)
            idx = self._fit(trial, j)
            if idx is not None and idx.shape[0] > j.size:
                out.append(self._move(j, idx, "grown into idle slots"))
