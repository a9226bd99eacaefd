"""What a job's ranks call on the controller: the rendezvous of a generation (rank 0 publishes
its store's address, the others wait for it) and rank 0's long poll of its control flags.

Written against :class:`~nbtrain.engine.port.RankPort`, the few members of the controller a
rank's calls need; only the generation's own ranks (they show its secret) are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from nbtrain.core.rankseal import secret_matches

if TYPE_CHECKING:
    from nbtrain.engine.port import RankPort

__all__ = ["control", "rendezvous"]


async def rendezvous(ctl: RankPort, *, job_id: str, generation: int, rank: int,
                     host: str | None = None, port: int | None = None,
                     timeout: float = 60.0, secret: str = "") -> dict[str, Any]:
    """Rank 0 publishes its store's address; the other ranks wait for it. Only the
    generation's own ranks (they show its secret) take part."""
    assets = ctl.assets.get(job_id)
    if assets is None:
        raise LookupError(f"no job {job_id!r}")
    expected = ctl.rank_secret(job_id, generation)
    if not expected:
        raise LookupError(f"generation {generation} of job {job_id} is not running")
    if not secret_matches(secret, expected):
        raise PermissionError(f"the rendezvous of job {job_id} generation {generation} is for "
                              "that generation's ranks only (the secret they were launched "
                              "with does not match)")
    timeout = min(float(timeout), 3600.0)
    if rank == 0:
        assets.rendezvous[generation] = {"host": host, "port": port}
        ctl.wake_rendezvous()
        return {"host": host, "port": port}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while generation not in assets.rendezvous:
        if generation < _current_generation(ctl, job_id):
            raise LookupError(f"generation {generation} of job {job_id} has ended")
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise LookupError(f"rank 0 of job {job_id} generation {generation} did not publish "
                              f"its rendezvous within {timeout:.0f} s")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctl.rendezvous_news.wait(), remaining)
    return dict(assets.rendezvous[generation])


async def control(ctl: RankPort, *, job_id: str, generation: int, version: int,
                  timeout: float = 1.0, secret: str = "") -> dict[str, Any]:
    """The generation's control flags once they differ from ``version`` (or after
    ``timeout``); ``ended`` when the generation is over. For its own ranks only."""
    expected = ctl.rank_secret(job_id, generation)
    if expected and not secret_matches(secret, expected):
        raise PermissionError(f"the control flags of job {job_id} generation {generation} are "
                              "for that generation's ranks only")
    timeout = min(float(timeout), 60.0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        state = ctl.control_state(job_id)
        if not state or state.get("generation") != generation:
            return {"ended": True, "version": -1, "flags": {}}
        if int(state.get("version", 0)) != version:
            return {"ended": False, "version": state["version"], "flags": state["flags"],
                    "knobs": state.get("knobs", [])}
        remaining = deadline - loop.time()
        if remaining <= 0:
            return {"ended": False, "version": version, "flags": state["flags"],
                    "knobs": state.get("knobs", [])}
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctl.control_news.wait(), remaining)


def _current_generation(ctl: RankPort, job_id: str) -> int:
    generation = ctl.generation_of(job_id)
    return 1 << 30 if generation is None else generation
