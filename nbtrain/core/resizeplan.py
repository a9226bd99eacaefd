"""One job's size as the job machine plans it: asked, decided, launched, deferred (pure).

An elastic job changes size between generations: its user asks for a size (``target``), the
gang scheduler decides a placement (``decided``: the running generation ends at its next step
boundary through the preemption path), the next generation launches there (``launched``,
until its first step), and a placement on slots a shrinking job still holds waits until their
ranks have left them (``deferred``). A restart at another size (a recovery or a resume on the
slots that fit) is a resize all the same, for the events and the plots.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbtrain.core.placement import Placement

__all__ = ["PendingResize", "ResizePlan"]


@dataclass
class PendingResize:
    """A resize the scheduler decided: the next generation runs on ``placement``."""

    placement: Placement
    old_size: int
    reason: str
    asked: float  # monotonic, for the resize's duration


@dataclass
class ResizePlan:
    """The size of one job: what its user asked for, what was decided and launched."""

    target: int  # the size asked for (``world_size`` until a resize asks for another)
    last_size: int | None = None  # ranks of the newest generation
    decided: PendingResize | None = None  # decided, waiting for the generation to end
    launched: PendingResize | None = None  # launched, waiting for its first step
    note: str = ""  # why the job runs below ``target`` ("" when it does not)
    #: Placed on slots a shrinking job still holds: launched when its ranks have left them.
    deferred: Placement | None = None
    #: Deferred launches are tried in the order they were deferred.
    deferred_order: int = 0

    def defer(self, placement: Placement, order: int) -> None:
        """Wait for ``placement``'s slots (``order`` places a new deferral after the others;
        one already deferred keeps its place)."""
        if self.deferred is None:
            self.deferred_order = order
        self.deferred = placement

    def launch(self, placement: Placement, now: float, recovering: str) -> bool:
        """A generation launches on ``placement``; True when at another size than the last
        one (a restart at another size is recorded as a resize, if none was decided)."""
        size = placement.world_size
        self.deferred = None
        resized = self.last_size is not None and self.last_size != size
        if self.launched is None and self.last_size is not None and resized:
            fit = f"{size} of {self.target} ranks fit now"
            self.launched = PendingResize(placement=placement, old_size=self.last_size,
                                          reason=f"{recovering}; {fit}" if recovering else fit,
                                          asked=now)
        self.last_size = size
        return resized

    def update_note(self, running: int, unit: str) -> str:
        """Why the job runs below its target (``running``: the ranks it has or is about to
        have; ``unit``: what a slot is called, plural); "" when it does not."""
        planned = self.decided.placement.world_size if self.decided is not None else running
        note = ""
        if planned and self.target > planned:
            more = self.target - planned
            unit, verb = (unit[:-1], "is") if more == 1 else (unit, "are")
            note = (f"growing to {self.target} ranks ({planned} now) when {more} more {unit} "
                    f"{verb} free")
        self.note = note
        return note
