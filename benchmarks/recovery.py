"""Kill one rank's worker mid-run: how fast is training back, nbtrain vs torchrun?

The job: ``DigitsMLP`` (hidden 256, 2 layers, global batch 128), world size 2, a checkpoint
every ``--ckpt-every`` steps; rank 1's worker process is SIGKILLed at the start of step
``--kill-step``. Measured from the kill's wall time to the next completed step (rank 0's step
row in the next generation / attempt), on the same clock, in the same run:

- **nbtrain, warm spare**: ``connect(n_workers=3)``, a planned ``Fault("kill", rank=1, step=K)``.
  The survivor keeps its process; the new rank 1 goes to the spare slot. Before the round a
  3-step job runs on every slot, so the spare has run a rank before, as on a long-lived
  cluster (warm: torch, its optimizer machinery and gloo already loaded).
- **nbtrain, cold spare** (unless ``--no-cold``): the same with every worker restarted before
  the round, so the spare imports torch during recovery.
- **torchrun**: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` running
  ``_torchrun_recovery_peer.py`` (same model and data, synchronous checkpoint-resume); rank 1
  SIGKILLs itself at step K in the first attempt; each attempt uses a fresh TCPStore (see the
  peer's docstring for why).

Variants alternate order round by round; figures are medians over rounds. The breakdowns split
the recovery into consecutive parts that add up to it:

- nbtrain: detection (kill -> first failure seen), ending the generation and waiting for free
  slots (-> generation N+1 starts; with ``--no-spare`` this waits for the replacement
  worker), dispatch (-> rank task running on its worker), rank setup (rendezvous + recipe
  setup + restore, the slowest rank's), first step.
- torchrun: restart (agent notices, tears down, spawns), imports, rendezvous, setup (model,
  optimizer, data), restore (``torch.load``), DDP wrap (a parameter broadcast), first step.

Usage: ``python benchmarks/recovery.py [--quick] [--rounds N] [--no-cold] [--no-spare]``.
The last stdout line is one JSON object with detect_s, recovery_s, torchrun_recovery_s,
ratio_vs_torchrun, lost_steps, checkpoint_interval_steps and the breakdowns. A round whose
torchrun peer fails twice (``benchmarks/_peers.py``: retried once with fresh ports) is left
out of the torchrun figures (``torchrun_rounds`` counts the others, ``peer_failed`` says
why; with none left they and the ratios are null); the exit status stays 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask.config
from _peers import PeerAttempt, PeerResult, peer_figures, ratio, run_peer

import nbtrain
from nbtrain import Fault
from nbtrain.examples import DigitsMLP

HERE = Path(__file__).resolve().parent
WORLD = 2


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _prepare_slots(cluster: nbtrain.Cluster, recipe: DigitsMLP, n: int, cold: bool) -> None:
    """Every slot free, and either warm (each worker has run a rank, as on a long-lived
    cluster) or cold (fresh worker processes that have imported nothing)."""
    _wait(lambda: len(cluster.free_slots) == len(cluster.slots) == n, 120, f"{n} free slots")
    if cold:
        old = set(cluster.slots)
        # Returns once the nannies have restarted them; the inventory catches up a bit later.
        cluster.client.restart_workers(sorted(old), timeout=180, raise_for_error=False)
        _wait(lambda: len(cluster.free_slots) == n and not set(cluster.free_slots) & old, 180,
              "the restarted workers in nbtrain's slot inventory")
    else:
        # Importing torch is not enough: the first optimizer built in a process also imports
        # torch._dynamo (~1 s here). A short job on every slot warms all of it.
        cluster.submit(recipe, world_size=n, steps=3, checkpoint=None,
                       name="recovery-warmup").result(timeout=300)
        _wait(lambda: len(cluster.free_slots) == n, 120, f"{n} free slots after the warm-up")


def run_nbtrain(cluster: nbtrain.Cluster, args: argparse.Namespace, n_slots: int, cold: bool,
                name: str) -> dict[str, Any]:
    recipe = DigitsMLP(hidden=args.hidden, layers=args.layers, batch_size=args.batch,
                       eval_every=0)
    _prepare_slots(cluster, recipe, n_slots, cold)
    job = cluster.submit(recipe, world_size=WORLD, steps=args.steps, name=name,
                         checkpoint=args.ckpt_every, max_restarts=1,
                         faults=[Fault("kill", rank=1, step=args.kill_step)])
    job.result(timeout=600)
    return analyse_nbtrain(job)


def analyse_nbtrain(job: nbtrain.JobHandle) -> dict[str, Any]:
    events = job.events
    faults = job.faults
    if len(faults) != 1 or job.restarts != 1:
        raise RuntimeError(f"expected exactly one fault and one restart, got {faults}")
    fault = faults[0]
    killed = next(e for e in events if e["kind"] == "fault_injected")
    when = float(killed["when"])
    gen = int(fault["generation"]) + 1
    starting = next(e for e in events if e["kind"] == "state" and e["state"] == "STARTING"
                    and str(e["reason"]).startswith(f"generation {gen}:"))
    started = [e for e in events if e["kind"] == "rank_started" and e["generation"] == gen]
    last = max(started, key=lambda e: float(e["time"]))
    m = job.metrics
    first_step = float(m[(m["generation"] == gen) & (m["rank"] == 0)]["time"].min())
    recovery = next(e for e in events if e["kind"] == "recovery")
    t_fault, t_start, t_ranks = float(fault["time"]), float(starting["time"]), float(last["time"])
    setup = float(last["startup_s"])
    goodput = job.goodput()
    return {
        "detect_s": float(fault["detect_s"]),
        "recovery_s": first_step - when,
        "engine_recovery_s": recovery["recovery_s"],  # the engine's own: detection -> steps seen
        "lost_steps": int(fault["lost_steps"]),
        "resume_step": int(fault["resume_step"]),
        "goodput_fraction": goodput["fraction"],
        "breakdown": {
            "detection_s": t_fault - when,
            "end_generation_wait_slots_s": t_start - t_fault,
            "dispatch_s": t_ranks - t_start - setup,
            "rank_setup_s": setup,
            "first_step_s": first_step - t_ranks,
        },
    }


def run_torchrun(args: argparse.Namespace, attempt: PeerAttempt) -> dict[str, Any]:
    out = attempt.workdir
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(WORLD), "--max-restarts", "1",
           str(HERE / "_torchrun_recovery_peer.py"), "--dir", str(out),
           "--store-port", str(attempt.port_block(2)),  # the stores of attempts 0 and 1
           "--steps", str(args.steps),
           "--kill-step", str(args.kill_step), "--ckpt-every", str(args.ckpt_every),
           "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--batch", str(args.batch)]
    attempt.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600,
                what="torchrun peer")
    if not (out / "attempt-1.json").exists():
        raise attempt.error("torchrun peer exited 0 without restarting")
    kill = json.loads((out / "kill.json").read_text())
    a = json.loads((out / "attempt-1.json").read_text())
    when = float(kill["when"])
    return {
        "recovery_s": a["first_step"] - when,
        "lost_steps": int(kill["step"]) - int(a["start_step"]),
        "resume_step": int(a["start_step"]),
        "breakdown": {
            "restart_s": a["start"] - when,
            "imports_s": a["imported"] - a["start"],
            "rendezvous_s": a["process_group"] - a["imported"],
            "setup_s": a["built"] - a["process_group"],
            "restore_s": a["loaded"] - a["built"],
            "ddp_wrap_s": a["restored"] - a["loaded"],
            "first_step_s": a["first_step"] - a["restored"],
        },
    }


def _median_breakdown(results: list[dict[str, Any]]) -> dict[str, float]:
    keys = results[0]["breakdown"].keys()
    return {k: round(statistics.median(r["breakdown"][k] for r in results), 4) for k in keys}


def _med(results: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in results)


def _print_breakdown(title: str, results: list[dict[str, Any]]) -> None:
    print(f"\n{title} (median s)")
    for k, v in _median_breakdown(results).items():
        print(f"  {k:28}{v:8.3f}")
    print(f"  {'= kill to next step':28}{_med(results, 'recovery_s'):8.3f}")


def _fmt(x: float | None, spec: str) -> str:
    """``x`` formatted, or "-" right-aligned to the spec's width when there is none."""
    if x is None:
        width = spec.split(".")[0].rstrip("df")
        return "-".rjust(int(width)) if width.isdigit() else "-"
    return format(x, spec)


