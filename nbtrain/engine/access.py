"""Who may read what of a job: the controller's read rules, in one place.

A caller is a job's **owner** (it shows the job's token), the **operator** (the cluster's
operator token) or **another** client. The owner and the operator read everything of the job.
Another client reads, by the cluster's ``visibility`` setting:

- ``"all"``: the job's metrics (step rows), events and full status;
- ``"owner"``: only what scheduling needs (``PUBLIC_FIELDS``: name, owner, team, priority,
  state, sizes, slots, times; the reason while it is queued).

Never, whatever the setting: its result, its ranks' output (logs) and where its checkpoints
are. Refusals name the job, its owner and what to do.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nbtrain.engine.assets import token_matches

if TYPE_CHECKING:
    from nbtrain.engine.port import ControllerPort

__all__ = ["PUBLIC_FIELDS", "Role", "may_read_metrics", "public_event", "refusal", "role_of",
           "shown_status"]

#: A job's status fields every client of the cluster sees (what the queue and the class view
#: need to explain who holds what and who waits).
PUBLIC_FIELDS = frozenset({
    "job_id", "name", "owner", "team", "priority", "world_size", "steps", "state",
    "generation", "slots", "submitted", "started", "ended", "size", "min_size", "max_size",
    "target_size", "waiting_s"})


class Role(enum.Enum):
    OWNER = "owner"
    OPERATOR = "operator"
    OTHER = "other"


def role_of(ctl: ControllerPort, job_id: str, *tokens: object) -> Role:
    """What the caller showing ``tokens`` (its job token, its operator token) is to
    ``job_id`` (a job the controller holds): the best role any of them gives."""
    if any(token_matches(t, ctl.assets[job_id].token_hash) for t in tokens):
        return Role.OWNER
    if any(token_matches(t, ctl.operator_hash) for t in tokens):
        return Role.OPERATOR
    return Role.OTHER


def may_read_metrics(ctl: ControllerPort, role: Role) -> bool:
    return role is not Role.OTHER or ctl.settings.visibility == "all"


def shown_status(ctl: ControllerPort, status: Mapping[str, Any], role: Role
                 ) -> dict[str, Any]:
    """``status`` as the caller may see it (``hidden``: why fields are missing)."""
    if may_read_metrics(ctl, role):
        return dict(status)
    out = {k: v for k, v in status.items() if k in PUBLIC_FIELDS}
    out["reason"] = str(status.get("reason", "")) if status.get("state") == "QUEUED" else ""
    out["hidden"] = (f"this cluster shows the metrics, events and details of job "
                     f"{status.get('name')} only to its owner ({status.get('owner') or '?'}) "
                     "and the operator (visibility='owner')")
    return out


#: Event fields that say where a job's checkpoints are (the owner's and the operator's).
PRIVATE_EVENT_FIELDS = frozenset({"url"})


def public_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """An event as another client may see it."""
    return {k: v for k, v in event.items() if k not in PRIVATE_EVENT_FIELDS}


def refusal(status: Mapping[str, Any], what: str) -> PermissionError:
    """Why another client may not read ``what`` of a job, and what to do."""
    return PermissionError(
        f"job {status.get('name')} ({status.get('job_id')}) belongs to "
        f"{status.get('owner') or 'another client'}: its {what} can be read only by the "
        "handle that submitted it, a client holding its token (cluster.job(name, "
        "token=...)), or the cluster's operator")
