"""nbtrain's step rate against a plain torchrun DDP script, same model and data, world size 2.

Rounds alternate nbtrain and torchrun in one run; each round's rate is taken over the steady
state only (the first 25% of steps dropped), and the figures are medians over rounds.
Usage: ``python benchmarks/overhead.py [--quick] [--rounds N] [--steps N]``.
Last stdout line: JSON with nbtrain_steps_per_s, torchrun_steps_per_s, ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import nbtrain
from nbtrain.examples import DigitsMLP

HERE = Path(__file__).resolve().parent


def steady_rate(times: list[float]) -> float:
    t = times[len(times) // 4:]
    return (len(t) - 1) / (t[-1] - t[0])


def run_nbtrain(cluster: nbtrain.Cluster, steps: int, hidden: int, layers: int,
                batch: int) -> float:
    recipe = DigitsMLP(hidden=hidden, layers=layers, batch_size=batch, eval_every=0)
    # No checkpoints: the torchrun peer takes none either (checkpoint cost is measured by
    # benchmarks/checkpoint.py).
    job = cluster.submit(recipe, world_size=2, steps=steps, name="overhead", checkpoint=None)
    job.result(timeout=600)
    m = job.metrics
    return steady_rate(m[m["rank"] == 0].sort_values("step")["time"].tolist())


def run_torchrun(steps: int, hidden: int, layers: int, batch: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", str(HERE / "_torchrun_peer.py"), "--steps", str(steps),
               "--out", str(out), "--hidden", str(hidden), "--layers", str(layers),
               "--batch", str(batch)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=600)
        return steady_rate(json.loads(out.read_text()))


def compare(cluster: nbtrain.Cluster, rounds: int, steps: int, hidden: int = 512,
            layers: int = 3, batch: int = 256, log: bool = True) -> dict[str, object]:
    """Alternating rounds of nbtrain on ``cluster`` and torchrun; medians and their ratio."""
    shape = (hidden, layers, batch)
    ours: list[float] = []
    peer: list[float] = []
    run_nbtrain(cluster, 30, *shape)  # warm the workers' imports once
    for i in range(rounds):
        # Alternate which goes first so drift in machine load hits both alike.
        order = ("nbtrain", "torchrun") if i % 2 == 0 else ("torchrun", "nbtrain")
        for which in order:
            if which == "nbtrain":
                ours.append(run_nbtrain(cluster, steps, *shape))
            else:
                peer.append(run_torchrun(steps, *shape))
        if log:
            print(f"round {i + 1}/{rounds}: nbtrain {ours[-1]:7.1f} steps/s   "
                  f"torchrun {peer[-1]:7.1f} steps/s   ratio {ours[-1] / peer[-1]:.3f}",
                  flush=True)
    a, b = statistics.median(ours), statistics.median(peer)
    ratios = [x / y for x, y in zip(ours, peer, strict=True)]
    return {"nbtrain_steps_per_s": round(a, 2), "torchrun_steps_per_s": round(b, 2),
            "ratio": round(a / b, 4),
            "ratio_per_round_median": round(statistics.median(ratios), 4),
            "ratios": [round(r, 4) for r in ratios]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 300 steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or (300 if args.quick else 1000)
    tmp = tempfile.TemporaryDirectory(prefix="nbtrain-overhead-")
    settings = nbtrain.Settings.load(checkpoint_root=tmp.name)
    with tmp, nbtrain.connect(n_workers=2, settings=settings) as cluster:
        figures = compare(cluster, rounds, steps, args.hidden, args.layers, args.batch)
    a, b = figures["nbtrain_steps_per_s"], figures["torchrun_steps_per_s"]
    ratios = figures.pop("ratios")
    print(f"\n{'':12}{'median steps/s':>16}\n{'nbtrain':12}{a:16.1f}\n{'torchrun':12}{b:16.1f}"
          f"\nratio (median of medians) {figures['ratio']:.3f}; per-round ratios "
          f"{', '.join(f'{r:.3f}' for r in ratios)}")  # type: ignore[attr-defined]
    print(json.dumps({
        **figures, "rounds": rounds, "steps_per_round": steps, "world_size": 2,
        "model": {"hidden": args.hidden, "layers": args.layers, "global_batch": args.batch},
    }))


if __name__ == "__main__":
    main()
