"""What a teacher running fair share reads (pure): each team's share of slot-time over a
recent window against the share its weight entitles it to, how long each waiting job has
waited, and how many jobs each student has.

Inputs are plain data (what ``cluster.snapshot()`` carries): per team the slot-seconds used
in the window and its weight (``JobBook.team_window``), and the jobs' statuses as the
caller may see them. The outputs are plain dicts, so a script reads the same facts as the
class page (``snapshot()["teams"]``, ``["waiting"]``, ``["students"]``).

A team's *fair share* is its weight over the weights of the teams that are present (that
used slots in the window or have a job running or waiting): a team with nothing to run is
not owed anything. ``ratio`` is its share over its fair share: 1.0 is exactly fair, below
1.0 the team got less than its weight says (fair share then puts its waiting jobs first
among jobs of equal priority).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["WAITING_STATES", "duration", "jobs_per_student", "team_shares", "waiting_jobs"]

#: States of a job that waits for slots (a job its owner preempted is held, not waiting).
WAITING_STATES = frozenset({"QUEUED"})
_RUNNING_STATES = frozenset({"LAUNCHING", "STARTING", "RUNNING", "STOPPING"})
_ENDED_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "UNKNOWN"})


def team_shares(window: Mapping[str, tuple[float, float]],
                jobs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per team, in name order: ``team``, ``weight``, ``slot_s`` (slot-seconds in the
    window), ``share`` (of all slot-seconds in the window; 0.0 when nobody used any),
    ``fair_share`` (weight / weights of the present teams), ``ratio`` (share / fair share,
    ``None`` for a team not present), ``running`` and ``waiting`` (its jobs now).

    ``window``: team -> (slot-seconds in the window, weight)."""
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    weights = {team: float(w) for team, (_used, w) in window.items()}
    used = {team: max(0.0, float(u)) for team, (u, _w) in window.items()}
    for job in jobs:
        team = str(job.get("team") or "default")
        state = str(job.get("state") or "")
        weights.setdefault(team, 1.0)
        used.setdefault(team, 0.0)
        if state in _RUNNING_STATES:
            running[team] = running.get(team, 0) + 1
        elif state in WAITING_STATES:
            waiting[team] = waiting.get(team, 0) + 1
    present = {t for t in weights if used[t] > 0 or running.get(t) or waiting.get(t)}
    total_used = sum(used.values())
    total_weight = sum(weights[t] for t in present)
    out = []
    for team in sorted(weights):
        share = used[team] / total_used if total_used > 0 else 0.0
        fair = weights[team] / total_weight if team in present and total_weight > 0 else 0.0
        out.append({"team": team, "weight": weights[team], "slot_s": used[team],
                    "share": share, "fair_share": fair,
                    "ratio": share / fair if fair > 0 else None,
                    "running": running.get(team, 0), "waiting": waiting.get(team, 0)})
    return out


def waiting_jobs(jobs: Iterable[Mapping[str, Any]],
                 queue: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The jobs waiting for slots, longest wait first: ``job_id``, ``name``, ``owner``,
    ``team``, ``priority``, ``ranks``, ``waiting_s`` (this wait so far), ``position`` (in
    the scheduler's queue, 1 = next; ``None`` when not in it) and ``reason``."""
    order = {job_id: i + 1 for i, job_id in enumerate(queue)}
    out = []
    for job in jobs:
        if str(job.get("state") or "") not in WAITING_STATES:
            continue
        job_id = str(job.get("job_id") or "")
        out.append({"job_id": job_id, "name": str(job.get("name") or job_id),
                    "owner": str(job.get("owner") or ""),
                    "team": str(job.get("team") or "default"),
                    "priority": int(job.get("priority") or 0),
                    "ranks": int(job.get("world_size") or 0),
                    "waiting_s": max(0.0, float(job.get("waiting_s") or 0.0)),
                    "position": order.get(job_id), "reason": str(job.get("reason") or "")})
    last = len(order) + 1

    def key(j: dict[str, Any]) -> tuple[float, int, str]:
        return (-j["waiting_s"], j["position"] or last, j["name"])

    out.sort(key=key)
    return out


def jobs_per_student(jobs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per owner (a student), most jobs first: ``owner``, ``teams`` (sorted), ``jobs``,
    ``running``, ``waiting``, ``ended`` and ``failed``."""
    by: dict[str, dict[str, Any]] = {}
    for job in jobs:
        owner = str(job.get("owner") or "?")
        state = str(job.get("state") or "")
        row = by.setdefault(owner, {"owner": owner, "teams": set(), "jobs": 0, "running": 0,
                                    "waiting": 0, "ended": 0, "failed": 0})
        row["teams"].add(str(job.get("team") or "default"))
        row["jobs"] += 1
        row["running"] += state in _RUNNING_STATES
        row["waiting"] += state in WAITING_STATES
        row["ended"] += state in _ENDED_STATES
        row["failed"] += state == "FAILED"
    out = [{**row, "teams": sorted(row["teams"])} for row in by.values()]
    out.sort(key=lambda r: (-r["jobs"], r["owner"]))
    return out


def duration(seconds: float) -> str:
    """``45 s``, ``3 min 05 s``, ``2 h 07 min``: how long someone has waited."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
