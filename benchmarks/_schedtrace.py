"""Who had the cores: a system-wide scheduler trace (Linux ``perf sched``) split by role.

``SchedTrace.start(at, seconds)`` records every context switch of the machine from ``at``
(a ``time.monotonic()`` instant) for ``seconds``, with perf's clock set to the same
monotonic clock, so the trace lines up with the times a benchmark keeps. ``slices()`` reads
it back through ``perf sched timehist``: one :class:`Slice` per stretch a thread ran, ending
at ``end`` (monotonic seconds) after ``run_ms``. :func:`cpu_by_role` sums them per role
(which processes are whose) inside given windows, as ms of CPU per second of window.

Needs ``perf`` and the right to trace the whole machine (root, or a low
``kernel.perf_event_paranoid``); ``available()`` says whether a short trace works here.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = ["Preemption", "SchedTrace", "Slice", "available", "cpu_by_role", "parse_preemptions",
           "parse_timehist", "preemptors"]

#: One ``perf sched timehist`` line: time, [cpu], comm[tid/pid] (or comm[tid] for a
#: process's main thread and kernel threads), wait, scheduling delay, run time (ms).
_LINE = re.compile(r"\s*(?P<t>\d+\.\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<comm>.*?)"
                   r"\[(?P<tid>\d+)(?:/(?P<pid>\d+))?\]\s+(?P<wait>\d+\.\d+)\s+"
                   r"(?P<delay>\d+\.\d+)\s+(?P<run>\d+\.\d+)\s*$")


#: One ``perf script`` line of a ``sched:sched_switch`` event.
_SWITCH = re.compile(r"\[(?P<cpu>\d+)\]\s+(?P<t>\d+\.\d+):\s+sched:sched_switch:\s+"
                     r"prev_comm=(?P<comm>.*?) prev_pid=(?P<tid>\d+) prev_prio=\d+ "
                     r"prev_state=(?P<state>\S+) ==> next_comm=(?P<by_comm>.*?) "
                     r"next_pid=(?P<by_tid>\d+) next_prio=\d+\s*$")


@dataclasses.dataclass(frozen=True)
class Slice:
    end: float  # monotonic seconds when the thread left the core
    cpu: int
    comm: str
    tid: int
    pid: int  # 0: the idle task
    run_ms: float


def parse_timehist(text: str) -> list[Slice]:
    """The slices in ``perf sched timehist`` output (its headers and summaries skipped)."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        tid = int(m["tid"])
        out.append(Slice(float(m["t"]), int(m["cpu"]), m["comm"].strip(), tid,
                         int(m["pid"]) if m["pid"] else tid, float(m["run"])))
    return out


def _inside(t: float, windows: Sequence[tuple[float, float]]) -> bool:
    """Whether monotonic time ``t`` lies in one of the ``windows`` (``[lo, hi)``)."""
    return any(lo <= t < hi for lo, hi in windows)


@dataclasses.dataclass(frozen=True)
class Preemption:
    """A thread taken off its core while it could still run, and the thread given the core."""
    time: float  # monotonic seconds
    cpu: int
    tid: int
    comm: str
    by_tid: int
    by_comm: str


def parse_preemptions(text: str) -> list[Preemption]:
    """The preemptions in ``perf script`` output: the ``sched_switch`` events whose previous
    thread (not the idle task) left the core runnable (state ``R`` or ``R+``)."""
    out = []
    for line in text.splitlines():
        m = _SWITCH.search(line)
        if m is None or not m["state"].startswith("R") or m["tid"] == "0":
            continue
        out.append(Preemption(float(m["t"]), int(m["cpu"]), int(m["tid"]), m["comm"].strip(),
                              int(m["by_tid"]), m["by_comm"].strip()))
    return out


