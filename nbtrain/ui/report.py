"""``job.report(path)``: one standalone HTML file with the dashboard's plots and a summary.

Standalone means it opens offline years later: BokehJS is embedded inline (core bundle only),
no CDN, no server. The plots are the dashboard's own plot classes fed the whole history
(thinned to at most ``max_steps`` steps per rank so a long job still gives a file of a few
MB). :func:`summary` is the same table as a notebook object, for headless runs.
"""

from __future__ import annotations

import html
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

from nbtrain.ui.eventlog import EventLog
from nbtrain.ui.plots import (
    COMM_S,
    COMPUTE_S,
    DATA_S,
    METRICS,
    OPT_S,
    RANK,
    STEP,
    STEP_S,
    GenerationMarks,
    KnobMarks,
    MetricPlot,
    PhaseSplitPlot,
    StepTimePlot,
    ThroughputPlot,
)
from nbtrain.ui.static import render_svg

_CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.2em 0; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
.error { color: #c33; } .warn { color: #b70; } .info { color: #555; }
"""


@dataclass(repr=False)
class Summary:
    """Key figures of a job; displays as an HTML table in notebooks."""

    rows: list[tuple[str, str]]
    per_rank: list[dict[str, Any]]

    def to_html(self) -> str:
        head = "".join(f"<tr><th class='l'>{html.escape(k)}</th><td class='l'>"
                       f"{html.escape(v)}</td></tr>" for k, v in self.rows)
        ranks = ""
        if self.per_rank:
            cols = list(self.per_rank[0])
            ranks = ("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols)
                     + "</tr>" + "".join(
                         "<tr>" + "".join(f"<td>{_cell(r[c])}</td>" for c in cols) + "</tr>"
                         for r in self.per_rank) + "</table>")
        return f"<table>{head}</table>{ranks}"

    def _repr_html_(self) -> str:
        return self.to_html()

    def __str__(self) -> str:
        width = max(len(k) for k, _ in self.rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in self.rows)

    __repr__ = __str__


def summary(job: Any) -> Summary:
    """State, progress, timing, loss, checkpoints, goodput and per-rank step times."""
    rows, _ = job.rows_since(0)
    log = _fold_events(job)
    main = [r for r in rows if int(r[RANK]) == 0]
    items: list[tuple[str, str]] = [
        ("job", str(job.name)),
        ("state", f"{job.status.value}: {job.reason}"),
        ("steps", job.spec.progress(job.step).replace("/", " of ")),
        ("world size", str(job.spec.world_size)),
        ("generations", str(max(job.generation, 0) + 1)),
        ("restarts", str(getattr(job, "restarts", log.restarts))),
    ]
    started, ended = getattr(job, "started_at", None), getattr(job, "ended_at", None)
    if started is not None:
        items.append(("wall time", f"{(ended or time.time()) - started:.1f} s"))
    if len(main) >= 2:
        steps_s = [float(r[STEP_S]) for r in main]
        items.append(("step time (rank 0)", f"median {statistics.median(steps_s) * 1e3:.2f} ms"
                      f", p95 {_pct(steps_s, 95) * 1e3:.2f} ms"))
    for key in ("loss", "val_acc"):
        value = _last_metric(main, key)
        if value is not None:
            items.append((f"final {key}", f"{value:.4f}"))
    items.append(("checkpoints", f"{log.checkpoint.commits} committed; "
                  f"{log.checkpoint.describe(time.time())}"))
    goodput = _goodput(job, log)
    if goodput is not None:
        items.append(("goodput", goodput))
    if log.failures:
        items.append(("rank failures", str(log.failures)))
    return Summary(items, _per_rank(rows))


def write_report(job: Any, path: str, *, max_steps: int = 5000, alerts: int = 200) -> str:
    """Write the report to ``path`` (a local path or an fsspec URL); returns ``path``."""
    from bokeh.embed import components
    from bokeh.layouts import column, row
    from bokeh.resources import Resources

    rows, _ = job.rows_since(0)
    rows = thin_rows(rows, max_steps)
    world = max([job.spec.world_size, *(int(r[RANK]) + 1 for r in rows)])
    step_plot = StepTimePlot(world, window_steps=max_steps + 1,
                             max_points=(max_steps + 1) * world, width=620)
    split = PhaseSplitPlot(window=max_steps + 1, width=380)
    split.figure.title.text = "phase split (mean over the run)"
    loss = MetricPlot("loss", window=max_steps + 1, width=620)
    rate = ThroughputPlot(window=max_steps + 1, width=380)
    for plot in (step_plot, split, loss, rate):
        plot.add(rows)
    log = _fold_events(job)
    GenerationMarks([step_plot.figure, *loss.figures, rate.figure]).add(
        rows, log.describe_generation)
    events = list(job.events)
    KnobMarks([*loss.figures, rate.figure]).add(events)
    layout = column(row(step_plot.figure, split.figure), row(loss.view, rate.figure))
    script, div = components(layout)
    resources = Resources(mode="inline", components=["bokeh", "bokeh-widgets"])  # the scale toggle

    alert_rows = "".join(
        f"<tr class='{a.level}'><td class='l'>"
        f"{time.strftime('%H:%M:%S', time.localtime(a.time)) if a.time else ''}</td>"
        f"<td class='l'>{html.escape(a.kind)}</td><td class='l'>{html.escape(a.text)}</td></tr>"
        for a in list(log.alerts)[-alerts:])
    error = (f"<h2>Error</h2><pre class='error'>{html.escape(job.error)}</pre>"
             if getattr(job, "error", None) else "")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>nbtrain report: {html.escape(job.name)}</title>
<style>{_CSS}</style>
{resources.render_js()}
{script}
</head><body>
<h1>nbtrain report: {html.escape(job.name)}</h1>
<p>Written {time.strftime('%Y-%m-%d %H:%M:%S')}. {len(rows)} step records plotted.</p>
<h2>Summary</h2>
{summary(job).to_html()}
{error}
<h2>Plots</h2>
{div}
{knob_table(events)}
<h2>Events</h2>
<table><tr><th class='l'>time</th><th class='l'>kind</th><th class='l'>what</th></tr>
{alert_rows or "<tr><td class='l' colspan='3'>none</td></tr>"}</table>
<h2>Static picture</h2>
{render_svg(rows, title=job.name)}
</body></html>
"""
    with fsspec.open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def thin_rows(rows: Sequence[Sequence[Any]], max_steps: int) -> list[Sequence[Any]]:
    """Keep every k-th step (the same steps on every rank) so that at most about
    ``max_steps`` steps per rank remain, plus each rank's last row."""
    if not rows:
        return []
    steps = {int(r[STEP]) for r in rows}
    if len(steps) <= max_steps:
        return list(rows)
    every = -(-len(steps) // max_steps)
    last: dict[int, int] = {}
    for i, r in enumerate(rows):
        last[int(r[RANK])] = i
    keep = set(last.values())
    return [r for i, r in enumerate(rows) if int(r[STEP]) % every == 0 or i in keep]


def knob_table(events: Sequence[Mapping[str, Any]]) -> str:
    """The applied live knob changes (step, values, ramp, who) as an HTML section ("" when
    there were none)."""
    from nbtrain.core.knobs import knob_state

    history = knob_state(events, 0).history
    if not history:
        return ""
    rows = "".join(
        f"<tr><td>{c.step}</td><td class='l'>"
        f"{html.escape(', '.join(f'{k}={v:.6g}' for k, v in c.values.items()))}</td>"
        f"<td class='l'>{f'{c.ramp} steps ({c.shape})' if c.ramp else 'at once'}</td>"
        f"<td class='l'>{html.escape(c.who or '?')}</td></tr>" for c in history)
    return ("<h2>Knob changes</h2><table><tr><th>applied at step</th><th class='l'>values"
            "</th><th class='l'>ramp</th><th class='l'>who</th></tr>" + rows + "</table>")


def _fold_events(job: Any) -> EventLog:
    log = EventLog(max_alerts=10_000)
    for event in job.events:
        log.add(event)
    return log


def _goodput(job: Any, log: EventLog) -> str | None:
    fn = getattr(job, "goodput", None)
    parts: dict[str, Any] = {}
    if callable(fn):
        try:
            value = fn()
            parts = dict(value) if isinstance(value, dict) else {}
        except Exception:
            parts = {}
    if not parts and log.goodput is not None:
        parts = {"fraction": log.goodput, **log.goodput_parts}
    fraction = parts.get("fraction")
    if fraction is None:
        return None
    detail = ", ".join(f"{k[:-2]} {float(v):.1f} s" for k, v in parts.items()
                       if k.endswith("_s") and isinstance(v, (int, float)) and v)
    return f"{float(fraction):.1%}" + (f" ({detail})" if detail else "")


def _per_rank(rows: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    by_rank: dict[int, list[Sequence[Any]]] = {}
    for r in rows:
        by_rank.setdefault(int(r[RANK]), []).append(r)
    out = []
    for rank, rs in sorted(by_rank.items()):
        step_s = [float(r[STEP_S]) for r in rs]
        out.append({
            "rank": rank, "steps": len(rs),
            "median step ms": statistics.median(step_s) * 1e3,
            "p95 step ms": _pct(step_s, 95) * 1e3,
            **{f"mean {name} ms": statistics.fmean(float(r[i]) for r in rs) * 1e3
               for name, i in (("data", DATA_S), ("compute", COMPUTE_S), ("comm", COMM_S),
                               ("opt", OPT_S))},
        })
    return out


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _last_metric(rows: Sequence[Sequence[Any]], key: str) -> float | None:
    for r in reversed(rows):
        if len(r) > METRICS and isinstance(r[METRICS], dict) and key in r[METRICS]:
            return float(r[METRICS][key])
    return None


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else html.escape(str(value))
