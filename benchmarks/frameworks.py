"""Other frameworks inside nbtrain jobs, against the same code under torchrun (world size 2).

Each comparison runs its two members at once, in turns (``benchmarks/_turns.py``): both
start together and train in alternating turns of ``turn_s`` seconds on one wall-clock
schedule, each sleeping through the other's. The machine's speed drifts by 10-20% within a
minute on this shared 2-core machine, more than the differences measured here; two turns of
one cycle are seconds apart, so the drift cancels in their ratio. Until 2026-12-07 the
members ran one after the other in rounds of 15-30 s, and the same code gave ratios from
0.88 to 1.01 from one full run to the next.

- ``hf_trainer_ratio``: an HF ``Trainer`` run by ``nbtrain.runtime.hf.run_trainer`` in a
  training function, over the same ``Trainer`` as a plain script under ``torchrun
  --nproc-per-node 2`` (``benchmarks/_hf_torchrun_peer.py``): the median over cycles of the
  two members' steady rates in that cycle's turns (rank 0's step ends, the first
  ``skip_s`` of each turn left out, and the first cycle). ``*_pooled_ratio`` is the ratio of
  the members' mean rates over the same cycles, ``*_pair_iqr`` the cycles' spread,
  ``*_ratio_ci95`` a 95% interval for the median (``_turns.median_interval``; a target is
  met when the interval's low end is: at 24 cycles it is about +-0.03 wide here),
  ``*_turn_rates`` each cycle's two rates.
- ``script_ratio``: the same for an unmodified torchrun DDP script
  (``benchmarks/_torchrun_peer.py``) run by ``cluster.submit_script``.
- ``dask_tasks_hf_ratio``: the same ``Trainer`` (the torchrun peer's code) as two plain Dask
  tasks on the cluster's two workers, with the torchrun environment set by hand and no
  nbtrain in the loop (no controller, no step loop, no step rows), over torchrun in turns of
  its own. ``hf_trainer_over_dask_tasks`` is ``hf_trainer_ratio`` over it: what nbtrain
  itself costs, apart from running inside a Dask worker process.
- ``hf_trainer_extra_ms_per_step``: the mean step under nbtrain less the one under torchrun.
- ``scheduler_cpu_ms_per_step``: CPU this process used per step of nbtrain's HF turns: the
  embedded scheduler with nbtrain's controller (taking each rank's step rows, judging
  stragglers, keeping the durable store) and the client waiting. On a real cluster it runs
  on another machine; here it shares the two cores with the ranks.
- ``torchrun_beside_burner_ratio``: the torchrun HF peer beside ``_burner.py`` busy as many
  ms per step as that (``burner_busy_ms`` of every ``burner_period_ms``), over the peer
  alone, alternating runs of ``INTERFERENCE_STEPS`` steps: what that much foreign CPU costs
  two ranks that fill two cores and meet in collectives several times a step.
- ``hf_ok``, ``accelerate_ok``, ``lightning_ok``: each framework's job with a rank killed
  mid-run ends SUCCEEDED with parameters equal to an uninterrupted run's (bit-exact).
- ``script_recovered``: the script job whose rank 1 child is SIGKILLed mid-run restarts it
  (torchrun's way: the script starts again) and ends SUCCEEDED.

Every member pays the same for taking turns: one all-reduce of a flag per step. The
cluster's ``hang_floor_s`` is raised to ``HANG_FLOOR_S``: a member sleeping through the
other's turn makes no step progress, on purpose.

Usage: ``python benchmarks/frameworks.py [--quick] [--turns N] [--turn-s S]``. Full mode:
25 turns of 2 s per member and comparison, about 9 minutes. Last stdout line: JSON. A
torchrun run that fails is tried once more with a new schedule (``benchmarks/_peers.py``); if
it fails again its ratio is null and ``peer_failed`` says why.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import cloudpickle
from _peers import PeerAttempt, PeerResult, peer_figures, ratio, run_peer
from _turns import Turns, hf_probe_callback, hf_turn_callback, pair_figures, rank_pids
from overhead import PLAIN_ENV, steady_rate  # the environment before connect(), rates

import nbtrain
from nbtrain.engine.standalone import free_port
from nbtrain.framework_examples import accelerate_train, fabric_train, hf_trainer_train

HERE = Path(__file__).resolve().parent
N_EMBD = 128  # wide enough that a step is compute, not Python overhead
#: Steps of each run of the burner member (its own alone/beside rounds).
INTERFERENCE_STEPS = 300
#: Turns per member and comparison, and their length (full mode; then ``--quick``).
TURNS, TURN_S = 25, 2.0
QUICK_TURNS, QUICK_TURN_S = 4, 1.5
#: Left out at the start of each turn: the other member's last step, cold caches.
SKIP_S = 0.3
#: From the start of both members to the first turn: both import and join their group.
START_MARGIN_S = 20.0
#: A member's steps: more than its turns take (it stops after its last turn).
MANY_STEPS = 1_000_000
#: The longest a comparison may take.
TURNS_TIMEOUT_S = 900.0
#: The cluster's hang floor here: longer than the start margin and a turn of the other.
HANG_FLOOR_S = 120.0

T = TypeVar("T")

# The workers unpickle the members' callbacks without benchmarks/ on their path.
cloudpickle.register_pickle_by_value(sys.modules["_turns"])


def hf_turns_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    """The nbtrain member: ``hf_trainer_train``'s ``Trainer`` through ``run_trainer``,
    training in its turns (``config["turns"]``); rank 0's step end times, and with
    ``config["probe"]`` its per-step thread samples and every rank's pid (as the HF peer's
    ``--probe``)."""
    from nbtrain.framework_examples import build_trainer
    from nbtrain.runtime.hf import run_trainer

    trainer, times = build_trainer(config)
    samples: list[list[float]] = []
    if config.get("probe"):
        trainer.add_callback(hf_probe_callback(samples))
    trainer.add_callback(hf_turn_callback(Turns.from_json(config["turns"])))
    run_trainer(ctx, trainer)
    if not config.get("probe"):
        return {"step_times": times}
    return {"step_times": times, "samples": samples, "pids": rank_pids()}


def _hf_rank_task(rank: int, port: int, work: str, steps: int, turns: str) -> list[float]:
    """One rank of the torchrun peer's ``Trainer`` inside a plain Dask task: the torchrun
    environment by hand, the process group, the ``Trainer`` in its turns; rank 0's step end
    times."""
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
        trainer.add_callback(hf_turn_callback(Turns.from_json(turns)))
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


#: Starts a member on its turns in a working directory; what it returns waits for the member
#: and gives its rank 0's step end times.
Start = Callable[[Turns, Path], Callable[[], list[float]]]


@contextlib.contextmanager
def connect_warm(root: Path) -> Iterator[nbtrain.Cluster]:
    """The benchmarks' embedded 2-worker cluster (``HANG_FLOOR_S``: a member sleeps through
    the other's turns, and through the start margin before its first one, on purpose; the
    hang watchdog must not take that for a hang), with an HF job run once so that both
    workers have imported what the members need."""
    with nbtrain.connect(n_workers=2, settings=nbtrain.Settings.load(
            checkpoint_root=str(root / "checkpoints"), hang_floor_s=HANG_FLOOR_S)) as cluster:
        cluster.submit(hf_trainer_train, world_size=2, steps=20, checkpoint=None,
                       config={"work_dir": str(root / "warm"), "n_embd": N_EMBD}
                       ).result(timeout=600)
        yield cluster


def hf_peer_args(root: Path) -> list[str]:
    """``_hf_torchrun_peer.py``'s arguments for a member in turns (before ``--out``)."""
    return ["--steps", str(MANY_STEPS), "--work", str(root / "peer"), "--n-embd", str(N_EMBD)]


