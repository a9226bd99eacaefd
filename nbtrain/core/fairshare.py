"""Fair share between teams: decayed slot-seconds of use divided by the team's weight (pure).

The team with the least weighted usage goes first among jobs of equal priority. Usage is the
integral of slots held, decayed with a half-life (as Slurm's multifactor priority does), so a
team that used a lot last week is not punished forever. Fair share only orders the queue; it
never preempts, which is what rules out preemption cycles between teams.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

__all__ = ["FairShare"]


class FairShare:
    """Decayed usage per team, advanced lazily at event times."""

    def __init__(self, weight: Callable[[str], float], half_life_s: float) -> None:
        self._weight = weight
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

    def key(self, team: str) -> tuple[float, float, str]:
        """Sort key: least weighted usage first, then fewest weighted slots held, then name."""
        w = self._weight(team)
        return (self.usage.get(team, 0.0) / w, self.held.get(team, 0) / w, team)

    def order(self, teams: Iterable[str]) -> list[str]:
        return sorted(teams, key=self.key)