def _secs(result: dict[str, Any] | None) -> str:
    return " failed" if result is None else f"{result['recovery_s']:6.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds (default: 5)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-step", type=int, default=56)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--no-cold", action="store_true",
                        help="skip the cold-spare nbtrain variant")
    parser.add_argument("--no-spare", action="store_true",
                        help="2 workers, no spare: the next generation waits for the killed "
                             "worker's replacement")
    args = parser.parse_args()
    if not 1 < args.kill_step <= args.steps:
        parser.error(f"--kill-step must be in 2..{args.steps}, got {args.kill_step}")
    rounds = args.rounds or (3 if args.quick else 5)
    n_slots = WORLD if args.no_spare else WORLD + 1
    variants = ["nbtrain", "torchrun"] + ([] if args.no_cold else ["nbtrain_cold"])
    # A round's entry is None where its torchrun peer failed twice (see benchmarks/_peers.py).
    results: dict[str, list[dict[str, Any] | None]] = {v: [] for v in variants}
    peer_runs: list[PeerResult[dict[str, Any]]] = []
    # A LocalCluster closes a worker's nanny for good when no worker of that name is back
    # ``lost-worker-timeout`` (15 s) after a removal; the timer of an earlier removal (our kill)
    # also fires while a later restart (the cold round's) is in progress, and the slot is lost.
    # Rounds here restart workers soon after kills, so the timer is set out of the way.
    dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"})
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        settings = nbtrain.Settings.load(checkpoint_root=root)
        with nbtrain.connect(n_workers=n_slots, settings=settings) as cluster:
            for i in range(rounds):
                # Rotate the order so drift in machine load hits every variant alike.
                order = variants[i % len(variants):] + variants[:i % len(variants)]
                for which in order:
                    if which == "torchrun":
                        peer_runs.append(run_peer(
                            "torchrun", functools.partial(run_torchrun, args)))
                        results[which].append(peer_runs[-1].value)
                    else:
                        results[which].append(run_nbtrain(
                            cluster, args, n_slots, cold=which == "nbtrain_cold",
                            name=f"recovery-{which}-{i}"))
                line = "   ".join(f"{v} {_secs(results[v][-1])}" for v in variants)
                print(f"round {i + 1}/{rounds}: kill to next step: {line}", flush=True)
    ours = [r for r in results["nbtrain"] if r is not None]
    peer = [r for r in results["torchrun"] if r is not None]
    rec = _med(ours, "recovery_s")
    peer_rec = _med(peer, "recovery_s") if peer else None
    detect = _med(ours, "detect_s")
    lost = max(int(r["lost_steps"]) for r in ours)
    peer_lost = max(int(r["lost_steps"]) for r in peer) if peer else None
    rec_ratio = ratio(rec, peer_rec)
    per_round = [a["recovery_s"] / b["recovery_s"]
                 for a, b in zip(results["nbtrain"], results["torchrun"], strict=True)
                 if a is not None and b is not None]
    spare = "none" if args.no_spare else "warm (every slot ran a 3-step job first)"
    _print_breakdown(f"nbtrain, spare slot: {spare}", ours)
    cold = [r for r in results.get("nbtrain_cold", []) if r is not None]
    if cold:
        _print_breakdown("nbtrain, cold spare (fresh worker processes)", cold)
    if peer:
        _print_breakdown("torchrun --max-restarts 1", peer)
    targets = {"detect_s<=1": detect <= 1.0,
               "ratio_vs_torchrun<=0.5": None if rec_ratio is None else rec_ratio <= 0.5,
               "lost_steps<=checkpoint_interval_steps": lost <= args.ckpt_every}
    print(f"\n{'':30}{'nbtrain':>10}{'torchrun':>10}")
    print(f"{'kill to next step (median s)':30}{rec:10.3f}{_fmt(peer_rec, '10.3f')}   ratio "
          f"{_fmt(rec_ratio, '.3f')}")
    print(f"{'detection (median s)':30}{detect:10.3f}")
    print(f"{'lost steps (max over rounds)':30}{lost:10d}{_fmt(peer_lost, '10d')}"
          f"   checkpoint every {args.ckpt_every} steps")
    print("targets: " + ", ".join(
        f"{k} {'met' if ok else 'MISSED' if ok is not None else 'unknown (no peer)'}"
        for k, ok in targets.items()) + f"; wall {time.monotonic() - t0:.0f} s")
    figures: dict[str, Any] = {
        "detect_s": round(detect, 4),
        "recovery_s": round(rec, 4),
        "torchrun_recovery_s": None if peer_rec is None else round(peer_rec, 4),
        "ratio_vs_torchrun": rec_ratio,
        "ratio_per_round_median": round(statistics.median(per_round), 4) if per_round else None,
        "lost_steps": lost,
        "torchrun_lost_steps": peer_lost,
        "checkpoint_interval_steps": args.ckpt_every,
        "kill_step": args.kill_step,
        "engine_recovery_s": round(_med(ours, "engine_recovery_s"), 4),
        "goodput_fraction": round(_med(ours, "goodput_fraction"), 4),
        "breakdown": _median_breakdown(ours),
        "torchrun_breakdown": _median_breakdown(peer) if peer else None,
        "torchrun_rounds": len(peer),
        **peer_figures(peer_runs),
        "spare": spare,
        "targets_met": targets,
        "rounds": rounds, "steps": args.steps, "world_size": WORLD, "slots": n_slots,
        "model": {"hidden": args.hidden, "layers": args.layers, "global_batch": args.batch},
    }
    if cold:
        figures["cold_spare_recovery_s"] = round(_med(cold, "recovery_s"), 4)
        figures["cold_spare_ratio_vs_torchrun"] = ratio(_med(cold, "recovery_s"), peer_rec)
        figures["cold_spare_breakdown"] = _median_breakdown(cold)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