def submit_hf_turns(cluster: nbtrain.Cluster, turns: Turns, work: Path, *,
                    probe: bool = False) -> nbtrain.JobHandle:
    """The nbtrain HF member's job (:func:`hf_turns_train`)."""
    return cluster.submit(hf_turns_train, world_size=2, steps=MANY_STEPS, checkpoint=None,
                          name="hf-turns", config={"work_dir": str(work / "nbtrain"),
                                                   "n_embd": N_EMBD, "probe": probe,
                                                   "turns": turns.to_json()})


def start_nbtrain_hf(cluster: nbtrain.Cluster) -> Start:
    def start(turns: Turns, work: Path) -> Callable[[], list[float]]:
        job = submit_hf_turns(cluster, turns, work)
        return lambda: list(job.result(timeout=TURNS_TIMEOUT_S)["step_times"])
    return start


def start_dask_tasks_hf(cluster: nbtrain.Cluster) -> Start:
    """The torchrun peer's ``Trainer`` as two plain Dask tasks on the cluster's two workers
    (nbtrain's controller sees no job)."""
    def start(turns: Turns, work: Path) -> Callable[[], list[float]]:
        port = free_port()
        client = cluster.client
        workers = sorted(client.scheduler_info()["workers"])[:2]
        futures = [client.submit(_hf_rank_task, rank, port, str(work / "dask"), MANY_STEPS,
                                 turns.to_json(), workers=[addr], allow_other_workers=False,
                                 pure=False)
                   for rank, addr in enumerate(workers)]
        return lambda: list(client.gather(futures)[0])
    return start


