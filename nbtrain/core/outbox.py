"""The commands one event of the job machine leads to, and the helpers that write them (pure).

The machine and its rooms (:mod:`nbtrain.core.progress`, ...) write every command here, in
order: job events, cluster events, a job's state (the only place it changes), control flags
for a generation's ranks. The machine hands the list to the engine at the end of the event.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nbtrain.core.job import TRANSITIONS, JobState, TransitionError
from nbtrain.core.jobevents import state_event
from nbtrain.core.jobrecord import LiveJob
from nbtrain.core.lifecycle_types import Command, JobEnded, Publish, SetControl

__all__ = ["Outbox"]


class Outbox:
    """Commands of the event being handled; ``wall`` stamps the events (the event's time)."""

    def __init__(self) -> None:
        self.commands: list[Command] = []
        self.wall = 0.0

    def begin(self, wall: float) -> None:
        """A new event, at wall-clock ``wall``."""
        self.commands = []
        self.wall = wall

    def take(self) -> list[Command]:
        """The commands so far, in order; the box is empty after."""
        out, self.commands = self.commands, []
        return out

    def add(self, command: Command) -> None:
        self.commands.append(command)

    def publish(self, job: LiveJob, event: Mapping[str, Any]) -> None:
        """Append ``event`` to the job's log."""
        event = dict(event)
        event.setdefault("time", self.wall)
        self.commands.append(Publish(job.id, event))

    def publish_cluster(self, event: Mapping[str, Any]) -> None:
        """Append ``event`` (one of ``nbtrain.core.clusterevents``) to the cluster's log."""
        event = dict(event)
        event.setdefault("time", self.wall)
        self.commands.append(Publish(None, event))

    def set_state(self, job: LiveJob, state: JobState, reason: str) -> None:
        """The job's state and why (published when either changes); ``TransitionError`` for
        a move ``nbtrain.core.job.TRANSITIONS`` does not allow."""
        if job.state is state and job.reason == reason:
            return
        if not job.state.can_become(state):
            allowed = sorted(s.value for s in TRANSITIONS[job.state]) or ["none: it ended"]
            raise TransitionError(
                f"job {job.name} cannot go from {job.state.value} to {state.value} ({reason!r}); "
                f"from {job.state.value} it may go to {', '.join(allowed)}")
        job.state = state
        job.reason = reason
        self.publish(job, state_event(self.wall, state.value, reason))
        if state.terminal:  # terminal states have no way out: this happens once
            self.commands.append(JobEnded(job.id, state.value))

    def set_control(self, job: LiveJob, **flags: int) -> None:
        """Control flags for the ranks of the job's current generation (none: nothing)."""
        gen = job.gen
        if gen is None:
            return
        gen.control.update(flags)
        gen.control_version += 1
        self.commands.append(SetControl(job.id, gen.number, dict(gen.control),
                                        tuple(c.to_dict() for c in job.knobs.pending)))
