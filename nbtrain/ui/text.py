"""Headless progress: plain text lines at a bounded rate (scripts, papermill, CI logs)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import TextIO

from nbtrain.core.records import METRICS, RANK, TIME
from nbtrain.ui.jobview import JobView


def progress_line(job: JobView) -> str:
    """One line: state, step, latest loss (and accuracy), recent steps/s."""
    rows, _ = job.rows_since(max(0, job.row_count - 400))
    main = [r for r in rows if r[RANK] == 0]
    parts = [f"[{job.name}] {job.status.value:<9} step {job.spec.progress(job.step):>6}"]
    lost = job.unreachable_since
    if lost is not None:
        clock = time.strftime("%H:%M:%S", time.localtime(lost))
        parts.append(f"controller unreachable since {clock}")
    if len(main) >= 2:
        span = main[-1][TIME] - main[0][TIME]
        if span > 0:
            parts.append(f"{(len(main) - 1) / span:7.1f} steps/s")
    for key in ("loss", "val_acc"):
        value = _latest(main, key)
        if value is not None:
            parts.append(f"{key} {value:.4f}")
    return "  ".join(parts)


def _latest(rows: list[tuple[object, ...]], key: str) -> float | None:
    for row in reversed(rows):
        extra = row[METRICS] if len(row) > METRICS else None
        if isinstance(extra, dict) and key in extra:
            value = float(extra[key])
            return None if math.isnan(value) else value
    return None


def follow(job: JobView, *, interval_s: float = 2.0, out: TextIO | None = None,
           timeout: float | None = None) -> None:
    """Print a progress line every ``interval_s`` until the job ends (blocks: for scripts)."""
    stream = out or sys.stdout
    deadline = None if timeout is None else time.monotonic() + timeout
    last = ""
    while not job.done:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job.name} did not end within {timeout} s")
        line = progress_line(job)
        if line != last:
            print(line, file=stream, flush=True)
            last = line
        with contextlib.suppress(TimeoutError):  # not ended yet: the next line
            job.wait(timeout=interval_s)
    print(progress_line(job), file=stream, flush=True)
    print(f"[{job.name}] {job.status.value}: {job.reason}", file=stream, flush=True)
