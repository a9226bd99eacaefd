"""View tickets and the pages' paths: what ``handlers.view`` hands out and the pages
(:mod:`nbtrain.engine.pages`) check. A ticket is the right to steer one job from its page; the
controller grants it to the job's owner or the operator, it goes in the page's URL and is
valid for that one job for ``view_ticket_s``, and is dropped when the job is forgotten.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from nbtrain.engine.assets import token_hash

if TYPE_CHECKING:
    from nbtrain.engine.port import ControllerPort

__all__ = ["PAGE_CLUSTER", "PAGE_JOB", "ViewTicket", "check_ticket", "issue_ticket",
           "page_path"]

PAGE_JOB = "/individual-nbtrain-job"
PAGE_CLUSTER = "/individual-nbtrain-cluster"


@dataclass(frozen=True)
class ViewTicket:
    """The right to steer one job from its page, until ``expires`` (monotonic)."""

    job_id: str
    expires: float


def issue_ticket(ctl: ControllerPort, job_id: str) -> str:
    """A new ticket for ``job_id`` (the caller checked ownership)."""
    now = time.monotonic()
    for key in [k for k, t in ctl.view_tickets.items() if t.expires < now
                or t.job_id not in ctl.assets]:
        del ctl.view_tickets[key]
    ticket = secrets.token_urlsafe(18)
    # Kept by hash, like tokens: a lookup compares hashes, so it tells nothing of the ticket.
    ctl.view_tickets[token_hash(ticket)] = ViewTicket(job_id, now + ctl.settings.view_ticket_s)
    return ticket


def check_ticket(ctl: ControllerPort, job_id: str, ticket: str) -> bool:
    if not isinstance(ticket, str) or not ticket:
        return False
    held = ctl.view_tickets.get(token_hash(ticket))
    return (held is not None and held.job_id == job_id and held.expires > time.monotonic()
            and job_id in ctl.assets)


def page_path(path: str, **query: str) -> str:
    """``path`` relative to the dashboard's root, with its query."""
    query = {k: v for k, v in query.items() if v}
    return path.lstrip("/") + (f"?{urlencode(query)}" if query else "")
