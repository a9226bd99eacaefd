"""Static pictures of a job's plots, as SVG: for papermill outputs, nbval and CI logs.

A live widget leaves nothing in a notebook run headless, and Bokeh's PNG export needs
Selenium and a browser driver. A few line charts need neither: this module draws them as
plain SVG (a text format every notebook viewer and browser shows), from the same step rows
the dashboard uses. ``static_plots(job)`` returns an object that notebooks display as an
image and that ``save(path)`` writes to a file.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nbtrain.ui.plots import GEN, METRICS, RANK, STEP, STEP_S, TIME, rank_colour

Series = tuple[str, str, Sequence[float], Sequence[float]]  # label, colour, xs, ys

_W, _H = 340, 250  # one panel
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 52, 10, 26, 66


@dataclass(repr=False)
class StaticPlots:
    """An SVG picture; Jupyter shows it as an image (``image/svg+xml``)."""

    svg: str

    def _repr_svg_(self) -> str:
        return self.svg

    def __repr__(self) -> str:
        return f"<nbtrain static plots: SVG, {len(self.svg)} characters>"

    def save(self, path: str) -> str:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.svg)
        return path


def static_plots(job: Any, *, max_lines: int = 8, max_points: int = 600) -> StaticPlots:
    """Step time per rank (or median and slowest rank when there are more than
    ``max_lines``), loss and throughput of ``job`` (a JobHandle) as one SVG picture."""
    rows, _ = job.rows_since(0)
    return StaticPlots(render_svg(rows, title=f"nbtrain job {job.name}: "
                                  f"{job.status.value}, step {job.spec.progress(job.step)}",
                                  max_lines=max_lines, max_points=max_points))


def render_svg(rows: Sequence[Sequence[Any]], *, title: str = "", max_lines: int = 8,
               max_points: int = 600) -> str:
    """Three panels side by side from step rows (see :mod:`nbtrain.ui.plots`)."""
    panels = [
        ("step time per rank (s)", _step_series(rows, max_lines)),
        ("loss (rank 0)", _metric_series(rows, "loss")),
        ("throughput (steps/s)", _throughput_series(rows)),
    ]
    width, height = _W * len(panels), _H + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="8" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>']
    for i, (name, series) in enumerate(panels):
        parts.append(_panel(i * _W, 24, name, [_thin(s, max_points) for s in series]))
    parts.append("</svg>")
    return "\n".join(parts)


def _step_series(rows: Sequence[Sequence[Any]], max_lines: int) -> list[Series]:
    by_rank: dict[int, dict[int, float]] = {}
    for row in rows:
        by_rank.setdefault(int(row[RANK]), {})[int(row[STEP])] = float(row[STEP_S])
    if not by_rank:
        return []
    if len(by_rank) <= max_lines:
        return [(f"rank {r}", rank_colour(r), list(v), list(v.values()))
                for r, v in sorted(by_rank.items())]
    steps = sorted(set().union(*by_rank.values()))
    med, worst = [], []
    for step in steps:
        values = [v[step] for v in by_rank.values() if step in v]
        med.append(float(np.median(values)))
        worst.append(max(values))
    return [("median rank", "#1f77b4", steps, med), ("slowest rank", "#d62728", steps, worst)]


def _metric_series(rows: Sequence[Sequence[Any]], key: str) -> list[Series]:
    xs, ys = [], []
    for row in rows:
        if int(row[RANK]) == 0 and len(row) > METRICS and isinstance(row[METRICS], dict):
            value = row[METRICS].get(key)
            if value is not None and math.isfinite(float(value)):
                xs.append(float(row[STEP]))
                ys.append(float(value))
    return [(key, "#d62728", xs, ys)] if xs else []


def _throughput_series(rows: Sequence[Sequence[Any]], span: int = 20) -> list[Series]:
    xs: list[float] = []
    ys: list[float] = []
    times: list[float] = []
    gen = None
    for row in rows:
        if int(row[RANK]) != 0:
            continue
        if row[GEN] != gen:
            gen, times = row[GEN], []
        times = [*times[-(span - 1):], float(row[TIME])]
        if len(times) >= 2 and times[-1] > times[0]:
            xs.append(float(row[STEP]))
            ys.append((len(times) - 1) / (times[-1] - times[0]))
    return [("steps/s", "#17becf", xs, ys)] if xs else []


def _thin(series: Series, max_points: int) -> Series:
    label, colour, xs, ys = series
    if len(xs) <= max_points:
        return series
    idx = np.linspace(0, len(xs) - 1, max_points).round().astype(int)
    return label, colour, [xs[i] for i in idx], [ys[i] for i in idx]


def _ticks(low: float, high: float, n: int = 5) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(low / step) * step
    return [start + i * step for i in range(int((high - start) / step) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.2g}"
    return f"{v:.3g}"


def _panel(x0: int, y0: int, name: str, series: list[Series]) -> str:
    left, top = x0 + _PAD_L, y0 + _PAD_T
    w, h = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B
    out = [f'<text x="{x0 + _PAD_L}" y="{y0 + 16}" font-weight="bold">{html.escape(name)}</text>',
           f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    points = [(x, y) for _, _, xs, ys in series for x, y in zip(xs, ys, strict=False)]
    if not points:
        out.append(f'<text x="{left + 8}" y="{top + h / 2}" fill="#777">no data</text>')
        return "\n".join(out)
    xs_all = [p[0] for p in points]
    ys_all = [p[1] for p in points]
    x_lo, x_hi = min(xs_all), max(xs_all)
    y_lo = min(0.0, min(ys_all))
    y_hi = float(np.percentile(ys_all, 99)) * 1.05 or 1.0  # one warm-up spike must not
    if x_hi <= x_lo:                                         # flatten everything else
        x_hi = x_lo + 1
    if y_hi <= y_lo:
        y_hi = y_lo + 1

    def sx(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * w

    def sy(y: float) -> float:
        return top + h - (min(max(y, y_lo), y_hi) - y_lo) / (y_hi - y_lo) * h

    for t in _ticks(y_lo, y_hi):
        out.append(f'<line x1="{left}" x2="{left + w}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" '
                   f'stroke="#eee"/><text x="{left - 4}" y="{sy(t) + 4:.1f}" '
                   f'text-anchor="end">{_fmt(t)}</text>')
    for t in _ticks(x_lo, x_hi, 4):
        out.append(f'<text x="{sx(t):.1f}" y="{top + h + 14}" text-anchor="middle">'
                   f'{_fmt(t)}</text>')
    out.append(f'<text x="{left + w / 2}" y="{top + h + 28}" text-anchor="middle" '
               f'fill="#555">step</text>')
    for i, (label, colour, xs, ys) in enumerate(series):
        if not xs:
            continue
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys, strict=False))
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.2" '
                   f'points="{path}"/>')
        lx = left + (i % 4) * 70
        ly = top + h + 42 + (i // 4) * 12
        out.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{colour}"/>'
                   f'<text x="{lx + 13}" y="{ly - 4}" font-size="9">{html.escape(label)}</text>')
    return "\n".join(out)