def start_nbtrain_script(cluster: nbtrain.Cluster) -> Start:
    def start(turns: Turns, work: Path) -> Callable[[], list[float]]:
        work.mkdir(parents=True, exist_ok=True)
        out = work / "nbtrain-times.json"
        job = cluster.submit_script(HERE / "_torchrun_peer.py", world_size=2,
                                    name="script-turns",
                                    args=["--steps", str(MANY_STEPS), "--out", str(out),
                                          "--turns", turns.to_json()])

        def finish() -> list[float]:
            if job.wait(TURNS_TIMEOUT_S) is not nbtrain.JobState.SUCCEEDED:
                raise RuntimeError(f"the script job ended {job.status.value}: {job.error}")
            return list(json.loads(out.read_text()))
        return finish
    return start


@dataclasses.dataclass
class TurnRun:
    """One member against torchrun in turns: both members' step end times and the schedule
    (None where the peer failed twice), and the peer's outcome."""

    turns: Turns | None
    ours: list[float] | None
    peer: PeerResult[list[float]]

    def figures(self, name: str) -> dict[str, Any]:
        if self.turns is None or self.ours is None or self.peer.value is None:
            return {f"{name}_ratio": None}
        ours = self.turns.member(0).rates(self.ours, SKIP_S)
        peer = self.turns.member(1).rates(self.peer.value, SKIP_S)
        ready = max(self.ours[0], self.peer.value[0])
        return {**pair_figures(name, ours, peer, ready=ready, turns=self.turns),
                f"{name}_turn_rates": [[round(ours.get(c, 0.0), 1), round(peer.get(c, 0.0), 1)]
                                       for c in range(self.turns.turns)]}


def run_in_turns(peer_name: str, start: Start, script: str, args: list[str], turns: int,
                 turn_s: float) -> TurnRun:
    """Start our member and the same code under ``torchrun --nproc-per-node 2`` together,
    on one schedule of ``turns`` turns each of ``turn_s`` seconds (ours first in each
    cycle); both give their step end times (see :func:`race_in_turns`)."""
    schedule, ours, peer = race_in_turns(peer_name, start, script, args, turns, turn_s)
    return TurnRun(schedule, ours, peer)


def race_in_turns(peer_name: str, start: Callable[[Turns, Path], Callable[[], T]],
                  script: str, args: list[str], turns: int, turn_s: float
                  ) -> tuple[Turns | None, T | None, PeerResult[Any]]:
    """Our member (``start``) and ``script`` under ``torchrun --nproc-per-node 2`` at once,
    in turns: the schedule (None where the peer failed twice), what our member gave and the
    peer's outcome (the JSON its rank 0 wrote to ``--out``). A failed torchrun attempt is
    tried once more with a new schedule, after our member has finished the old one; our
    member's failure fails the run."""
    got: dict[str, Any] = {}

    def attempt(attempt: PeerAttempt) -> Any:
        schedule = Turns(t0=time.time() + START_MARGIN_S, turn_s=turn_s, members=2,
                         turns=turns)
        finish = start(schedule.member(0), attempt.workdir)
        out = attempt.workdir / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", str(HERE / script), *args, "--out", str(out),
               "--turns", schedule.member(1).to_json()]
        try:
            attempt.run(cmd, env=dict(PLAIN_ENV, OMP_NUM_THREADS="1"),
                        timeout=TURNS_TIMEOUT_S, what=f"{script} under torchrun")
        finally:
            try:
                got.update(ours=finish(), turns=schedule)
            except Exception as exc:  # nbtrain's failure: raised after the peer's outcome
                got["error"] = exc
        return json.loads(out.read_text())

    peer = run_peer(peer_name, attempt)
    if "error" in got:
        raise got["error"]
    return got.get("turns") if peer.value else None, got.get("ours"), peer


