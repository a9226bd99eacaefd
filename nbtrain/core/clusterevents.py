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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

__all__ = [
    "CLUSTER_KINDS",
    "ClusterEvent",
    "abort_event",
    "cluster_log_lines",
    "controller_error_event",
    "job_line_event",
    "parse_cluster_event",
    "refused_event",
    "restart_event",
    "restored_event",
    "sentence",
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


def job_line_event(kind: Literal["scheduler", "resize", "preemption"], job: str, reason: str,
                   *, name: str | None = None, by: str | None = None,
                   by_name: str | None = None, priority: int | None = None,
                   by_priority: int | None = None) -> dict[str, Any]:
    """One line about a job in the cluster's log. A preemption for another job also names
    that job (``by``, ``by_name``) and both priorities, so the line can say who took the
    slots and why ("bob-big preempted alice-mlp: priority 5 > 0")."""
    out: dict[str, Any] = {"kind": kind, "job": job, "reason": reason}
    for key, value in (("name", name), ("by", by), ("by_name", by_name),
                       ("priority", priority), ("by_priority", by_priority)):
        if value is not None:
            out[key] = value
    return out


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


def _get(event: ClusterEvent, key: str, default: Any = "") -> Any:
    for k, v in event.details:
        if k == key:
            return v
    return default


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def sentence(event: ClusterEvent, names: Mapping[str, str] | None = None) -> str:
    """The entry as a sentence for people ("worker 127.0.0.1#3 joined", "bob-big preempted
    alice-mlp: priority 5 > 0"). ``names``: job id -> job name, for entries that name a job
    only by its id; an unknown kind reads as its fields."""
    names = names or {}

    def name(job_id: Any, given: Any = None) -> str:
        return str(given or names.get(str(job_id), "") or job_id or "a job")

    job = name(event.job, _get(event, "name", None))
    kind, reason = event.kind, event.reason
    if kind == "worker":
        return _worker_sentence(event)
    if kind == "slot_lost":
        return f"slot {_get(event, 'slot') or '?'} lost: {reason}"
    if kind == "preemption" and _get(event, "by", None):
        by = name(_get(event, "by"), _get(event, "by_name", None))
        mine, theirs = _get(event, "priority", None), _get(event, "by_priority", None)
        higher = mine is not None and theirs is not None and int(theirs) > int(mine)
        why = f"priority {theirs} > {mine}" if higher else reason
        return f"{by} preempted {job}: {why}"
    if kind in ("preemption", "resize"):
        return reason or f"{job} {kind}"
    if kind == "scheduler":
        return f"{job}: {reason}"
    return _controller_sentence(event, job)


def _worker_sentence(event: ClusterEvent) -> str:
    """A worker's entry: joined, left, refused, forgotten."""
    slot = _get(event, "slot") or _get(event, "address") or "?"
    what, reason = event.what, event.reason
    if what == "joined":
        return f"worker {slot} joined"
    if what == "left":
        return f"worker {slot} left" + (
            " (nbtrain restarts it)" if _get(event, "restarting", False) else "")
    if what == "refused":
        return f"worker {_get(event, 'address') or slot} refused: {reason}"
    if what == "forgotten":
        return f"slot {slot} forgotten: {reason}"
    return f"worker {slot} {what}" + (f": {reason}" if reason else "")


def _controller_sentence(event: ClusterEvent, job: str) -> str:
    """What the controller itself did or saw (``job``: the entry's job, by name)."""
    kind, reason = event.kind, event.reason
    if kind == "restored":
        return (f"controller restarted: {_plural(int(_get(event, 'jobs', 0)), 'job')} read "
                f"back ({_get(event, 'live', 0)} live) from {_get(event, 'state_dir')} in "
                f"{float(_get(event, 'seconds', 0.0)):.2f} s")
    if kind == "shutdown":
        return f"controller closed while {job} was live"
    addresses = list(_get(event, "addresses", []) or [])
    if kind == "restart":
        return (f"restarted {_plural(len(addresses), 'worker')} "
                f"({', '.join(map(str, addresses))}): {reason}")
    if kind == "abort":
        return (f"aborted the collectives of {job} generation {_get(event, 'generation')} "
                f"on {_plural(len(addresses), 'worker')}: {reason}")
    if kind == "refused":
        return (f"refused {_plural(int(_get(event, 'count', 0)), 'rank event')} of {job}: "
                f"{reason}")
    if kind == "controller_error":
        about = f" for {job}" if event.job else ""
        return f"the controller failed on {_get(event, 'event')}{about}: {_get(event, 'error')}"
    return event.text


def cluster_log_lines(entries: Sequence[Mapping[str, Any]],
                      jobs: Sequence[Mapping[str, Any]], *, team: str | None = None,
                      limit: int | None = None) -> list[dict[str, Any]]:
    """The cluster's log for people, newest first: per entry ``time``, ``kind``, ``text``
    (its :func:`sentence`) and ``teams`` (of the jobs it is about: a preemption is about
    both jobs; a worker's entry about none). ``team``: only entries about that team's jobs.
    ``jobs``: the statuses the caller may see (names and teams by job id)."""
    names = {str(j.get("job_id")): str(j.get("name") or "") for j in jobs}
    teams = {str(j.get("job_id")): str(j.get("team") or "default") for j in jobs}
    out = []
    for entry in reversed(entries):
        event = parse_cluster_event(entry)
        about = [t for t in (teams.get(str(event.job)), teams.get(str(_get(event, "by"))))
                 if t is not None]
        if team is not None and team not in about:
            continue
        out.append({"time": event.time, "kind": event.kind, "text": sentence(event, names),
                    "teams": sorted(set(about))})
        if limit is not None and len(out) >= limit:
            break
    return out
