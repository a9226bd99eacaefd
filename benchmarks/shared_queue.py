"""The shared queue, live: priority preemption between two client processes, submit latency,
the controller's decision time, and the step-rate overhead with the controller in the Dask
scheduler.

Cluster: a standalone one (``dask scheduler`` with nbtrain's controller preloaded, ``dask
worker`` with 2 worker processes), as an operator would run it. Client A (this process) keeps
a low-priority 2-rank job training. Client B (another process), each round, submits a
priority-5 2-rank job: the controller preempts A's job (it checkpoints at its next step
boundary and releases its slots), B's job runs 30 steps, A's job resumes from that checkpoint.

Figures:
- ``preempt_to_start_s``: B's submit call to the first step of its job (wall clock; median
  over rounds), i.e. the victim's checkpoint and release plus B's rank start.
- ``victim_lost_steps``: committed steps A lost (steps its resumed generation recomputed
  plus those reported lost by forced releases): must be 0.
- ``submit_ms_p50``: client submit to handle, over the preempting submits and 30 queued
  jobs submitted behind the victim.
- ``decision_ms_p99``: the controller's handling of each event (the pure job machine with the
  gang scheduler), from its own timings over the run.
  ``feed_ms_p99`` adds what the controller does with the decision (its commands, the
  journal); ``decision_cpu_ms_p99`` is the same decisions' CPU time on the loop's thread.
- ``probe_ms_p99``: the peer of the decision times: 2 ms of pure CPU work run on the same
  scheduler loop every 50 ms through the run, timed the same way. Where the decisions' CPU
  time is small, their wall-clock tail is this box's (the OS scheduler on 2 loaded cores).
- ``inbox_slice_ms_p99``: how long events queued in the controller's inbox (long step-row
  batches split into 8-row events) held the loop at once.
- ``overhead_ratio``: ``benchmarks/overhead.py``'s comparison (nbtrain vs torchrun, same
  model) run on this standalone cluster (``--quick``: 3 rounds of 300 steps). A torchrun
  peer that fails twice leaves it null, ``peer_failed`` saying why; the exit status stays 0.

Usage: ``python benchmarks/shared_queue.py [--quick] [--rounds N]``; last stdout line is JSON.
(Not ``queue.py``: a file of that name here would shadow the standard library's ``queue``
module for every script in this folder.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import nbtrain
from nbtrain.engine.standalone import standalone_cluster
from nbtrain.examples import DigitsMLP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import compare

#: The peer's CPU work: about a decision's CPU time at p99 on this project's CPU machine.
PROBE_CPU_S = 0.002

CLIENT_B = """
import json, sys, time
import nbtrain
from nbtrain.examples import DigitsMLP

address, rounds, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
settings = nbtrain.Settings.load(checkpoint_root=root, token_file="")
c = nbtrain.connect(address, settings=settings)
low = c.job("low")
out = {"preempt_to_start_s": [], "submit_ms": []}
for r in range(rounds):
    gen = low.generation
    t0 = time.time()
    job = c.submit(DigitsMLP(eval_every=0), world_size=2, steps=30, name=f"high-{r}",
                   priority=5, checkpoint=None)
    out["submit_ms"].append((time.time() - t0) * 1e3)
    while job.metrics.empty:
        time.sleep(0.005)
    m = job.metrics
    out["preempt_to_start_s"].append(float(m["time"].min() - t0))
    assert job.wait(300).value == "SUCCEEDED", job.reason
    while not (low.generation > gen and low.status.value == "RUNNING"):
        time.sleep(0.02)
