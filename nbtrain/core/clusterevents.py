"""The one schema of the cluster's log: what the controller says about the cluster (pure).

The job machine and its shell write these entries to the cluster's log (``cluster.snapshot()
["log"]``, the class page); a job's own events are :mod:`nbtrain.core.jobevents`. Entries
travel as plain dicts, typed here as ``TypedDict``s and built only through the constructors
below; every entry has ``kind`` and ``time`` (wall-clock seconds; the machine's outbox stamps
the ones it writes). Readers parse an entry once (:func:`parse_cluster_event`) and read its
attributes.

Kinds: ``worker`` (``what``: joined, left, refused, forgotten), ``slot_lost``,
``scheduler`` (a decision about a job that is not a rejection of its user's request),
``resize`` and ``preemption`` (a job's, in one line), ``restored`` (jobs read back from the
journal), ``shutdown`` (a live job when the controller closed), ``restart`` and ``abort``
(workers restarted, NCCL collectives aborted, with each worker's result), ``refused`` (rank
events without a valid seal), ``controller_error`` (an event the machine failed on).
"""

from __future__ import annotations

import time as _time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

__all__ = [
    "CLUSTER_KINDS",
    "ClusterEvent",
    "abort_event",
    "controller_error_event",
    "job_line_event",
    "parse_cluster_event",
    "refused_event",
    "restart_event",
    "restored_event",
    "shutdown_event",
    "slot_lost_event",
    "worker_joined_event",
    "worker_left_event",
    "worker_refused_event",
    "worker_slot_event",
]

CLUSTER_KINDS = ("worker", "slot_lost", "scheduler", "resize", "preemption", "restored",
                 "shutdown", "restart", "abort", "refused", "controller_error")


class WorkerEvent(TypedDict, total=False):
    kind: Literal["worker"]
    what: str  # "joined" | "left" | "refused" | "forgotten"
    slot: str
    address: str
    host: str
    reason: str
    restarting: bool
    time: float


def worker_joined_event(*, slot: str, address: str, host: str) -> WorkerEvent:
    return {"kind": "worker", "what": "joined", "slot": slot, "address": address, "host": host}


def worker_left_event(*, slot: str, address: str, host: str, restarting: bool) -> WorkerEvent:
    return {"kind": "worker", "what": "left", "slot": slot, "address": address, "host": host,
            "restarting": restarting}


def worker_refused_event(*, address: str, reason: str, host: str | None = None,
                         time: float | None = None) -> WorkerEvent:
    """A worker kept out: two workers on one GPU, labels that make no topology (the machine),
    or one that cannot run nbtrain's ranks (the shell, which stamps its ``time``)."""
    out: WorkerEvent = {"kind": "worker", "what": "refused", "address": address}
    if host is not None:
        out["host"] = host
    if time is not None:
        out["time"] = time
    out["reason"] = reason
    return out


def worker_slot_event(what: str, *, slot: str, host: str, reason: str) -> WorkerEvent:
    """A slot's worker is gone for good (``what``: "forgotten")."""
    return {"kind": "worker", "what": what, "slot": slot, "host": host, "reason": reason}


def slot_lost_event(*, slot: str, host: str, reason: str) -> dict[str, Any]:
    return {"kind": "slot_lost", "slot": slot, "host": host, "reason": reason}


def job_line_event(kind: Literal["scheduler", "resize", "preemption"], job: str, reason: str
                   ) -> dict[str, Any]:
    """One line about a job in the cluster's log."""
    return {"kind": kind, "job": job, "reason": reason}


def restored_event(*, jobs: int, live: int, epoch: int, state_dir: str, seconds: float
                   ) -> dict[str, Any]:
    return {"kind": "restored", "jobs": jobs, "live": live, "epoch": epoch,
            "state_dir": state_dir, "seconds": seconds, "time": _time.time()}


def shutdown_event(job: str) -> dict[str, Any]:
    return {"kind": "shutdown", "job": job, "time": _time.time()}


def _results(results: object) -> dict[str, str]:
    return {str(k): str(v) for k, v in dict(results or {}).items()}  # type: ignore[call-overload]


def restart_event(*, addresses: tuple[str, ...] | list[str], reason: str, results: object
                  ) -> dict[str, Any]:
    return {"kind": "restart", "addresses": list(addresses), "reason": reason,
            "results": _results(results), "time": _time.time()}


def abort_event(*, job: str, generation: int, addresses: tuple[str, ...] | list[str],
                reason: str, results: object) -> dict[str, Any]:
    return {"kind": "abort", "job": job, "generation": generation,
            "addresses": list(addresses), "reason": reason, "results": _results(results),
            "time": _time.time()}


def refused_event(*, job: str, count: int, reason: str) -> dict[str, Any]:
    return {"kind": "refused", "job": job, "time": _time.time(), "count": count,
            "reason": reason}


def controller_error_event(*, job: str | None, event: str, error: str) -> dict[str, Any]:
    return {"kind": "controller_error", "job": job, "event": event, "error": error,
            "time": _time.time()}


@dataclass(frozen=True)
class ClusterEvent:
    """One entry of the cluster's log as a reader sees it: parsed once, read by attribute."""

    kind: str
    time: float | None  # wall-clock seconds; None when the entry has none (or a bad one)
    job: str | None
    what: str  # a worker entry's what ("" for other kinds)
    reason: str
    #: The other fields, in their order: what a reader shows for an entry without a reason.
    details: tuple[tuple[str, Any], ...]

    @property
    def text(self) -> str:
        """One line for people: the reason, or the entry's fields."""
        return self.reason or ", ".join(f"{k}={v}" for k, v in self.details)


def parse_cluster_event(entry: Mapping[str, Any]) -> ClusterEvent:
    """An entry of the cluster's log (any dict: unknown kinds and bad values are kept as
    they can be read, never raised on)."""
    raw_time = entry.get("time")
    when: float | None
    try:
        when = float(raw_time) if raw_time else None
    except (TypeError, ValueError):
        when = None
    job = entry.get("job")
    reason = entry.get("reason") or entry.get("note") or ""
    return ClusterEvent(
        kind=str(entry.get("kind", "")), time=when, job=None if job is None else str(job),
        what=str(entry.get("what") or ""), reason=str(reason),
        details=tuple((str(k), v) for k, v in entry.items() if k not in ("time", "kind")))