def preemptors(preemptions: Iterable[Preemption], windows: Sequence[tuple[float, float]],
               victims: Iterable[int], pid_of: Mapping[int, int], roles: Mapping[int, str],
               top: int = 8) -> dict[str, float]:
    """Who preempted the threads of the ``victims`` processes inside ``windows``: per second
    of window, by ``"victim thread <- preemptor's role: preemptor thread"``, the ``top`` most
    frequent (``pid_of`` maps a thread id to its process id; roles as in ``cpu_by_role``)."""
    seconds = sum(hi - lo for lo, hi in windows)
    if seconds <= 0:
        return {}
    victim_pids = set(victims)
    counts: dict[str, int] = {}
    for p in preemptions:
        if pid_of.get(p.tid) not in victim_pids or not _inside(p.time, windows):
            continue
        role = roles.get(pid_of.get(p.by_tid, p.by_tid), "other")
        key = f"{p.comm} <- {role}: {p.by_comm}"
        counts[key] = counts.get(key, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return {key: round(n / seconds, 1) for key, n in ranked}


def cpu_by_role(slices: Iterable[Slice], windows: Sequence[tuple[float, float]],
                roles: Mapping[int, str], cores: int) -> dict[str, float]:
    """CPU ms per second of window, by role, over the slices that ended inside one of the
    ``windows`` (monotonic ``[lo, hi)``): each pid in ``roles`` under its role, any other
    thread under ``"other"``, and ``"idle"`` what no thread used of ``cores`` cores."""
    seconds = sum(hi - lo for lo, hi in windows)
    if seconds <= 0:
        return {}
    used: dict[str, float] = {role: 0.0 for role in roles.values()}
    used["other"] = 0.0
    for s in slices:
        if s.pid == 0 or not _inside(s.end, windows):
            continue
        role = roles.get(s.pid, "other")
        used[role] += s.run_ms
    out = {role: round(ms / seconds, 1) for role, ms in used.items()}
    out["idle"] = round(cores * 1000 - sum(used.values()) / seconds, 1)
    return out


def available() -> bool:
    """Whether ``perf sched record`` can trace this machine (a 0.1 s try)."""
    if shutil.which("perf") is None:
        return False
    try:
        done = subprocess.run(["perf", "sched", "record", "-k", "mono", "-o", "/dev/null",
                               "--", "sleep", "0.1"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


class SchedTrace:
    """One ``perf sched record`` of the whole machine, started on a thread at a given time.
    Started again (a benchmark's retried attempt, on a new schedule), the newer recording
    replaces the older: one not yet begun never begins, and ``slices`` reads the newest."""

    def __init__(self, path: Path) -> None:
        self.base = path
        self.error: str | None = None
        self._generation = 0
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        """The newest recording's file."""
        return self.base.with_suffix(f".{self._generation}{self.base.suffix}")

    def start(self, at: float, seconds: float) -> None:
        """Record from monotonic time ``at`` (or now, if that has passed) for ``seconds``."""
        self._generation += 1
        generation, path = self._generation, self.path

        def run() -> None:
            time.sleep(max(0.0, at - time.monotonic()))
            if generation != self._generation:  # started again meanwhile
                return
            done = subprocess.run(["perf", "sched", "record", "-k", "mono", "-o", str(path),
                                   "--", "sleep", f"{seconds:.3f}"],
                                  capture_output=True, text=True)
            if done.returncode != 0 and generation == self._generation:
                self.error = (done.stderr.strip().splitlines() or ["perf failed"])[-1]

        self.error = None
        self._thread = threading.Thread(target=run, name="sched-trace", daemon=True)
        self._thread.start()

    def slices(self, timeout: float = 120.0) -> list[Slice]:
        """Wait for the newest recording to end; its slices (empty if it failed: see
        ``error``)."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None or not self.path.exists():
            return []
        done = subprocess.run(["perf", "sched", "timehist", "-i", str(self.path)],
                              capture_output=True, text=True, timeout=timeout)
        return parse_timehist(done.stdout)

    def preemptions(self, timeout: float = 120.0) -> list[Preemption]:
        """The newest recording's preemptions (call after ``slices``; empty if it failed)."""
        if self.error is not None or not self.path.exists():
            return []
        done = subprocess.run(["perf", "script", "-i", str(self.path)],
                              capture_output=True, text=True, timeout=timeout)
        return parse_preemptions(done.stdout)