print(json.dumps(out))
"""


def _start_probe(dask_scheduler: object, cpu_s: float, every_s: float) -> None:
    """On the scheduler's loop, beside the controller: every ``every_s``, ``cpu_s`` of pure
    CPU work, timed by the wall clock (the peer of the controller's decisions: the same
    loop, the same machine, the same run; what it waits is the box, not nbtrain)."""
    import asyncio as _asyncio
    import time as _time

    wall: list[float] = []
    dask_scheduler._nbtrain_probe = wall  # type: ignore[attr-defined]

    async def probe() -> None:
        while getattr(dask_scheduler, "_nbtrain_probe", None) is wall:
            await _asyncio.sleep(every_s)
            t0, c0 = _time.perf_counter(), _time.thread_time()
            while _time.thread_time() - c0 < cpu_s:
                pass
            wall.append(_time.perf_counter() - t0)

    dask_scheduler._nbtrain_probe_task = _asyncio.ensure_future(probe())  # type: ignore


def _stop_probe(dask_scheduler: object) -> list[float]:
    wall: list[float] = getattr(dask_scheduler, "_nbtrain_probe", [])
    dask_scheduler._nbtrain_probe = None  # type: ignore[attr-defined]
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 rounds; overhead 3x300 steps")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    tmp = tempfile.TemporaryDirectory(prefix="nbtrain-queue-")
    root = Path(tmp.name)
    settings = nbtrain.Settings.load(checkpoint_root=str(root / "ckpt"), token_file="")
    with tmp, standalone_cluster(2, logs=root / "logs") as sc, \
            nbtrain.connect(sc.address, settings=settings) as cluster:
        low = cluster.submit(DigitsMLP(eval_every=0), world_size=2, steps=10**7, name="low",
                             checkpoint=None)
        while low.step < 20:
            time.sleep(0.05)
        cluster.client.run_on_scheduler(_start_probe, cpu_s=PROBE_CPU_S, every_s=0.05)
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CLIENT_B), sc.address,
                               str(rounds), str(root / "ckpt")],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise SystemExit(f"client B failed:\n{proc.stderr}")
        b = json.loads(proc.stdout.strip().splitlines()[-1])
        # Submit latency of queued jobs (behind the victim's gang), then withdraw them.
        queued_ms = []
        queued = []
        for _ in range(30):
            t0 = time.perf_counter()
            queued.append(cluster.submit(DigitsMLP(), world_size=2, steps=10, team="other"))
            queued_ms.append((time.perf_counter() - t0) * 1e3)
        for job in queued:
            job.stop()
        low.stop()
        low.wait(120)
        preemptions = [e for e in low.events if e["kind"] == "preemption"]
        # Steps the victim had done when it stopped that its next generation did again.
        starts = {e["generation"]: int(e["start_step"]) for e in low.events
                  if e["kind"] == "rank_started"}
        done = {e["generation"]: int(e["step"]) for e in low.events
                if e["kind"] == "rank_finished" and e["rank"] == 0}
        recomputed = sum(max(0, done[p["generation"]] - starts.get(p["generation"] + 1,
                                                                  done[p["generation"]]))
                         for p in preemptions if p["generation"] in done)
        lost = recomputed + sum(int(p["lost_steps"]) for p in preemptions)
        decisions = cluster.snapshot()["decision_ms"]
        probe = sorted(cluster.client.run_on_scheduler(_stop_probe))
        print("\noverhead (nbtrain on this cluster vs torchrun):", flush=True)
        overhead = compare(cluster, 3 if args.quick else 7, 300 if args.quick else 1000)
    submit_ms = sorted(b["submit_ms"] + queued_ms)
    p2s = b["preempt_to_start_s"]
    figures = {
        "preempt_to_start_s": round(statistics.median(p2s), 3),
        "preempt_to_start_s_all": [round(x, 3) for x in p2s],
        "victim_lost_steps": lost,
        "preemptions": len(preemptions),
        "forced_releases": sum(1 for p in preemptions if p["forced"]),
        "submit_ms_p50": round(statistics.median(submit_ms), 2),
        "submit_ms_max": round(submit_ms[-1], 2),
        "decision_ms_p99": round(float(decisions.get("p99", float("nan"))), 3),
        "decision_ms_p50": round(float(decisions.get("p50", float("nan"))), 3),
        "decision_cpu_ms_p99": round(float(decisions.get("cpu_p99", float("nan"))), 3),
        "decision_cpu_ms_max": round(float(decisions.get("cpu_max", float("nan"))), 3),
        "decision_slowest_cpu": decisions.get("slowest", []),
        "feed_ms_p99": round(float(decisions.get("feed_p99", float("nan"))), 3),
        "feed_ms_max": round(float(decisions.get("feed_max", float("nan"))), 3),
        "feed_slowest": decisions.get("feed_slowest", []),
        "inbox_slice_ms_p99": round(float(decisions.get("slice_p99", float("nan"))), 3),
        "inbox_slice_ms_max": round(float(decisions.get("slice_max", float("nan"))), 3),
        "decisions": int(decisions.get("n", 0)),
        "probe_ms_p99": round(1e3 * probe[min(len(probe) - 1, int(0.99 * len(probe)))], 3),
        "probe_cpu_ms": 1e3 * PROBE_CPU_S,
        "probes": len(probe),
        "overhead_ratio": overhead["ratio"],
        "overhead_ratio_per_round_median": overhead["ratio_per_round_median"],
        "peer_attempts": overhead["peer_attempts"],
        "peer_failed": overhead["peer_failed"],
        "rounds": rounds,
    }
    print(f"\n{'preempt_to_start_s (median)':32}{figures['preempt_to_start_s']:>10}   target <= 3")
    print(f"{'victim_lost_steps':32}{lost:>10}   target 0 "
          f"({len(preemptions)} preemptions, {figures['forced_releases']} forced)")
    print(f"{'submit_ms_p50':32}{figures['submit_ms_p50']:>10}   target <= 50")
    print(f"{'decision_ms_p99':32}{figures['decision_ms_p99']:>10}   "
          f"({figures['decisions']} events; CPU p99 {figures['decision_cpu_ms_p99']} ms, "
          f"max {figures['decision_cpu_ms_max']} ms: {figures['decision_slowest_cpu']})   "
          "target <= 10")
    print(f"{'probe_ms_p99':32}{figures['probe_ms_p99']:>10}   (the peer: "
          f"{figures['probe_cpu_ms']} ms of CPU on the same loop, {len(probe)} times)")
    print(f"{'inbox_slice_ms_p99':32}{figures['inbox_slice_ms_p99']:>10}   "
          f"(max {figures['inbox_slice_ms_max']} ms: queued events fed at once)")
    print(f"{'overhead_ratio':32}{figures['overhead_ratio']!s:>10}   target >= 0.97"
          + ("   (torchrun peer failed)" if figures["overhead_ratio"] is None else ""))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
