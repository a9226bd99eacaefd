"""Run several policies on one trace and print the comparison table."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from nbtrain.core.topology import Topology
from nbtrain.sim.gang import GANG_POLICIES, SIZING_POLICIES, simulate_gang
from nbtrain.sim.greedy import simulate_greedy
from nbtrain.sim.ledger import SimResult
from nbtrain.sim.progress import JobEnd, Progress
from nbtrain.sim.trace import TraceJob

__all__ = ["ALL_POLICIES", "COLUMNS", "format_table", "run_policies"]

ALL_POLICIES: tuple[str, ...] = ("nbtrain", "fifo", "first_fit", "random", "greedy", "goodput")

COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (metric, header, format)
    ("util", "util", "{:.1%}"),
    ("goodput", "goodput", "{:.1%}"),
    ("jct_mean_h", "JCT h", "{:.2f}"),
    ("jct_p95_h", "JCT p95", "{:.2f}"),
    ("wait_mean_h", "wait h", "{:.2f}"),
    ("wait_p95_h", "wait p95", "{:.2f}"),
    ("large_wait_mean_h", "large wait", "{:.2f}"),
    ("jain", "Jain", "{:.3f}"),
    ("preemptions", "preempt", "{:.0f}"),
    ("uplink_per_slot_h", "uplink/slot-h", "{:.1f}"),
    ("tp_in_nvlink", "TP on NVLink", "{:.1%}"),
    ("fragmentation", "frag", "{:.1%}"),
    ("deadlocks", "deadlocks", "{:.0f}"),
    ("decision_p99_ms", "p99 ms", "{:.2f}"),
)


def run_policies(
    topology: Topology,
    trace: Sequence[TraceJob],
    policies: Sequence[str] = ("nbtrain", "fifo", "first_fit", "greedy"),
    *,
    team_weights: Mapping[str, float] | None = None,
    seed: int = 0,
    horizon_s: float | None = None,
    exposed: Mapping[str, float] | None = None,
    progress: Callable[[Progress], None] | None = None,
    progress_every_s: float = 5.0,
    on_job_end: Callable[[JobEnd], None] | None = None,
) -> dict[str, SimResult]:
    """Replay ``trace`` once per policy; results keyed by policy name. ``exposed`` sets how
    placement slows jobs (``nbtrain.sim.ledger.EXPOSED`` by default; ``{}`` for never);
    ``progress`` and ``on_job_end`` as in ``simulate_gang``."""
    out: dict[str, SimResult] = {}
    for name in policies:
        if name == "greedy":
            out[name] = simulate_greedy(topology, trace, team_weights=team_weights,
                                        horizon_s=horizon_s, exposed=exposed,
                                        progress=progress, progress_every_s=progress_every_s,
                                        on_job_end=on_job_end)
        elif name in GANG_POLICIES or name in SIZING_POLICIES:
            out[name] = simulate_gang(topology, trace, name, team_weights=team_weights,
                                      seed=seed, horizon_s=horizon_s, exposed=exposed,
                                      progress=progress, progress_every_s=progress_every_s,
                                      on_job_end=on_job_end)
        else:
            raise ValueError(f"unknown policy {name!r}; choose from {ALL_POLICIES}")
    return out


def format_table(results: Mapping[str, SimResult]) -> str:
    """A fixed-width text table, one row per policy (the notebook shows the same table)."""
    headers = ["policy", *[h for _, h, _ in COLUMNS]]
    rows = []
    for name, res in results.items():
        cells = [name]
        for key, _, fmt in COLUMNS:
            value = res.metrics.get(key, math.nan)
            cells.append("-" if isinstance(value, float) and math.isnan(value) else
                         fmt.format(value))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)
