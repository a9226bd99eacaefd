"""Where the HF ``Trainer``'s gap to torchrun lies: in the ranks, or on the cores beside them.

The nbtrain HF member of ``benchmarks/frameworks.py`` (``run_trainer`` in a training
function) and the same ``Trainer`` under ``torchrun --nproc-per-node 2`` run at once in
turns (``benchmarks/_turns.py``). Rank 0 of each takes a ``_turns.thread_sample`` at every
step end: wall clock, its training thread's CPU time and context switches. Per cycle this
gives each member's wall ms, CPU ms, voluntary and involuntary (preempted) switches per
step in its turn's steady part; the figures are medians over cycles (the first left out).

With ``--sched`` (Linux ``perf``, root), ``perf sched record`` traces the whole machine for
``SCHED_CYCLES`` cycles from the middle of the schedule, and the trace is split by role in
each member's turns (steady parts): the running member's processes, the sleeping member's,
this process (the embedded scheduler with nbtrain's controller, and the client), other
processes, idle; as ms of CPU per second of turn on the two cores.

Usage: ``python benchmarks/turn_anatomy.py [--turns N] [--turn-s S] [--sched]``; about 3
minutes at the default 25 turns of 2 s. Last stdout line: JSON with ``ratio`` (nbtrain's
steps/s over torchrun's), ``cpu_ms_per_step_ratio`` (nbtrain's training-thread CPU per step
over torchrun's), ``{ours,peer}_{wall_ms,cpu_ms,voluntary,involuntary}_per_step`` and, with
``--sched``, ``sched_ms_per_s`` (``ours_turns`` and ``peer_turns``, each by role) and
``preempted_per_s``: in each member's turns, how often its threads were preempted, by whom.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _schedtrace import SchedTrace, available, cpu_by_role, preemptors
from _turns import Turns
from frameworks import (
    SKIP_S,
    TURNS_TIMEOUT_S,
    connect_warm,
    hf_peer_args,
    race_in_turns,
    submit_hf_turns,
)

import nbtrain

TURNS, TURN_S = 25, 2.0
#: Cycles the scheduler trace covers (from the schedule's middle): enough for a few turns
#: of each member, short enough that ``perf sched timehist`` reads it back in seconds.
SCHED_CYCLES = 4
STATS = ("wall_ms", "cpu_ms", "voluntary", "involuntary")


def traced_cycles(turns: Turns) -> range:
    """The cycles the scheduler trace covers: ``SCHED_CYCLES`` from the schedule's middle."""
    first = max(0, (turns.turns - SCHED_CYCLES) // 2)
    return range(first, min(turns.turns, first + SCHED_CYCLES))


def start_probed(cluster: nbtrain.Cluster, trace: SchedTrace | None
                 ) -> Callable[[Turns, Path], Callable[[], dict[str, Any]]]:
    """The nbtrain member with per-step samples; starts ``trace`` at its schedule's middle."""
    def start(turns: Turns, work: Path) -> Callable[[], dict[str, Any]]:
        if trace is not None:
            cycles = traced_cycles(turns)
            at = turns.start(cycles.start * turns.members) - time.time() + time.monotonic()
            trace.start(at, len(cycles) * turns.members * turns.turn_s)
        job = submit_hf_turns(cluster, turns, work, probe=True)
        return lambda: dict(job.result(timeout=TURNS_TIMEOUT_S))
    return start


def member_figures(turns: Turns, ours: dict[str, Any], peer: dict[str, Any]
                   ) -> dict[str, Any]:
    """Medians over cycles of each member's per-step means, and the two ratios."""
    a = turns.member(0).per_step(ours["samples"], SKIP_S)
    b = turns.member(1).per_step(peer["samples"], SKIP_S)
    cycles = [c for c in sorted(set(a) & set(b)) if c >= 1]
    if not cycles:
        return {"ratio": None, "cycles": 0}
    out: dict[str, Any] = {
        "ratio": round(statistics.median(b[c][0] / a[c][0] for c in cycles), 4),
        "cpu_ms_per_step_ratio": round(statistics.median(a[c][1] / b[c][1] for c in cycles), 4),
        "cycles": len(cycles)}
    for who, rows in (("ours", a), ("peer", b)):
        for i, stat in enumerate(STATS):
            out[f"{who}_{stat}_per_step"] = round(statistics.median(rows[c][i] for c in cycles), 3)
    return out


def sched_figures(trace: SchedTrace, turns: Turns, ours: dict[str, Any],
                  peer: dict[str, Any]) -> dict[str, Any]:
    """The trace's CPU by role in each member's turns (their steady parts); this process
    holds the embedded scheduler and controller."""
    slices = trace.slices()
    if not slices:
        return {"sched_error": trace.error or "the trace is empty"}
    switches = trace.preemptions()
    pid_of = {s.tid: s.pid for s in slices}
    shift = time.monotonic() - time.time()  # wall clock to monotonic, as the trace keeps it
    out, preempted = {}, {}
    for me, label in ((0, "ours_turns"), (1, "peer_turns")):
        running, sleeping = (ours, peer) if me == 0 else (peer, ours)
        roles = {**{pid: "running member" for pid in running["pids"]},
                 **{pid: "sleeping member" for pid in sleeping["pids"]},
                 os.getpid(): "this process (scheduler, controller, client)"}
        spans = [(turns.start(k) + SKIP_S + shift, turns.start(k + 1) + shift)
                 for k in (c * turns.members + me for c in traced_cycles(turns))]
        out[label] = cpu_by_role(slices, spans, roles, cores=2)
        preempted[label] = preemptors(switches, spans, running["pids"], pid_of, roles)
    return {"sched_ms_per_s": out, "preempted_per_s": preempted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=TURNS, help="turns of each member")
    parser.add_argument("--turn-s", type=float, default=TURN_S, help="seconds of a turn")
    parser.add_argument("--sched", action="store_true",
                        help="trace the machine's scheduler for a few cycles (perf, root)")
    args = parser.parse_args()
    if args.sched and not available():
        raise SystemExit("--sched needs Linux perf able to trace the whole machine "
                         "(root, or sysctl kernel.perf_event_paranoid=-1); run without it")
    root = Path(tempfile.mkdtemp(prefix="nbtrain-anatomy-"))
    trace = SchedTrace(root / "sched.data") if args.sched else None
    with connect_warm(root) as cluster:
        schedule, ours, peer = race_in_turns(
            "torchrun-hf", start_probed(cluster, trace), "_hf_torchrun_peer.py",
            [*hf_peer_args(root), "--probe"], args.turns, args.turn_s)
    if schedule is None or ours is None or peer.value is None:
        print(json.dumps({"ratio": None, "peer_failed": list(peer.errors)}))
        return
    figures = member_figures(schedule, ours, peer.value)
    if trace is not None:
        figures.update(sched_figures(trace, schedule, ours, peer.value))
    print(f"nbtrain/torchrun steps/s {figures['ratio']} over {figures['cycles']} cycles; "
          f"training-thread CPU per step {figures.get('cpu_ms_per_step_ratio')}; involuntary "
          f"switches per step {figures.get('ours_involuntary_per_step')} vs "
          f"{figures.get('peer_involuntary_per_step')}", flush=True)
    for label, roles in figures.get("sched_ms_per_s", {}).items():
        print(f"  {label}: " + ", ".join(f"{role} {ms} ms/s" for role, ms in roles.items()))
    for label, who in figures.get("preempted_per_s", {}).items():
        print(f"  {label}, the running member's threads preempted (per s): "
              + "; ".join(f"{key} {n}" for key, n in who.items()))
    print(json.dumps({**figures, "turns": args.turns, "turn_s": args.turn_s}), flush=True)


if __name__ == "__main__":
    main()
