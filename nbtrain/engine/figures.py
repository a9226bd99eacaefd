"""The controller's decision figures (``cluster.snapshot()["decision_ms"]``), from its
timing records: pure arithmetic over what the controller measured."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["decision_figures"]


def decision_figures(decision_s: Iterable[float], decision_cpu_s: Iterable[tuple[float, str]],
                     feed_s: Iterable[tuple[float, float, str]], slice_s: Iterable[float]
                     ) -> dict[str, Any]:
    """The machine's decision times (wall clock), their CPU time on the loop's thread, and
    the slowest kinds of event by CPU time; each event's whole handling; the inbox's
    slices."""
    times = sorted(decision_s)
    if not times:
        return {}
    cpu = sorted(decision_cpu_s)

    def pick(values: list[Any], q: float) -> float:
        v = values[min(len(values) - 1, int(q * len(values)))]
        return 1e3 * float(v[0] if isinstance(v, tuple) else v)

    slices = sorted(slice_s)
    out = {"p50": pick(times, 0.5), "p99": pick(times, 0.99), "max": 1e3 * times[-1],
           "n": len(times), "cpu_p50": pick(cpu, 0.5), "cpu_p99": pick(cpu, 0.99),
           "cpu_max": 1e3 * cpu[-1][0],
           "slowest": [f"{kind} {1e3 * t:.2f} ms" for t, kind in cpu[-5:][::-1]],
           "slices": len(slices)}
    whole = sorted(feed_s)
    if whole:  # each event's whole handling: decision, commands, journaling
        out.update(feed_p99=pick(whole, 0.99), feed_max=1e3 * whole[-1][0],
                   feed_slowest=[f"{kind} {1e3 * w:.2f} ms (CPU {1e3 * c:.2f})"
                                 for w, c, kind in whole[-8:][::-1]])
    if slices:  # the inbox's slices: how long queued events held the loop at once
        out.update(slice_p99=pick(slices, 0.99), slice_max=1e3 * slices[-1])
    return out
