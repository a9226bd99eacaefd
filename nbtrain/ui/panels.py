"""The HTML panels every live view shows the same way: the status header, the alerts and the
checkpoint line. Plain functions of a job's status (the controller's ``JobStatus`` as a dict)
and its :class:`~nbtrain.ui.eventlog.EventLog`, so the kernel-side widget and the pages the
cluster serves say the same thing."""

from __future__ import annotations

import html
import time
from collections.abc import Mapping
from typing import Any

from nbtrain.core.job import format_progress
from nbtrain.ui.eventlog import EventLog

__all__ = ["LEVEL_COLOURS", "STATE_COLOURS", "alerts_html", "checkpoint_html", "header_html"]

STATE_COLOURS = {"RUNNING": "#2a7", "SUCCEEDED": "#27a", "FAILED": "#c33", "QUEUED": "#a80",
                 "STARTING": "#a80", "STOPPING": "#a80", "PREEMPTED": "#a50",
                 "CANCELLED": "#666"}
LEVEL_COLOURS = {"error": "#c33", "warn": "#b70", "info": "#555"}


def header_html(status: Mapping[str, Any], log: EventLog, rate: float | None = None) -> str:
    """Name, state, step, generation, size, restarts, goodput, rate; the reason below."""
    state = str(status.get("state", "QUEUED"))
    colour = STATE_COLOURS.get(state, "#666")
    size = int(status.get("size") or 0) or len(status.get("slots") or ()) or int(
        status.get("world_size", 0))
    parts = [f"step {format_progress(int(status.get('step', 0)), status.get('steps'))}",
             f"generation {max(int(status.get('generation', -1)), 0)}",
             f"world size {size}",
             f"restarts {int(status.get('restarts', log.restarts))}"]
    goodput = (status.get("goodput") or {}).get("fraction", log.goodput)
    if goodput is not None:
        parts.append(f"goodput {float(goodput):.0%}")
    if rate is not None and state == "RUNNING":
        parts.append(f"{rate:.1f} steps/s")
    owner = f" <span style='color:#888'>({html.escape(str(status['owner']))})</span>" if (
        status.get("owner")) else ""
    return (f"<div class='nbtrain-header'><b>{html.escape(str(status.get('name', '?')))}</b>"
            f"{owner} <span class='nbtrain-state' style='color:{colour};font-weight:bold'>"
            f"{state}</span> · {' · '.join(parts)}<br>"
            f"<i>{html.escape(str(status.get('reason', '')))}</i></div>")


def alerts_html(log: EventLog, shown: int) -> str:
    """The newest ``shown`` alerts, newest first, coloured by level."""
    alerts = log.recent(shown)
    if not alerts:
        return "<b>Alerts</b><br><i>none</i>"
    lines = []
    for alert in alerts:
        stamp = (time.strftime("%H:%M:%S", time.localtime(alert.time))
                 if alert.time is not None else "")
        lines.append(f"<div class='nbtrain-alert' style='color:"
                     f"{LEVEL_COLOURS.get(alert.level, '#555')}'>"
                     f"{stamp} {html.escape(alert.text)}</div>")
    return ("<b>Alerts</b> (newest first)<div style='font-size:90%;max-height:9em;"
            "overflow:auto;line-height:1.25'>" + "".join(lines) + "</div>")


def checkpoint_html(log: EventLog) -> str:
    """The last checkpoint, and each rank's training state (parameter and optimizer bytes)
    once the ranks have reported it."""
    memory = log.describe_memory()
    return ("<b>Checkpoint</b><div style='font-size:90%;line-height:1.25'>"
            + html.escape(log.checkpoint.describe(time.time())) + "</div>"
            + (f"<div style='font-size:90%;line-height:1.25'>{html.escape(memory)}</div>"
               if memory else ""))
