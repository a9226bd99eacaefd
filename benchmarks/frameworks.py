"""Other frameworks inside nbtrain jobs, against the same code under torchrun (world size 2).

- ``hf_trainer_ratio``: the steady step rate of an HF ``Trainer`` run by
  ``nbtrain.runtime.hf.run_trainer`` in a training function, over the same ``Trainer`` as a
  plain script under ``torchrun --nproc-per-node 2`` (``benchmarks/_hf_torchrun_peer.py``),
  in alternating rounds of the same run; the first 25% of each run's steps are dropped.
- ``script_ratio``: the steady step rate of an unmodified torchrun DDP script
  (``benchmarks/_torchrun_peer.py``) run by ``cluster.submit_script`` over the same script
  under ``torchrun --nproc-per-node 2``, alternating rounds, rank 0's own step clock.
- ``hf_ok``, ``accelerate_ok``, ``lightning_ok``: each framework's job with a rank killed
  mid-run ends SUCCEEDED with parameters equal to an uninterrupted run's (bit-exact).
- ``script_recovered``: the script job whose rank 1 child is SIGKILLed mid-run restarts it
  (torchrun's way: the script starts again) and ends SUCCEEDED.

Usage: ``python benchmarks/frameworks.py [--quick]``. Last stdout line: JSON. A torchrun run
that fails is tried once more (``benchmarks/_peers.py``); if it fails again its ratio is null
and ``peer_failed`` says why.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _peers import PeerAttempt, PeerResult, peer_figures, ratio, run_peer
from overhead import PLAIN_ENV, steady_rate  # the environment before connect(), rates

import nbtrain
from nbtrain.framework_examples import accelerate_train, fabric_train, hf_trainer_train

HERE = Path(__file__).resolve().parent
N_EMBD = 128  # wide enough that a step is compute, not Python overhead


def run_nbtrain_hf(cluster: nbtrain.Cluster, steps: int, work: Path) -> float:
    job = cluster.submit(hf_trainer_train, world_size=2, steps=steps, checkpoint=None,
                         name="hf-rate", config={"work_dir": str(work), "n_embd": N_EMBD})
    return steady_rate(job.result(timeout=600)["step_times"])


def run_torchrun(script: str, args: list[str], what: str, attempt: PeerAttempt) -> float:
    """One attempt of a torchrun peer (``--nproc-per-node 2``): rank 0's steady rate, from
    the step times the script writes to ``--out``."""
    out = attempt.workdir / "times.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(HERE / script), *args, "--out", str(out)]
    attempt.run(cmd, env=dict(PLAIN_ENV, OMP_NUM_THREADS="1"), timeout=600, what=what)
    return steady_rate(json.loads(out.read_text()))


def run_torchrun_hf(steps: int, attempt: PeerAttempt) -> float:
    return run_torchrun("_hf_torchrun_peer.py", ["--steps", str(steps), "--work",
                        str(attempt.workdir), "--n-embd", str(N_EMBD)],
                        "HF Trainer under torchrun", attempt)


def run_nbtrain_script(cluster: nbtrain.Cluster, steps: int, work: Path) -> float:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "times.json"
    job = cluster.submit_script(HERE / "_torchrun_peer.py", world_size=2, name="script-rate",
                                args=["--steps", str(steps), "--out", str(out)])
    if job.wait(600) is not nbtrain.JobState.SUCCEEDED:
        raise RuntimeError(f"the script job ended {job.status.value}: {job.error}")
    return steady_rate(json.loads(out.read_text()))


def run_torchrun_script(steps: int, attempt: PeerAttempt) -> float:
    return run_torchrun("_torchrun_peer.py", ["--steps", str(steps)],
                        "the script under torchrun", attempt)


def script_recovers(cluster: nbtrain.Cluster, work: Path) -> bool:
    """SIGKILL rank 1's child of a running script job: it ends SUCCEEDED after one restart."""
    import os
    import signal
    import time

    work.mkdir(parents=True, exist_ok=True)
    job = cluster.submit_script(HERE / "_torchrun_peer.py", world_size=2, name="script-kill",
                                args=["--steps", "600", "--out", str(work / "times.json")])
    deadline = time.monotonic() + 300
    pid = 0
    while time.monotonic() < deadline and not pid:
        started = [e for e in job.events if e.get("kind") == "rank_started"
                   and e.get("rank") == 1 and e.get("generation") == 0]
        if started and len(job.metrics) >= 40:
            pid = int(started[0]["pid"])
        time.sleep(0.05)
    if not pid:
        return False
    os.kill(pid, signal.SIGKILL)
    ok = job.wait(600) is nbtrain.JobState.SUCCEEDED and len(job.faults) == 1
    if not ok:
        print(f"  {job.name}: {job.status.value} {job.reason}; faults {job.faults}", flush=True)
    return ok


