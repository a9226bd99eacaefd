"""Where the gang scheduler's decision time goes, by phase of a pass (``nbtrain simulate
--profile``).

The scheduler is pure and reads no clock, so the breakdown comes from outside: the replay runs
under ``cProfile`` and each phase is the cumulative time of the function that implements it
(``nbtrain.core.scheduler``), less the phases nested in it. The profiler slows Python code
about twofold; read the shares, not the seconds.
"""

from __future__ import annotations

import pstats
from dataclasses import dataclass

__all__ = ["PhaseTime", "format_phases", "phase_times"]

_SCHED = "nbtrain/core/scheduler.py"
_BOOK = "nbtrain/core/jobbook.py"

# (phase, [(file, function), ...] whose cumulative times add up to it, nested phases)
_PHASES: tuple[tuple[str, tuple[tuple[str, str], ...], tuple[str, ...]], ...] = (
    ("decisions (Scheduler.handle)", ((_SCHED, "handle"),),
     ("apply the event", "decay fair share", "pass")),
    ("apply the event", ((_SCHED, "_apply"),), ()),
    ("decay fair share", (("nbtrain/core/fairshare.py", "advance"),), ()),
    ("pass", ((_SCHED, "_schedule"),),
     ("pass: order the queue", "pass: blocked head", "pass: grow elastic jobs")),
    ("pass: order the queue", ((_BOOK, "_queue_list"),), ()),
    ("pass: blocked head", ((_SCHED, "_head_blocked"),),
     ("head: shrink elastic jobs", "head: choose victims", "head: reservation")),
    ("head: shrink elastic jobs", ((_SCHED, "_shrink_elastic_for"),), ()),
    ("head: choose victims", (("nbtrain/core/preemption.py", "choose_victims"),
                              (_BOOK, "_lost_work")), ()),
    ("head: reservation", ((_SCHED, "_shadow"),), ()),
    ("pass: grow elastic jobs", ((_SCHED, "_grow_elastic"),), ()),
)
_OTHER = {
    "decisions (Scheduler.handle)": "(rest of handle)",
    "pass": "pass: walk the queue, fit and start",
    "pass: blocked head": "head: jobs being stopped, trial fits",
}


@dataclass(frozen=True)
class PhaseTime:
    """One phase: seconds under the profiler, share of all decision time, calls (``None``
    for the remainder of a phase not in its nested phases)."""

    phase: str
    depth: int
    seconds: float
    share: float
    calls: int | None


def _cumulative(stats: pstats.Stats, funcs: tuple[tuple[str, str], ...]) -> tuple[float, int]:
    total, calls = 0.0, 0
    table = stats.stats  # type: ignore[attr-defined]
    for (filename, _, name), (_, n_calls, _, cum, _) in table.items():
        path = str(filename).replace("\\", "/")
        if any(name == fn and path.endswith(f) for f, fn in funcs):
            total += cum
            calls += n_calls
    return total, calls


def phase_times(stats: pstats.Stats) -> list[PhaseTime]:
    """The decision time of a profiled replay split by phase, in pass order (nested phases
    follow their parent; each parent's own remainder is listed as its last child)."""
    own = {name: _cumulative(stats, funcs) for name, funcs, _ in _PHASES}
    children = {name: kids for name, _, kids in _PHASES}
    total = own[_PHASES[0][0]][0] or 1.0
    out: list[PhaseTime] = []

    def visit(name: str, depth: int) -> None:
        sec, calls = own[name]
        out.append(PhaseTime(name, depth, sec, sec / total, calls))
        kids = children[name]
        if not kids:
            return
        for kid in kids:
            visit(kid, depth + 1)
        rest = max(0.0, sec - sum(own[k][0] for k in kids))
        out.append(PhaseTime(_OTHER.get(name, "(rest)"), depth + 1, rest, rest / total, None))

    visit(_PHASES[0][0], 0)
    return out


def format_phases(phases: list[PhaseTime]) -> str:
    """A small indented table: phase, seconds, share of decision time, calls."""
    rows = [("  " * p.depth + p.phase, f"{p.seconds:.2f}", f"{p.share:.1%}",
             "" if p.calls is None else f"{p.calls:,}") for p in phases]
    head = ("phase", "s (profiled)", "share", "calls")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = [head[0].ljust(widths[0]) + "  " + "  ".join(
        h.rjust(w) for h, w in zip(head[1:], widths[1:], strict=True))]
    for r in rows:
        lines.append(r[0].ljust(widths[0]) + "  " + "  ".join(
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)))
    return "\n".join(lines)