def turn_cpu_ms(clock: CpuClock, run: TurnRun) -> float | None:
    """CPU this process used per step of our member's measured turns, in ms."""
    if run.turns is None or run.ours is None:
        return None
    cpu, steps = 0.0, 0
    for ends in run.turns.member(0).windows(run.ours, SKIP_S).values():
        cpu += clock.between(ends[0], ends[-1])
        steps += len(ends) - 1
    return cpu / steps * 1000 if steps else None


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
                        help=f"{QUICK_TURNS} turns of {QUICK_TURN_S} s per member (else "
                             f"{TURNS} of {TURN_S} s)")
    parser.add_argument("--turns", type=int, default=None, help="turns of each member")
    parser.add_argument("--turn-s", type=float, default=None, help="seconds of a turn")
    args = parser.parse_args()
    turns, turn_s = (QUICK_TURNS, QUICK_TURN_S) if args.quick else (TURNS, TURN_S)
    turns, turn_s = args.turns or turns, args.turn_s or turn_s
    root = Path(tempfile.mkdtemp(prefix="nbtrain-frameworks-"))
    with connect_warm(root) as cluster:
        hf_args = hf_peer_args(root)
        with CpuClock() as clock:
            hf = run_in_turns("torchrun-hf", start_nbtrain_hf(cluster), "_hf_torchrun_peer.py",
                              hf_args, turns, turn_s)
        cpu_ms = turn_cpu_ms(clock, hf)
        hf_figures = hf.figures("hf_trainer")
        print(f"HF Trainer: {_summary(hf_figures, 'hf_trainer')}", flush=True)
        dask = run_in_turns("torchrun-hf", start_dask_tasks_hf(cluster),
                            "_hf_torchrun_peer.py", hf_args, turns, turn_s)
        dask_figures = dask.figures("dask_tasks_hf")
        print(f"plain Dask tasks: {_summary(dask_figures, 'dask_tasks_hf')}", flush=True)
        script = run_in_turns("torchrun-script", start_nbtrain_script(cluster),
                              "_torchrun_peer.py", ["--steps", str(MANY_STEPS)], turns, turn_s)
        script_figures = script.figures("script")
        print(f"script: {_summary(script_figures, 'script')}", flush=True)
        peer_rate = hf_figures.get("hf_trainer_peer_steps_per_s")
        interference = measure_interference(
            INTERFERENCE_STEPS, 2 if args.quick else 4, cpu_ms or 0.0,
            [peer_rate] if peer_rate else [])
        recovered = script_recovers(cluster, root / "script-kill")
        ok = {name: recovers_exactly(cluster, fn, root, 12)
              for name, fn in (("hf_ok", hf_trainer_train), ("accelerate_ok", accelerate_train),
                               ("lightning_ok", fabric_train))}
    ours_rate = hf_figures.get("hf_trainer_ours_steps_per_s")
    figures = {
        **hf_figures,
        "hf_trainer_extra_ms_per_step": round(1000 / ours_rate - 1000 / peer_rate, 2)
        if ours_rate and peer_rate else None,
        "scheduler_cpu_ms_per_step": round(cpu_ms, 2) if cpu_ms is not None else None,
        **dask_figures,
        "hf_trainer_over_dask_tasks": ratio(hf_figures["hf_trainer_ratio"],
                                            dask_figures["dask_tasks_hf_ratio"]),
        **script_figures,
        **interference,
        "script_recovered": recovered,
        "turns": turns, "turn_s": turn_s, "skip_s": SKIP_S,
        **ok, **peer_figures([hf.peer, dask.peer, script.peer])}
    print(json.dumps(figures), flush=True)


def _summary(figures: dict[str, Any], name: str) -> str:
    return (f"ratio {figures.get(f'{name}_ratio')} over {figures.get(f'{name}_cycles')} "
            f"cycles (95% interval {figures.get(f'{name}_ratio_ci95')}, interquartile range "
            f"{figures.get(f'{name}_pair_iqr')}), "
            f"{figures.get(f'{name}_ours_steps_per_s')} vs "
            f"{figures.get(f'{name}_peer_steps_per_s')} steps/s")


if __name__ == "__main__":
    main()
