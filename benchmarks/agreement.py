"""What the asynchronous control agreement saves an HF job (world size 2), against the same
code made to wait for the agreement's all-reduce where it is offered (the blocking agreement
nbtrain had before 2026-12-06), in alternating rounds of the same cluster, with the HF
``Trainer`` under ``torchrun --nproc-per-node 2`` in each round for scale.

Figures (last stdout line, JSON): ``async_steps_per_s``, ``blocking_steps_per_s`` and
``torchrun_steps_per_s`` (medians over rounds of each run's steady rate, the first 25% of
its steps dropped), ``async_over_blocking`` (the ratio of those medians) and
``pair_ratios`` (each round's async rate over its blocking rate: how far one figure can be
trusted; rates move by 10-15% between runs on a shared 2-core machine).

Usage: ``python benchmarks/agreement.py [--quick] [--rounds N] [--steps N]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _peers import run_peer
from frameworks import N_EMBD, run_torchrun_hf
from overhead import steady_rate

import nbtrain
from nbtrain.framework_examples import hf_trainer_train


def blocking_hf(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    """The HF job with every agreement waited for at the boundary that offers it."""
    from nbtrain.runtime.control import ControlChannel

    offer = ControlChannel.offer

    def wait_at_offer(self: ControlChannel, *args: Any, **kwargs: Any) -> None:
        offer(self, *args, **kwargs)
        self._work.wait()

    ControlChannel.offer = wait_at_offer  # type: ignore[method-assign]
    try:
        return hf_trainer_train(ctx, config)
    finally:
        ControlChannel.offer = offer  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 60 steps (else 6 of 300)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    rounds, steps = (2, 60) if args.quick else (6, 300)
    rounds, steps = args.rounds or rounds, args.steps or steps
    root = Path(tempfile.mkdtemp(prefix="nbtrain-agreement-"))
    rates: dict[str, list[float]] = {"async": [], "blocking": [], "torchrun": []}
    fns = {"async": hf_trainer_train, "blocking": blocking_hf}
    with nbtrain.connect(n_workers=2, settings=nbtrain.Settings.load(
            checkpoint_root=str(root / "checkpoints"))) as cluster:
        warm = cluster.submit(hf_trainer_train, world_size=2, steps=20, checkpoint=None,
                              config={"work_dir": str(root / "warm"), "n_embd": N_EMBD})
        warm.result(timeout=600)  # the workers import transformers once
        names = list(rates)
        for i in range(rounds):
            for name in names[i % 3:] + names[:i % 3]:
                if name == "torchrun":
                    peer = run_peer("torchrun-hf", functools.partial(run_torchrun_hf, steps))
                    if peer.value is not None:
                        rates[name].append(peer.value)
                    continue
                job = cluster.submit(fns[name], world_size=2, steps=steps, checkpoint=None,
                                     name=f"{name}-{i}", config={
                                         "work_dir": str(root / f"{name}-{i}"),
                                         "n_embd": N_EMBD})
                rates[name].append(steady_rate(job.result(timeout=600)["step_times"]))
            print(f"round {i + 1}/{rounds}: " + ", ".join(
                f"{n} {v[-1]:.1f} steps/s" for n, v in rates.items() if v), flush=True)
    med = {n: statistics.median(v) if v else None for n, v in rates.items()}
    figures = {
        "async_steps_per_s": round(med["async"] or 0.0, 2),
        "blocking_steps_per_s": round(med["blocking"] or 0.0, 2),
        "torchrun_steps_per_s": round(med["torchrun"], 2) if med["torchrun"] else None,
        "async_over_blocking": round((med["async"] or 0.0) / (med["blocking"] or 1.0), 4),
        "pair_ratios": [round(a / b, 3) for a, b in zip(rates["async"], rates["blocking"],
                                                         strict=True)],
        "rounds": rounds, "steps": steps,
    }
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
