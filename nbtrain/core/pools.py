"""One gang scheduler per device kind: GPU jobs only on GPU slots, CPU jobs only on CPU slots
(pure).

A cluster may mix GPU workers with CPU-only ones (a GPU box plus CPU workers, or hosts of both
kinds). A GPU job must never be placed on a CPU slot, and a CPU job on a GPU slot would hold a
GPU it does not use. The two kinds share nothing a gang scheduler decides over: no job can use
both, so preemption, reservation and backfill across kinds would only make wrong promises. So
each kind gets its own :class:`~nbtrain.core.scheduler.Scheduler` over the topology of its own
slots, and :class:`DevicePools` routes events to them behind the same interface (``handle``,
``queued``, ``n_free``...). A cluster of one kind has one pool and decides exactly what one
scheduler decides.

A pool is made when the first slot of its kind joins. Jobs of a kind that has no slot yet
wait here, in submit order, and enter the pool when it is made.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import replace

from nbtrain.core.goodputmodel import GoodputModel
from nbtrain.core.sched_types import (
    Cancelled,
    Checkpointed,
    Decision,
    Event,
    Failed,
    Finished,
    Released,
    ResizeRequested,
    Resume,
    SchedulerConfig,
    StepTimes,
    Submit,
    Suspend,
    Tick,
    WorkersAdded,
    WorkersForgotten,
    WorkersRemoved,
)
from nbtrain.core.scheduler import Scheduler
from nbtrain.core.topology import Topology

__all__ = ["CPU", "GPU", "KINDS", "DevicePools"]

GPU = "gpu"
CPU = "cpu"
KINDS = (GPU, CPU)
#: Events about one job (what is left of ``Event`` without the slots, the time and submits).
_JobEvent = (Finished | Failed | Released | Checkpointed | Cancelled | Suspend | Resume
             | ResizeRequested | StepTimes)


class DevicePools:
    """Gang schedulers by device kind. ``slot_kind(slot)`` and ``job_kind(job_id)`` say which
    kind a slot is and which kind a job needs (asked once, when the job is submitted)."""

    def __init__(self, config: SchedulerConfig, *, slot_kind: Callable[[Hashable], str],
                 job_kind: Callable[[str], str]) -> None:
        self.config = config
        self.slot_kind = slot_kind
        self.job_kind = job_kind
        self.pools: dict[str, Scheduler] = {}
        self._kind: dict[str, str] = {}  # job id -> kind
        self._waiting: dict[str, list[Submit]] = {}  # kind without a pool -> its submits
        self._parked: dict[str, Submit] = {}  # suspended while waiting for a pool

    # ------------------------------------------------------------------ events
    def handle(self, event: Event) -> list[Decision]:
        """Apply one event to the pool(s) it concerns; their decisions, in order."""
        if isinstance(event, WorkersAdded):
            return self._workers_added(event)
        if isinstance(event, WorkersRemoved | WorkersForgotten):
            out: list[Decision] = []
            for kind, pool in self.pools.items():
                mine = tuple(s for s in event.slots if self.slot_kind(s) == kind)
                if mine:
                    out += pool.handle(replace(event, slots=mine))
            return out
        if isinstance(event, Tick):
            return [d for pool in self.pools.values() for d in pool.handle(event)]
        if isinstance(event, Submit):
            kind = self._kind.setdefault(event.job.job_id, self.job_kind(event.job.job_id))
            if kind not in self.pools:
                self._waiting.setdefault(kind, []).append(event)
                return []
            return self.pools[kind].handle(event)
        kind = self._kind.get(event.job_id, "")
        held = next((s for s in self._waiting.get(kind, []) if s.job.job_id == event.job_id),
                    None)
        if held is not None or event.job_id in self._parked:
            return self._not_in_a_pool(event, kind, held)
        if kind in self.pools:
            return self.pools[kind].handle(event)
        return []

    def _not_in_a_pool(self, event: _JobEvent, kind: str,
                       held: Submit | None) -> list[Decision]:
        """An event of a job not in a pool yet: it waits for its kind's first slot (``held``:
        its submit), or was parked by the user meanwhile."""
        if isinstance(event, Finished | Cancelled | Suspend) and held is not None:
            self._waiting[kind].remove(held)
            if isinstance(event, Suspend):
                self._parked[event.job_id] = held
        elif isinstance(event, Finished | Cancelled):
            self._parked.pop(event.job_id, None)
        elif isinstance(event, Resume) and event.job_id in self._parked:
            submit = self._parked.pop(event.job_id)
            if kind in self.pools:
                return self.pools[kind].handle(replace(submit, now=event.now))
            self._waiting.setdefault(kind, []).append(submit)
        return []

    def _workers_added(self, ev: WorkersAdded) -> list[Decision]:
        by_kind: dict[str, dict[str, tuple[Hashable, ...]]] = {}
        for host, slots in ev.hosts.items():
            for slot in slots:
                per_host = by_kind.setdefault(self.slot_kind(slot), {})
                per_host[host] = (*per_host.get(host, ()), slot)
        out: list[Decision] = []
        for kind, hosts in by_kind.items():
            mine = {s for ss in hosts.values() for s in ss}
            nvlink = {s: lab for s, lab in ev.nvlink_of.items() if s in mine}
            leaf = {h: lab for h, lab in ev.leaf_of.items() if h in hosts}
            pool = self.pools.get(kind)
            if pool is not None:
                out += pool.handle(WorkersAdded(ev.now, hosts, nvlink_of=nvlink, leaf_of=leaf))
                continue
            pool = Scheduler(Topology.from_hosts(hosts, nvlink_of=nvlink, leaf_of=leaf),
                             self.config)
            self.pools[kind] = pool
            for submit in self._waiting.pop(kind, []):
                out += pool.handle(submit)
        return out

    def forget(self, job_id: str) -> None:
        """Drop an ended job's record (see ``JobBook.forget``)."""
        kind = self._kind.get(job_id, "")
        pool = self.pools.get(kind)
        if pool is not None:
            pool.forget(job_id)
            if job_id not in pool.job_ids():
                self._kind.pop(job_id, None)

    # ------------------------------------------------------------------ views
    def kind_of(self, job_id: str) -> str:
        """The device kind a job was submitted for ("" for an unknown job)."""
        return self._kind.get(job_id, "")

    def goodput_model(self, job_id: str) -> GoodputModel | None:
        """The goodput model of a goodput-sized job (``None`` for other jobs, or unknown)."""
        pool = self.pools.get(self.kind_of(job_id))
        return None if pool is None else pool.goodput_model(job_id)

    def goodput_left_s(self, job_id: str) -> float | None:
        """Seconds of a goodput-sized job's run left at its size (``None``: not known)."""
        pool = self.pools.get(self.kind_of(job_id))
        return None if pool is None else pool.goodput_left_s(job_id)

    def kinds(self) -> list[str]:
        """Kinds that have slots, in ``KINDS`` order."""
        return [k for k in KINDS if k in self.pools] + sorted(set(self.pools) - set(KINDS))

    def queued(self) -> list[str]:
        """Queued job ids: each pool's queue in its order (GPU first), then jobs whose kind
        has no slot yet, in submit order."""
        out = [j for kind in self.kinds() for j in self.pools[kind].queued()]
        return out + [s.job.job_id for kind in sorted(self._waiting)
                      for s in self._waiting[kind]]

    def free_of(self, kind: str) -> int:
        pool = self.pools.get(kind)
        return 0 if pool is None else pool.n_free

    def online_of(self, kind: str) -> int:
        pool = self.pools.get(kind)
        return 0 if pool is None else pool.n_online

    @property
    def n_free(self) -> int:
        return sum(p.n_free for p in self.pools.values())

    @property
    def n_online(self) -> int:
        return sum(p.n_online for p in self.pools.values())

    def has_slot(self, slot: Hashable) -> bool:
        """Whether any pool's topology has ``slot`` (online or not)."""
        return any(p.has_slot(slot) for p in self.pools.values())

    def free_slot_ids(self, kind: str | None = None) -> list[Hashable]:
        """Free slots (of ``kind`` only, when given)."""
        return [s for k, p in self.pools.items() if kind is None or k == kind
                for s in p.free_slot_ids()]

    def owner_map(self) -> dict[Hashable, str | None]:
        """Slot id -> the job holding it (None: free or offline), over every pool."""
        return {s: o for p in self.pools.values()
                for s, o in zip(p.topo.slot_ids, p.owners(), strict=True)}

    def check_invariants(self) -> None:
        """Every pool's (``JobBook.check_invariants``); ``AssertionError`` if one breaks."""
        for pool in self.pools.values():
            pool.check_invariants()

    def team_window(self, now: float) -> dict[str, tuple[float, float]]:
        """Every pool's (``JobBook.team_window``), slot-seconds summed over the pools."""
        out: dict[str, tuple[float, float]] = {}
        for pool in self.pools.values():
            for team, (used, weight) in pool.team_window(now).items():
                out[team] = (out.get(team, (0.0, weight))[0] + used, weight)
        return out

    def team_usage(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pool in self.pools.values():
            for team, used in pool.team_usage().items():
                out[team] = out.get(team, 0.0) + used
        return out

    def job_ids(self, state: str | None = None) -> list[str]:
        return [j for p in self.pools.values() for j in p.job_ids(state)]
