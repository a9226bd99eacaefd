"""Fair share between teams: decayed slot-seconds of use divided by the team's weight (pure).

The team with the least weighted usage goes first among jobs of equal priority. Usage is the
integral of slots held, decayed with a half-life (as Slurm's multifactor priority does), so a
team that used a lot last week is not punished forever. Fair share only orders the queue; it
never preempts, which is what rules out preemption cycles between teams.

For people (the class view) it also keeps, per team, when the slots it holds changed over the
last ``window_s``, so the slot-seconds each team used in a recent window can be read back
(:meth:`FairShare.window_usage`) and compared with its weight (``core/teamshare.py``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable

__all__ = ["FairShare"]


class FairShare:
    """Decayed usage per team, advanced lazily at event times."""

    def __init__(self, weight: Callable[[str], float], half_life_s: float,
                 window_s: float = 600.0) -> None:
        self._weight = weight
        self.window_s = window_s
        #: Per team: (time, slots held from then on), oldest first; one point at or before
        #: the window's start is kept, so what was held when it began is known.
        self._changes: dict[str, deque[tuple[float, int]]] = {}
        self._rate = math.log(2.0) / half_life_s
        self._t: float | None = None
        self.usage: dict[str, float] = {}
        self.held: dict[str, int] = {}
        self.total: dict[str, float] = {}  # undecayed slot-seconds, for reports

    def advance(self, now: float) -> None:
        """Integrate the slots each team held since the last call."""
        if self._t is None or now <= self._t:
            self._t = now if self._t is None else max(self._t, now)
            return
        dt = now - self._t
        decay = math.exp(-self._rate * dt)
        gain = (1.0 - decay) / self._rate  # integral of a constant 1 under decay over dt
        for team, u in self.usage.items():
            held = self.held.get(team, 0)
            self.usage[team] = u * decay + held * gain
            self.total[team] = self.total.get(team, 0.0) + held * dt
        self._t = now

    def hold(self, team: str, slots: int) -> None:
        """``slots`` more (or fewer, when negative) slots held by ``team`` from now on."""
        self.usage.setdefault(team, 0.0)
        self.held[team] = self.held.get(team, 0) + slots
        if self.held[team] < 0:
            raise RuntimeError(f"team {team!r} would hold {self.held[team]} slots: bookkeeping bug")
        at = -math.inf if self._t is None else self._t
        points = self._changes.setdefault(team, deque())
        if points and points[-1][0] == at:
            points.pop()  # several changes at one time: the last one holds from then on
        points.append((at, self.held[team]))
        while len(points) > 1 and points[1][0] <= at - self.window_s:
            points.popleft()

    def window_usage(self, now: float) -> dict[str, float]:
        """Slot-seconds each team held over the last ``window_s`` before ``now`` (slots held
        are constant between the changes this saw, so the integral is exact). Teams that
        held nothing in the window are included with 0.0 if they ever held slots."""
        start = now - self.window_s
        out: dict[str, float] = {}
        for team, points in self._changes.items():
            used = 0.0
            for i, (t, held) in enumerate(points):
                end = points[i + 1][0] if i + 1 < len(points) else now
                lo, hi = max(t, start), min(end, now)
                if hi > lo:
                    used += held * (hi - lo)
            out[team] = used
        return out

    def key(self, team: str) -> tuple[float, float, str]:
        """Sort key: least weighted usage first, then fewest weighted slots held, then name."""
        w = self._weight(team)
        return (self.usage.get(team, 0.0) / w, self.held.get(team, 0) / w, team)

    def order(self, teams: Iterable[str]) -> list[str]:
        return sorted(teams, key=self.key)
