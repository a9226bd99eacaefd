"""nbtrain's step rate against a plain torchrun DDP script, same model and data, world size 2.

Three contenders per round, in a rotating order: nbtrain with a ``Recipe`` (nbtrain's loop),
nbtrain with a training function (the user's own loop over ``ctx.batches``), and torchrun.
Each round's rate is taken over the steady state only (the first 25% of steps dropped), and
the figures are medians over rounds.
Usage: ``python benchmarks/overhead.py [--quick] [--rounds N] [--steps N] [--peer-env dask]``.
The torchrun peer runs in the environment this process had before ``connect()``, as a
user's ``torchrun`` would, not with the variables Dask's nanny adds.
Last stdout line: JSON with nbtrain_steps_per_s, function_steps_per_s, torchrun_steps_per_s,
ratio (Recipe over torchrun) and function_ratio (function over torchrun). A torchrun run that
fails is tried once more (``benchmarks/_peers.py``); a round whose peer fails twice has no
torchrun rate (``peer_failed`` says why, the figures that need it are over the other rounds
or null) and the exit status stays 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _peers import PeerAttempt, PeerResult, peer_figures, ratio, run_peer

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


def run_torchrun(steps: int, hidden: int, layers: int, batch: int, env: dict[str, str] | None,
                 attempt: PeerAttempt) -> float:
    """One attempt of the torchrun peer (see ``run_peer``): its steady rate."""
    out = attempt.workdir / "times.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(HERE / "_torchrun_peer.py"), "--steps", str(steps),
           "--out", str(out), "--hidden", str(hidden), "--layers", str(layers),
           "--batch", str(batch)]
    attempt.run(cmd, env=dict(PLAIN_ENV if env is None else env, OMP_NUM_THREADS="1"),
                timeout=600, what="torchrun peer")
    return steady_rate(json.loads(out.read_text()))


def compare(cluster: nbtrain.Cluster, rounds: int, steps: int, hidden: int = 512,
            layers: int = 3, batch: int = 256, log: bool = True,
            peer_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Rounds of nbtrain (Recipe and function) on ``cluster`` and torchrun, in rotating
    order so drift in machine load hits all alike; medians and ratios. ``peer_env``: the
    torchrun peer's environment (default: this process's before ``connect()``).

    A round whose torchrun run fails twice (``benchmarks/_peers.py``) has no torchrun rate:
    the torchrun median and the ratios are over the other rounds, null when none is left;
    ``peer_attempts``/``peer_failed`` say what happened."""
    shape = (hidden, layers, batch)
    ours: dict[str, list[float]] = {"nbtrain": [], "function": []}
    peer: list[float | None] = []  # None: that round's peer failed twice
    peer_runs: list[PeerResult[float]] = []

    def torchrun() -> None:
        peer_runs.append(run_peer("torchrun", functools.partial(
            run_torchrun, steps, *shape, peer_env)))
        peer.append(peer_runs[-1].value)

    runners: dict[str, Callable[[], None]] = {
        "nbtrain": lambda: ours["nbtrain"].append(run_nbtrain(cluster, steps, *shape)),
        "function": lambda: ours["function"].append(run_function(cluster, steps, *shape)),
        "torchrun": torchrun}
    run_nbtrain(cluster, 30, *shape)  # warm the workers' imports once
    names = list(runners)
    for i in range(rounds):
        for which in names[i % 3:] + names[: i % 3]:
            runners[which]()
        if log:
            x, y, z = ours["nbtrain"][-1], ours["function"][-1], peer[-1]
            print(f"round {i + 1}/{rounds}: nbtrain {x:7.1f}  function {y:7.1f}  torchrun "
                  + (f"{z:7.1f} steps/s   ratios {x / z:.3f} {y / z:.3f}" if z is not None
                     else " failed"), flush=True)
    med = {k: statistics.median(v) for k, v in ours.items()}
    got = [z for z in peer if z is not None]
    med_peer = statistics.median(got) if got else None
    pairs = [(x, y, z) for x, y, z in zip(ours["nbtrain"], ours["function"], peer, strict=True)
             if z is not None]
    per_round = [x / z for x, _, z in pairs]
    per_round_fn = [y / z for _, y, z in pairs]
    return {"nbtrain_steps_per_s": round(med["nbtrain"], 2),
            "function_steps_per_s": round(med["function"], 2),
            "torchrun_steps_per_s": None if med_peer is None else round(med_peer, 2),
            "ratio": ratio(med["nbtrain"], med_peer),
            "function_ratio": ratio(med["function"], med_peer),
            "ratio_per_round_median": (round(statistics.median(per_round), 4) if per_round
                                       else None),
            "function_ratio_per_round_median": (round(statistics.median(per_round_fn), 4)
                                                if per_round_fn else None),
            "ratios": [round(r, 4) for r in per_round],
            "function_ratios": [round(r, 4) for r in per_round_fn],
            "torchrun_rounds": len(got),
            **peer_figures(peer_runs)}


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
        value = figures[key]
        print(f"{label:12}" + (f"{value:16.1f}" if value is not None else f"{'failed':>16}"))
    print(f"ratio (median of medians) {figures['ratio']}, function "
          f"{figures['function_ratio']}; per-round ratios "
          f"{', '.join(f'{r:.3f}' for r in ratios)}")
    print(json.dumps({
        **figures, "rounds": rounds, "steps_per_round": steps, "world_size": 2,
        "peer_env": args.peer_env,
        "model": {"hidden": args.hidden, "layers": args.layers, "global_batch": args.batch},
    }))


if __name__ == "__main__":
    main()
