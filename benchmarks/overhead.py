"""nbtrain's step rate against a plain torchrun DDP script, same model and data, world size 2.

Three contenders per round, in a rotating order: nbtrain with a ``Recipe`` (nbtrain's loop),
nbtrain with a training function (the user's own loop over ``ctx.batches``), and torchrun.
Each round's rate is taken over the steady state only (the first 25% of steps dropped), and
the figures are medians over rounds.
Usage: ``python benchmarks/overhead.py [--quick] [--rounds N] [--steps N] [--peer-env dask]``.
The torchrun peer runs in the environment this process had before ``connect()``, as a
user's ``torchrun`` would, not with the variables Dask's nanny adds.
Last stdout line: JSON with nbtrain_steps_per_s, function_steps_per_s, torchrun_steps_per_s,
ratio (Recipe over torchrun) and function_ratio (function over torchrun).
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
from nbtrain.examples import DigitsMLP, digits_train

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


def run_function(cluster: nbtrain.Cluster, steps: int, hidden: int, layers: int,
                 batch: int) -> float:
    config = {"hidden": hidden, "layers": layers, "batch_size": batch}
    job = cluster.submit(digits_train, world_size=2, steps=steps, name="overhead-fn",
                         config=config, checkpoint=None)
    job.result(timeout=600)
    m = job.metrics
    return steady_rate(m[m["rank"] == 0].sort_values("step")["time"].tolist())


#: The environment before ``connect()``: what a user's ``torchrun`` gets. Dask's nanny writes
#: its ``pre-spawn-environ`` (``MALLOC_TRIM_THRESHOLD_=65536``, which makes PyTorch's CPU
#: steps much slower, see ``nbtrain.engine.workers.tune_malloc``) into this process's
#: environment when it starts a worker, so a peer started later would inherit it.
PLAIN_ENV = dict(os.environ)


def run_torchrun(steps: int, hidden: int, layers: int, batch: int,
                 env: dict[str, str] | None = None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", str(HERE / "_torchrun_peer.py"), "--steps", str(steps),
               "--out", str(out), "--hidden", str(hidden), "--layers", str(layers),
               "--batch", str(batch)]
        env = dict(PLAIN_ENV if env is None else env, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=600)
        return steady_rate(json.loads(out.read_text()))


def compare(cluster: nbtrain.Cluster, rounds: int, steps: int, hidden: int = 512,
            layers: int = 3, batch: int = 256, log: bool = True,
            peer_env: dict[str, str] | None = None) -> dict[str, object]:
    """Rounds of nbtrain (Recipe and function) on ``cluster`` and torchrun, in rotating
    order so drift in machine load hits all alike; medians and ratios. ``peer_env``: the
    torchrun peer's environment (default: this process's before ``connect()``)."""
    shape = (hidden, layers, batch)
    runners = {"nbtrain": lambda: run_nbtrain(cluster, steps, *shape),
               "function": lambda: run_function(cluster, steps, *shape),
               "torchrun": lambda: run_torchrun(steps, *shape, env=peer_env)}
    rates: dict[str, list[float]] = {k: [] for k in runners}
    run_nbtrain(cluster, 30, *shape)  # warm the workers' imports once
    names = list(runners)
    for i in range(rounds):
        for which in names[i % 3:] + names[: i % 3]:
            rates[which].append(runners[which]())
        if log:
            peer = rates["torchrun"][-1]
            print(f"round {i + 1}/{rounds}: nbtrain {rates['nbtrain'][-1]:7.1f}  function "
                  f"{rates['function'][-1]:7.1f}  torchrun {peer:7.1f} steps/s   ratios "
                  f"{rates['nbtrain'][-1] / peer:.3f} {rates['function'][-1] / peer:.3f}",
                  flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    per_round = [x / y for x, y in zip(rates["nbtrain"], rates["torchrun"], strict=True)]
    per_round_fn = [x / y for x, y in zip(rates["function"], rates["torchrun"], strict=True)]
    return {"nbtrain_steps_per_s": round(med["nbtrain"], 2),
            "function_steps_per_s": round(med["function"], 2),
            "torchrun_steps_per_s": round(med["torchrun"], 2),
            "ratio": round(med["nbtrain"] / med["torchrun"], 4),
            "function_ratio": round(med["function"] / med["torchrun"], 4),
            "ratio_per_round_median": round(statistics.median(per_round), 4),
            "function_ratio_per_round_median": round(statistics.median(per_round_fn), 4),
            "ratios": [round(r, 4) for r in per_round],
            "function_ratios": [round(r, 4) for r in per_round_fn]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 300 steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--peer-env", choices=("plain", "dask"), default="plain",
                        help="the torchrun peer's environment: as before connect() (a user's "
                        "shell; default), or with what Dask's nanny adds to it (what this "
                        "benchmark used before, MALLOC_TRIM_THRESHOLD_ included)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or (300 if args.quick else 1000)
    tmp = tempfile.TemporaryDirectory(prefix="nbtrain-overhead-")
    settings = nbtrain.Settings.load(checkpoint_root=tmp.name)
    with tmp, nbtrain.connect(n_workers=2, settings=settings) as cluster:
        peer_env = dict(os.environ) if args.peer_env == "dask" else PLAIN_ENV
        figures = compare(cluster, rounds, steps, args.hidden, args.layers, args.batch,
                          peer_env=peer_env)
    ratios = figures.pop("ratios")
    figures.pop("function_ratios")
    print(f"\n{'':12}{'median steps/s':>16}")
    for label, key in (("nbtrain", "nbtrain_steps_per_s"), ("function", "function_steps_per_s"),
                       ("torchrun", "torchrun_steps_per_s")):
        print(f"{label:12}{figures[key]:16.1f}")
    print(f"ratio (median of medians) {figures['ratio']:.3f}, function "
          f"{figures['function_ratio']:.3f}; per-round ratios "
          f"{', '.join(f'{r:.3f}' for r in ratios)}")  # type: ignore[attr-defined]
    print(json.dumps({
        **figures, "rounds": rounds, "steps_per_round": steps, "world_size": 2,
        "peer_env": args.peer_env,
        "model": {"hidden": args.hidden, "layers": args.layers, "global_batch": args.batch},
    }))


if __name__ == "__main__":
    main()
