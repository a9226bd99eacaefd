"""nbtrain on a real one-node Slurm through dask-jobqueue: scaling from the queue, walltime.

Starts Debian's ``slurmctld`` + ``slurmd`` on this machine (``tests/slurm_local.py``; root
and the ``slurm-wlm``/``munge`` packages needed), then, in the same run:

- **Dask's own adapt (the peer)**: ``SLURMCluster.adapt(minimum=0, maximum=2)`` with a queued
  2-rank nbtrain job, for ``--peer-s`` seconds: how many workers Slurm was asked for (Dask
  sizes from Dask tasks; a queued gang has none).
- **nbtrain's** ``cluster.adapt(minimum=0, maximum=3)``: from an empty cluster a 2-rank
  job queues; the policy asks Slurm for the gang; one worker has a lifetime (dask-jobqueue's
  ``--lifetime``, set below a walltime) that ends mid-job; the job checkpoints, moves to the
  survivor and a worker Slurm starts for it, and finishes.

Figures: ``queued_to_first_step_s`` (submit on an empty cluster -> the job's first step,
Slurm's scheduling and the workers' start included), ``walltime_lost_committed_steps``
(committed steps before the walltime's preemption that the next generation did not start
from: 0), ``params_equal`` (against an uninterrupted single-process float64 run),
``reserved_slots_retired`` (workers the adaptive policy retired while a job waited: 0),
``walltime_move_s`` (preemption -> the next generation's first step), ``dask_adapt_workers``
(the peer's workers asked for). Usage: ``python benchmarks/slurm.py [--quick]``; the last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cloudpickle

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain import JobState  # noqa: E402
from nbtrain.engine.adaptive import QueueAdaptive  # noqa: E402
from tests import recipes  # noqa: E402
from tests.recipes import Regression, single_process_params  # noqa: E402
from tests.slurm_local import LocalSlurm, slurm_cluster  # noqa: E402

cloudpickle.register_pickle_by_value(recipes)  # the workers cannot import tests/


class CountingAdaptive(QueueAdaptive):
    """QueueAdaptive that records every retirement with whether a job was waiting then."""

    retired_while_waiting = 0
    retired = 0

    async def scale_down(self, workers: Any) -> None:
        reply = await self.scheduler.nbtrain_autoscale(kind=self.kind)
        if workers and (reply.get("reserved") or reply.get("asked")):
            CountingAdaptive.retired_while_waiting += len(workers)
        CountingAdaptive.retired += len(list(workers or ()))
        await super().scale_down(workers)


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def peer(root: Path, seconds: float) -> int:
    """Dask's own adapt with a queued gang: the workers it asked Slurm for."""
    manager = slurm_cluster(root, root / "no-lifetime")
    try:
        with nbtrain.connect(manager) as cluster:
            manager.adapt(minimum=0, maximum=2, interval="200ms")
            job = cluster.submit(Regression(), world_size=2, steps=5, checkpoint=None)
            asked = 0
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                asked = max(asked, len(manager.plan))
                time.sleep(0.2)
            job.stop()
            return asked
    finally:
        manager.close()


def nbtrain_run(root: Path, steps: int, lifetime: str) -> dict[str, Any]:
    (root / "lifetime").write_text(lifetime)
    fast = root / "fast"
    out = root / "out"
    out.mkdir()
    manager = slurm_cluster(root, root / "lifetime")
    try:
        with nbtrain.connect(manager) as cluster:
            cluster.adapt(minimum=0, maximum=3, idle_s=1.0, interval="200ms", wait_count=2,
                          Adaptive=CountingAdaptive)
            t0 = time.monotonic()
            job = cluster.submit(Regression(out_dir=str(out), step_sleep=0.05,
                                            slow_until=str(fast)),
                                 world_size=2, steps=steps, checkpoint=10)
            wait_for(lambda: job.step >= 1, 180, "the first step")
            first = time.monotonic() - t0
            wait_for(lambda: any(e["kind"] == "preemption" for e in job.events), 180,
                     "the walltime's preemption")
            fast.touch()
            state = job.wait(300)
            events = job.events
            wait_for(lambda: not manager.scheduler_info["workers"], 60, "idle workers retired")
    finally:
        manager.close()
    [pre] = [e for e in events if e["kind"] == "preemption"]
    committed = max((int(e["step"]) for e in events if e["kind"] == "checkpoint"
                     and e.get("phase") == "committed" and e.get("generation") == 0),
                    default=0)
    started = {e["generation"]: e["start_step"] for e in events if e["kind"] == "rank_started"}
    resumed_at = started.get(1, 0)
    moved = [e["time"] for e in events if e["kind"] == "state" and e.get("state") == "RUNNING"]
    expected = single_process_params(steps)
    equal = state is JobState.SUCCEEDED and all(
        torch.equal(torch.load(out / f"rank{r}.pt")[k], v) or
        torch.allclose(torch.load(out / f"rank{r}.pt")[k], v, rtol=0, atol=1e-6)
        for r in (0, 1) for k, v in expected.items())
    return {
        "state": state.value,
        "queued_to_first_step_s": round(first, 2),
        "walltime_cause": pre["cause"],
        "walltime_step": pre["step"],
        "walltime_lost_committed_steps": max(0, committed - resumed_at),
        "walltime_move_s": round(moved[-1] - pre["time"], 2) if len(moved) > 1 else None,
        "params_equal": bool(equal),
        "reserved_slots_retired": CountingAdaptive.retired_while_waiting,
        "workers_retired": CountingAdaptive.retired,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--peer-s", type=float, default=None)
    args = ap.parse_args()
    steps = args.steps or (600 if args.quick else 2000)
    peer_s = args.peer_s or (10.0 if args.quick else 45.0)
    with tempfile.TemporaryDirectory(prefix="nbtrain-slurm-bench-") as tmp:
        root = Path(tmp)
        slurm = LocalSlurm.start(root / "slurm")
        try:
            (root / "peer").mkdir()
            asked = peer(root / "peer", peer_s)
            (root / "run").mkdir()
            fig = nbtrain_run(root / "run", steps, "20s")
        finally:
            slurm.stop()
    fig["dask_adapt_workers"] = asked
    fig["dask_adapt_watch_s"] = peer_s
    print(f"{'':34}{'value':>10}")
    for k in ("queued_to_first_step_s", "walltime_step", "walltime_lost_committed_steps",
              "walltime_move_s", "params_equal", "reserved_slots_retired", "workers_retired",
              "dask_adapt_workers"):
        print(f"{k:34}{fig[k]!s:>10}")
    print(f"Dask's own adapt asked Slurm for {asked} workers in {peer_s:g} s for a queued "
          "2-rank job; nbtrain's asked for the gang at once.")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