def recovers_exactly(cluster: nbtrain.Cluster, fn: Any, root: Path, steps: int) -> bool:
    """A run with rank 1 killed at mid-run ends with the parameters of an uninterrupted one."""
    import torch

    outs = {}
    for name, faults in (("clean", []), ("killed", [nbtrain.Fault("kill", rank=1,
                                                                  step=steps // 2 + 1)])):
        out = root / f"{fn.__name__}-{name}"
        out.mkdir()
        job = cluster.submit(fn, world_size=2, steps=steps, checkpoint=max(2, steps // 4),
                             name=f"{fn.__name__}-{name}", faults=faults,
                             config={"work_dir": str(out), "out_dir": str(out)})
        if job.wait(600) is not nbtrain.JobState.SUCCEEDED or len(job.faults) != len(faults):
            print(f"  {job.name}: {job.status.value} {job.reason}", flush=True)
            return False
        outs[name] = out
    for rank in (0, 1):
        a = torch.load(outs["clean"] / f"rank{rank}.pt")
        b = torch.load(outs["killed"] / f"rank{rank}.pt")
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 60 steps (else 5 of 200)")
    args = parser.parse_args()
    rounds, steps = (2, 60) if args.quick else (5, 200)
    root = Path(tempfile.mkdtemp(prefix="nbtrain-frameworks-"))
    ours: list[float] = []
    peers: list[PeerResult[float]] = []
    with nbtrain.connect(n_workers=2, settings=nbtrain.Settings.load(
            checkpoint_root=str(root / "checkpoints"))) as cluster:
        run_nbtrain_hf(cluster, 20, root / "warm")  # the workers import transformers once
        for i in range(rounds):
            order = ["nbtrain", "torchrun"] if i % 2 == 0 else ["torchrun", "nbtrain"]
            for which in order:
                if which == "nbtrain":
                    ours.append(run_nbtrain_hf(cluster, steps, root / f"hf-{i}"))
                else:
                    peers.append(run_peer("torchrun-hf", functools.partial(run_torchrun_hf,
                                                                           steps)))
            peer = peers[-1].value
            print(f"round {i + 1}/{rounds}: nbtrain {ours[-1]:.1f} steps/s, torchrun "
                  + (f"{peer:.1f} steps/s" if peer is not None else "failed"), flush=True)
        script: list[float] = []
        script_peers: list[PeerResult[float]] = []
        run_nbtrain_script(cluster, 30, root / "script-warm")
        for i in range(rounds):
            order = ["nbtrain", "torchrun"] if i % 2 == 0 else ["torchrun", "nbtrain"]
            for which in order:
                if which == "nbtrain":
                    script.append(run_nbtrain_script(cluster, 4 * steps, root / f"sc-{i}"))
                else:
                    script_peers.append(run_peer("torchrun-script", functools.partial(
                        run_torchrun_script, 4 * steps)))
            peer = script_peers[-1].value
            print(f"script round {i + 1}/{rounds}: nbtrain {script[-1]:.1f} steps/s, torchrun "
                  + (f"{peer:.1f} steps/s" if peer is not None else "failed"), flush=True)
        recovered = script_recovers(cluster, root / "script-kill")
        ok = {name: recovers_exactly(cluster, fn, root, 12)
              for name, fn in (("hf_ok", hf_trainer_train), ("accelerate_ok", accelerate_train),
                               ("lightning_ok", fabric_train))}
    got = [p.value for p in peers if p.value is not None]
    got_script = [p.value for p in script_peers if p.value is not None]
    figures = {
        "hf_trainer_steps_per_s": round(statistics.median(ours), 2),
        "torchrun_hf_steps_per_s": round(statistics.median(got), 2) if got else None,
        "hf_trainer_ratio": ratio(statistics.median(ours), statistics.median(got) if got
                                  else None),
        "script_steps_per_s": round(statistics.median(script), 2),
        "torchrun_script_steps_per_s": round(statistics.median(got_script), 2) if got_script
        else None,
        "script_ratio": ratio(statistics.median(script), statistics.median(got_script)
                              if got_script else None),
        "script_recovered": recovered,
        "rounds": rounds, "steps": steps,
        **ok, **peer_figures(peers + script_peers)}
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
