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
- ``dask_tasks_hf_ratio``: the same ``Trainer`` (the torchrun peer's code) run as two plain
  Dask tasks on the cluster's two workers, with the torchrun environment set by hand and no
  nbtrain in the loop (no controller, no step loop, no step rows), over torchrun, in the
  same alternating rounds. ``hf_trainer_over_dask_tasks`` is nbtrain's rate over that one:
  what nbtrain itself costs, apart from running inside a Dask worker process.
- ``hf_trainer_extra_ms_per_step``: what the ratio means in time, the median step under
  nbtrain less the median step under torchrun.
- ``scheduler_cpu_ms_per_step``: CPU this process used per step of the nbtrain HF runs'
  steady windows: the embedded scheduler with nbtrain's controller (taking each rank's step
  rows, judging stragglers, keeping the durable store) and the client waiting. On a real
  cluster it runs on another machine; here it shares the two cores with both ranks.
- ``torchrun_beside_burner_ratio``: the torchrun HF peer beside ``_burner.py`` busy as many
  ms per step as that (``burner_busy_ms`` of every ``burner_period_ms``), over the peer
  alone, alternating rounds: what that much foreign CPU costs two ranks that fill two cores
  and meet in collectives several times a step, whoever spends it.
- ``script_recovered``: the script job whose rank 1 child is SIGKILLed mid-run restarts it
  (torchrun's way: the script starts again) and ends SUCCEEDED.

Both rates move by up to 10-15% from one run to the next on a shared 2-core machine, in
either system (a long steady window of each measured 27-41 steps/s within one hour), so a
ratio from two rounds says little. The ratios are of the medians over rounds; next to them
``*_pair_ratios`` lists each round's nbtrain rate over the torchrun rate of the same round
(the two ran back to back), ``*_pair_median`` their median and ``*_pair_iqr`` their spread,
so a reader sees how far one figure can be trusted. Full mode runs 6 rounds of 900 HF
steps (a steady window of about 14 s each; 8 rounds of 300 steps until 2026-12-07 measured
windows of about 4 s, which a few seconds of foreign load could move by 20%) and 1,200 script
steps; ``--rounds``, ``--steps`` and ``--script-steps`` set how much is measured.

Usage: ``python benchmarks/frameworks.py [--quick] [--rounds N] [--steps N]
[--script-steps N]``. Last stdout
line: JSON. A torchrun run that fails is tried once more (``benchmarks/_peers.py``); if it
fails again its ratio is null and ``peer_failed`` says why.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _peers import PeerAttempt, PeerResult, peer_figures, ratio, run_peer
from overhead import PLAIN_ENV, steady_rate  # the environment before connect(), rates

import nbtrain
from nbtrain.engine.standalone import free_port
from nbtrain.framework_examples import accelerate_train, fabric_train, hf_trainer_train

HERE = Path(__file__).resolve().parent
N_EMBD = 128  # wide enough that a step is compute, not Python overhead
#: Steps of each run of the burner member (its own alone/beside rounds).
INTERFERENCE_STEPS = 300


def run_nbtrain_hf(cluster: nbtrain.Cluster, steps: int, work: Path) -> tuple[float, float]:
    """The job's steady rate, and the CPU this process (the embedded scheduler with nbtrain's
    controller, and the client waiting) used per step of the steady window, in ms."""
    with CpuClock() as clock:
        job = cluster.submit(hf_trainer_train, world_size=2, steps=steps, checkpoint=None,
                             name="hf-rate", config={"work_dir": str(work), "n_embd": N_EMBD})
        times = job.result(timeout=600)["step_times"]
    steady = times[len(times) // 4:]
    cpu = clock.between(steady[0], steady[-1])
    return steady_rate(times), cpu / (len(steady) - 1) * 1000


def _hf_rank_task(rank: int, port: int, work: str, steps: int) -> list[float]:
    """One rank of the torchrun peer's ``Trainer`` inside a plain Dask task: the torchrun
    environment by hand, the process group, the ``Trainer``; rank 0's step end times."""
    import torch
    import torch.distributed as dist

    from nbtrain.framework_examples import build_trainer

    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        trainer, times = build_trainer({"work_dir": work, "n_embd": N_EMBD}, max_steps=steps)
        trainer.train()
        # Both ranks are done with the group's collectives before its DDP reducer (and with
        # it the group) is freed: otherwise the group's teardown can wait forever for a peer
        # that already left (seen: ProcessGroupGloo's destructor joining its threads).
        dist.barrier()
        del trainer
        gc.collect()
        dist.destroy_process_group()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return times


def run_dask_tasks_hf(cluster: nbtrain.Cluster, steps: int, work: Path) -> float:
    """The torchrun peer's ``Trainer`` as two plain Dask tasks on the cluster's two workers
    (nbtrain's controller sees no job): the steady rate of rank 0."""
    port = free_port()
    client = cluster.client
    workers = sorted(client.scheduler_info()["workers"])[:2]
    futures = [client.submit(_hf_rank_task, rank, port, str(work), steps, workers=[addr],
                             allow_other_workers=False, pure=False)
               for rank, addr in enumerate(workers)]
    times = client.gather(futures)[0]
    return steady_rate(times)


class CpuClock:
    """This process's CPU seconds, sampled every 20 ms on a thread while the ``with`` lasts;
    ``between(t0, t1)`` (wall-clock times) reads the samples nearest them."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(0.02):
            t = os.times()
            self.samples.append((time.time(), t.user + t.system))

    def __enter__(self) -> CpuClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> float:
        def at(t: float) -> float:
            return min(self.samples, key=lambda s: abs(s[0] - t))[1]
        return at(t1) - at(t0)


def run_torchrun_beside(steps: int, busy_ms: float, idle_ms: float,
                        attempt: PeerAttempt) -> float:
    """The HF torchrun peer with a process beside it that is busy ``busy_ms``, then idle
    ``idle_ms``, over and over (``benchmarks/_burner.py``): how much a little foreign CPU
    costs two ranks that share two cores."""
    burner = subprocess.Popen([sys.executable, str(HERE / "_burner.py"), str(busy_ms),
                               str(idle_ms)])
    try:
        return run_torchrun_hf(steps, attempt)
    finally:
        burner.kill()
        burner.wait()


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


def pair_figures(name: str, ours: list[float], peers: list[PeerResult[float]]
                 ) -> dict[str, Any]:
    """Each round's nbtrain rate over its torchrun peer's (rounds whose peer failed are left
    out), their median (each pair ran back to back, so a drift of the machine's speed over
    the run cancels in it; the headline ratios are of the medians over rounds) and their
    interquartile range."""
    pairs = [o / p.value for o, p in zip(ours, peers, strict=True) if p.value]
    iqr = None
    if len(pairs) >= 2:
        q1, _, q3 = statistics.quantiles(pairs, n=4)
        iqr = round(q3 - q1, 4)
    return {f"{name}_pair_ratios": [round(r, 3) for r in pairs],
            f"{name}_pair_median": round(statistics.median(pairs), 4) if pairs else None,
            f"{name}_pair_iqr": iqr}


def measure_interference(steps: int, rounds: int, busy_ms: float, peer_rates: list[float]
                         ) -> dict[str, Any]:
    """The HF torchrun peer alone and beside ``_burner.py`` busy as many ms per step as
    this process (nbtrain's scheduler) used per step of the nbtrain runs, alternating:
    ``torchrun_beside_burner_ratio`` (beside / alone, medians)."""
    if not peer_rates:
        return {"torchrun_beside_burner_ratio": None}
    period_ms = 1000 / statistics.median(peer_rates)
    idle_ms = max(0.0, period_ms - busy_ms)
    alone: list[PeerResult[float]] = []
    beside: list[PeerResult[float]] = []
    for i in range(rounds):
        for which in (["alone", "beside"] if i % 2 == 0 else ["beside", "alone"]):
            if which == "alone":
                alone.append(run_peer("torchrun-hf", functools.partial(run_torchrun_hf, steps)))
            else:
                beside.append(run_peer("torchrun-hf-burner", functools.partial(
                    run_torchrun_beside, steps, busy_ms, idle_ms)))
        print(f"interference round {i + 1}/{rounds}: torchrun alone {alone[-1].value} "
              f"steps/s, beside a burner busy {busy_ms:.2f} of every {period_ms:.1f} ms "
              f"{beside[-1].value} steps/s", flush=True)
    a = [p.value for p in alone if p.value is not None]
    b = [p.value for p in beside if p.value is not None]
    return {"torchrun_beside_burner_ratio": ratio(statistics.median(b) if b else None,
                                                  statistics.median(a) if a else None),
            "burner_busy_ms": round(busy_ms, 2), "burner_period_ms": round(period_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds, 60 HF steps, 240 script steps (else 6, 900, 1200)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of each pair")
    parser.add_argument("--steps", type=int, default=None, help="steps of an HF run")
    parser.add_argument("--script-steps", type=int, default=None,
                        help="steps of a script run")
    args = parser.parse_args()
    rounds, steps, script_steps = (2, 60, 240) if args.quick else (6, 900, 1200)
    rounds, steps = args.rounds or rounds, args.steps or steps
    script_steps = args.script_steps or script_steps
    root = Path(tempfile.mkdtemp(prefix="nbtrain-frameworks-"))
    ours: list[float] = []
    cpu_ms: list[float] = []
    peers: list[PeerResult[float]] = []
    dask_tasks: list[float] = []
    with nbtrain.connect(n_workers=2, settings=nbtrain.Settings.load(
            checkpoint_root=str(root / "checkpoints"))) as cluster:
        run_nbtrain_hf(cluster, 20, root / "warm")  # the workers import transformers once
        run_dask_tasks_hf(cluster, 20, root / "dask-warm")
        for i in range(rounds):
            order = ["nbtrain", "torchrun", "dask"]
            for which in order if i % 2 == 0 else order[::-1]:
                if which == "nbtrain":
                    rate, cpu = run_nbtrain_hf(cluster, steps, root / f"hf-{i}")
                    ours.append(rate)
                    cpu_ms.append(cpu)
                elif which == "dask":
                    dask_tasks.append(run_dask_tasks_hf(cluster, steps, root / f"dask-{i}"))
                else:
                    peers.append(run_peer("torchrun-hf", functools.partial(run_torchrun_hf,
                                                                           steps)))
            peer = peers[-1].value
            print(f"round {i + 1}/{rounds}: nbtrain {ours[-1]:.1f} steps/s, torchrun "
                  + (f"{peer:.1f} steps/s" if peer is not None else "failed")
                  + f", plain Dask tasks {dask_tasks[-1]:.1f} steps/s", flush=True)
        interference = measure_interference(min(steps, INTERFERENCE_STEPS), min(rounds, 4),
                                            statistics.median(cpu_ms),
                                            [p.value for p in peers if p.value is not None])
        script: list[float] = []
        script_peers: list[PeerResult[float]] = []
        run_nbtrain_script(cluster, 30, root / "script-warm")
        for i in range(rounds):
            order = ["nbtrain", "torchrun"] if i % 2 == 0 else ["torchrun", "nbtrain"]
            for which in order:
                if which == "nbtrain":
                    script.append(run_nbtrain_script(cluster, script_steps, root / f"sc-{i}"))
                else:
                    script_peers.append(run_peer("torchrun-script", functools.partial(
                        run_torchrun_script, script_steps)))
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
        **pair_figures("hf_trainer", ours, peers),
        "dask_tasks_hf_steps_per_s": round(statistics.median(dask_tasks), 2),
        "dask_tasks_hf_ratio": ratio(statistics.median(dask_tasks), statistics.median(got)
                                     if got else None),
        "hf_trainer_over_dask_tasks": ratio(statistics.median(ours),
                                            statistics.median(dask_tasks)),
        **pair_figures("dask_tasks_hf", dask_tasks, peers),
        "hf_trainer_extra_ms_per_step": round(1000 / statistics.median(ours)
                                              - 1000 / statistics.median(got), 2) if got else None,
        "scheduler_cpu_ms_per_step": round(statistics.median(cpu_ms), 2),
        **interference,
        **pair_figures("script", script, script_peers),
        "script_recovered": recovered,
        "rounds": rounds, "steps": steps, "script_steps": script_steps,
        **ok, **peer_figures(peers + script_peers)}
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
