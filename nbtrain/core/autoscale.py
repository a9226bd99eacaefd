"""Scaling from the queue: how many workers a cluster manager should run, and which may go.

Dask's own ``adapt()`` sizes a cluster from the tasks it sees; nbtrain's rank tasks do not
exist until a gang is admitted, so it sees no demand for a queued job and may retire a free
worker a waiting gang is about to use. This policy sizes the cluster from nbtrain's queue
instead. It is pure: the engine's :class:`nbtrain.engine.adaptive.QueueAdaptive` feeds it what
the controller knows and carries the answer out through the cluster manager.

Guarantees (``tests/test_autoscale.py``):

- **Whole gangs.** Demand is the slots running ranks plus, in queue order, each waiting
  job's smallest gang (its ``min_size``) that fits under ``maximum`` with the ones before it;
  a gang that would not fit whole is not asked for in part.
- **Never a busy or reserved slot.** A slot running a rank is never offered for retirement,
  and neither is a free slot a waiting gang will take (the gang scheduler reserves free
  slots for a blocked head): every free slot up to the needs of the waiting gangs that can
  ever run under ``maximum`` counts as reserved, also while the gang waits for busy slots
  to free rather than for new workers.
- **Leaving slots are replaced early.** A worker that announced it is leaving (walltime,
  SIGTERM) still counts toward the target but gives no capacity, so its replacement is
  asked for while the job checkpoints (within ``maximum``); it is never offered to retire.
- **Idle delay.** A free slot nobody waits for is offered only after it was idle for
  ``idle_s``, oldest idle first; the target never drops below ``minimum``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["AutoscaleDecision", "AutoscaleSettings", "SlotUse", "Waiting", "decide"]


@dataclass(frozen=True, kw_only=True)
class AutoscaleSettings:
    """``minimum``/``maximum``: bounds on the workers asked for (``maximum=None``: no
    bound); ``idle_s``: how long a free slot no waiting gang needs stays before it may be
    retired (longer than the gap between a user's jobs, so a notebook's next cell finds its
    slots warm); ``kind``: the device kind this cluster manager's workers provide ("cpu" or
    "gpu"), whose queue it serves."""

    minimum: int = 0
    maximum: int | None = None
    idle_s: float = 60.0
    kind: str = "cpu"

    def __post_init__(self) -> None:
        problems = []
        if self.minimum < 0:
            problems.append(f"minimum must be >= 0, got {self.minimum}")
        if self.maximum is not None and self.maximum < self.minimum:
            problems.append(f"maximum ({self.maximum}) must be >= minimum ({self.minimum})")
        if not (self.idle_s >= 0 and math.isfinite(self.idle_s)):
            problems.append(f"idle_s must be a finite number >= 0, got {self.idle_s}: set it "
                            "longer than the gap between your jobs (default 60 s)")
        if self.kind not in ("cpu", "gpu"):
            problems.append(f"kind must be 'cpu' or 'gpu', got {self.kind!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class SlotUse:
    """One online worker of the served kind: ``name`` (the cluster manager's name for it),
    ``busy`` (a rank runs there), ``idle_since`` (when it last became free; monotonic)."""

    name: str
    busy: bool
    idle_since: float = 0.0
    leaving: bool = False  # announced it is leaving: no capacity, still running


@dataclass(frozen=True)
class Waiting:
    """A queued job: its id and the slots its smallest gang needs."""

    job_id: str
    need: int


@dataclass(frozen=True)
class AutoscaleDecision:
    """``target``: the workers to run; ``retire``: names of slots that may be retired to get
    there (idle longest first, never busy or reserved); ``asked``: the waiting jobs whose
    whole gangs the target covers; ``reasons``: one line per thing worth saying."""

    target: int
    retire: tuple[str, ...] = ()
    asked: tuple[str, ...] = ()
    reserved: int = 0
    reasons: tuple[str, ...] = field(default=())


def decide(slots: list[SlotUse], waiting: list[Waiting], settings: AutoscaleSettings,
           now: float) -> AutoscaleDecision:
    """The workers to run for ``slots`` (online, of the served kind) and the ``waiting``
    jobs (queued, of that kind, in queue order) at ``now``; see the module docstring."""
    cap = math.inf if settings.maximum is None else settings.maximum
    n_leaving = sum(1 for s in slots if s.leaving)
    slots = [s for s in slots if not s.leaving]
    busy = sum(1 for s in slots if s.busy)
    demand = busy
    asked: list[str] = []
    reasons: list[str] = []
    for w in waiting:
        if demand + w.need <= cap:
            demand += w.need
            asked.append(w.job_id)
        else:
            reasons.append(f"job {w.job_id} needs {w.need} slots at once; with {demand} "
                           f"asked for, maximum={settings.maximum} leaves room for "
                           f"{max(0, int(cap - demand))}: it waits for slots to free (raise "
                           "maximum to run it sooner)")
    free = sorted((s for s in slots if not s.busy), key=lambda s: (s.idle_since, s.name))
    runnable = sum(w.need for w in waiting if w.need <= cap)
    reserved = min(len(free), runnable)
    spare = free[: len(free) - reserved]  # free slots no waiting gang needs
    young = [s for s in spare if now - s.idle_since < settings.idle_s]
    old = [s for s in spare if now - s.idle_since >= settings.idle_s]
    keep = busy + reserved + len(young)
    target = max(demand, keep, settings.minimum)
    target = int(min(target, max(cap, busy + reserved)))  # never below what is used
    n_retire = max(0, len(slots) - target)
    retire = tuple(s.name for s in old[:n_retire])
    target = int(min(target + n_leaving, max(cap, target)))
    return AutoscaleDecision(target=target, retire=retire, asked=tuple(asked),
                             reserved=reserved, reasons=tuple(reasons))
