"""``nbtrain demo``: train an MLP on the bundled digits on an embedded local cluster."""

from __future__ import annotations

import argparse
import tempfile
import time

import nbtrain
from nbtrain.examples import DigitsMLP
from nbtrain.ui.text import follow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nbtrain demo", description=__doc__)
    parser.add_argument("--workers", type=int, default=2, help="worker processes = slots (2)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks of the job (default: all workers)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (300)")
    parser.add_argument("--progress-interval", type=float, default=1.0,
                        help="seconds between progress lines (1.0)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="keep checkpoints here (default: a temporary directory)")
    args = parser.parse_args(argv)
    world = args.world_size or args.workers
    if args.workers < 1 or world < 1 or args.steps < 1:
        parser.error("--workers, --world-size and --steps must be positive")
    print(f"nbtrain demo: starting a local cluster with {args.workers} worker processes ...",
          flush=True)
    t0 = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="nbtrain-demo-")
    settings = nbtrain.Settings.load(checkpoint_root=args.checkpoint_dir or tmp.name)
    with tmp, nbtrain.connect(n_workers=args.workers, settings=settings) as cluster:
        print(f"cluster up in {time.perf_counter() - t0:.1f} s: {len(cluster.slots)} slots",
              flush=True)
        job = cluster.submit(DigitsMLP(), world_size=world, steps=args.steps, name="digits")
        follow(job, interval_s=args.progress_interval)
        state = job.status
        m = job.metrics
        if not m.empty:
            main_rank = m[m["rank"] == 0]
            steady = main_rank.iloc[len(main_rank) // 5:]
            print("\nsummary")
            print(f"  state            {state.value}")
            print(f"  steps            {job.step}")
            if len(steady) > 1:
                rate = (len(steady) - 1) / (steady['time'].iloc[-1] - steady['time'].iloc[0])
                print(f"  steps/s          {rate:.1f} (steady state, rank 0)")
            for col in ("loss", "val_acc"):
                if col in main_rank and main_rank[col].notna().any():
                    print(f"  final {col:<10} {main_rank[col].dropna().iloc[-1]:.4f}")
            phases = m.groupby("rank")[["data_s", "compute_s", "comm_s", "opt_s"]].median()
            print("  median phase times per rank (ms):")
            print((phases * 1000).round(2).to_string().replace("\n", "\n    "))
        if job.error:
            print(job.error)
    return 0 if state is nbtrain.JobState.SUCCEEDED else 1


if __name__ == "__main__":
    raise SystemExit(main())
