"""What the controller's handlers and pages may use of it (:class:`ControllerPort`).

The handlers (:mod:`nbtrain.engine.handlers`), the pages (:mod:`nbtrain.engine.pages`) and
the read rules (:mod:`nbtrain.engine.access`, :mod:`nbtrain.engine.tickets`) are written
against this protocol, not against ``ClusterController``: they never reach into the job
machine, the rank seals or the inbox, and never import the controller. What they need of the
machine, the controller answers (``generation_of``, ``queue``, ``slots``, ...).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nbtrain.config import Settings
    from nbtrain.core.lifecycle_types import Command, Event
    from nbtrain.engine.assets import JobAssets
    from nbtrain.engine.joblog import JobLog, Tail
    from nbtrain.engine.store import ControllerStore, StoredJob
    from nbtrain.engine.tickets import ViewTicket

__all__ = ["ControllerPort", "RankPort"]


class RankPort(Protocol):
    """The controller as a job's ranks' calls (:mod:`nbtrain.engine.rank_handlers`) see it."""

    #: What the controller holds per job besides the machine's record, by job id.
    assets: dict[str, JobAssets]

    def generation_of(self, job_id: str) -> int | None: ...
    def rank_secret(self, job_id: str, generation: int) -> str: ...
    def control_state(self, job_id: str) -> Mapping[str, Any]: ...
    @property
    def control_news(self) -> asyncio.Event: ...
    @property
    def rendezvous_news(self) -> asyncio.Event: ...
    def wake_rendezvous(self) -> None: ...


class ControllerPort(RankPort, Protocol):
    """The controller as its handlers (for clients) and pages see it: the rank calls'
    members and these."""

    settings: Settings
    operator_hash: str
    view_tickets: dict[str, ViewTicket]
    store: ControllerStore
    cluster_log: Tail
    pages: str  # how the scheduler serves the pages: "dashboard", "attached" or "none"

    # -- jobs
    def job_ids(self) -> list[str]: ...
    def job_status(self, job_id: str) -> dict[str, Any] | None: ...
    def live_jobs(self) -> int: ...
    def archive(self, sj: StoredJob) -> JobAssets: ...
    def job_log(self, job_id: str, ends: Mapping[str, int] | None = None) -> JobLog: ...
    def attach_trackers(self, assets: JobAssets,
                        trackers: Sequence[Mapping[str, Any]]) -> None: ...

    # -- the machine, through the controller
    def now(self) -> tuple[float, float]: ...
    def feed(self, event: Event) -> list[Command]: ...
    def journal_status(self, job_id: str, *, live_only: bool = False) -> None: ...
    async def journaled(self) -> bool: ...
    def queue(self) -> list[str]: ...
    def slots(self) -> list[dict[str, Any]]: ...
    def team_usage(self) -> dict[str, float]: ...
    def team_window(self) -> tuple[float, dict[str, tuple[float, float]]]: ...
    def decision_ms(self) -> dict[str, Any]: ...

    # -- long-polls
    @property
    def news(self) -> asyncio.Event: ...
    @property
    def pending_workers(self) -> int: ...
