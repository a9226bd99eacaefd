"""A fault campaign: many faults of every kind in one run; does any job lose or corrupt a step?

Cluster: a supervised standalone one (``dask scheduler --preload nbtrain.engine.preload`` on a
state directory, three ``dask worker`` processes with one worker each, labelled as three
hosts); the supervisor starts again whichever process exits, as ``nbtrain cluster`` does.

Jobs run one after another (two ranks on three slots, so a spare is free; every other job is
elastic, 1 to 2 ranks): float64 regression over ``Indexed`` data, each step's sample ids
recorded, a checkpoint every 4 steps. Each job takes ``--faults-per-job`` faults drawn from
the kinds below, each fired once the job has trained again since the last one, at a random
moment; then it is stopped, and compared with its uninterrupted twin: plain single-process
SGD over the same global batches for the same number of steps.

Fault kinds (``by_kind`` counts them):

- ``kill``: SIGKILL of a random rank's worker process at a random moment;
- ``kill_in_commit``: the same, as soon as a checkpoint directory without its manifest is
  seen (a commit in flight), on the committer (rank 0);
- ``kill_in_grace``: a higher-priority job is submitted that needs the victim's slots; one of
  the victim's ranks is killed 0-0.3 s into its preemption grace (the high job is a job of
  the campaign too, compared with its own twin);
- ``kill_in_resize``: an elastic job is asked to shrink or grow, and a rank is killed 0-0.3 s
  later;
- ``raise`` / ``hang``: an exception or a hang injected into a random rank a few steps ahead;
- ``worker_gone``: the worker of a random rank is killed and never comes back (a new worker
  joins afterwards, so the cluster keeps three slots);
- ``scheduler``: SIGKILL of the scheduler, nbtrain's controller with it;
- ``disk_full`` and ``full_in_preempt``: the job's checkpoints go to a small tmpfs that is
  filled up (checkpoints fail while training goes on), then freed; and filled again while
  the owner preempts the job, so the preemption's checkpoint cannot commit (the job resumes
  from its previous checkpoint, no restart charged). Needs root for the mount; otherwise
  skipped, and the JSON says why.

Figures: ``faults``, ``by_kind``, ``jobs``, ``succeeded`` (jobs that ended as asked),
``committed_steps_lost`` (per fault: the newest committed step before it minus the step the
next generation started from, when positive), ``partial_loads`` (generations whose ranks
started from different steps), ``params_equal`` (fraction of jobs whose final parameters
equal the twin's, atol 1e-6), ``samples_exact`` (fraction of jobs whose every epoch used each
sample exactly once), ``uncharged_preemptions`` (preemptions whose checkpoint did not commit
and spent no restart), ``recovery_s`` (median, fault to the next step after it).

Usage: ``python benchmarks/chaos.py --quick`` (30+ faults, a few minutes on 2 cores) or
``python benchmarks/chaos.py`` (100+ faults). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain import JobState, Settings  # noqa: E402
from nbtrain.accounting import account  # noqa: E402
from nbtrain.engine.standalone import StandaloneCluster, standalone_cluster  # noqa: E402
from nbtrain.runtime.storage import CheckpointStore  # noqa: E402
from tests import recipes  # noqa: E402
from tests.recipes import ElasticRegression, single_process_params  # noqa: E402

cloudpickle.register_pickle_by_value(recipes)  # the workers cannot import tests/

N, BATCH = 256, 32
KINDS = ("kill", "kill_in_commit", "kill_in_grace", "kill_in_resize", "raise", "hang",
         "worker_gone", "scheduler")
DISK_KINDS = ("disk_full", "full_in_preempt")
#: Cluster-wide settings (the scheduler's environment): every worker here is one machine, so
#: host exclusion after repeated failures would leave no slots; growth back is not held.
SCHEDULER_ENV = {"NBTRAIN_HOST_FAILURE_LIMIT": "100000", "NBTRAIN_RESIZE_INTERVAL_S": "1",
                 "NBTRAIN_PREEMPT_GRACE_S": "20", "NBTRAIN_WORKER_RETURN_S": "20"}
TIMEOUT_S = 240.0


def _wait(cond: Callable[[], object], timeout: float, what: str) -> None:
    if not _until(cond, timeout, poll_s=0.01):
        raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


@dataclass
class Shot:
    """One fault fired."""

    kind: str
    job: str
    time: float
    committed: int  # the newest committed step just before it
    note: str = ""


@dataclass
class Run:
    """One job of the campaign and where its ranks write what they did."""

    job: nbtrain.JobHandle
    out: Path
    elastic: bool
    shots: list[Shot] = field(default_factory=list)
    final: int | None = None
    ok: bool = False


class Campaign:
    def __init__(self, cc: StandaloneCluster, c: nbtrain.Cluster, root: Path,
                 rng: random.Random) -> None:
        self.cc, self.c, self.root, self.rng = cc, c, root, rng
        self.runs: list[Run] = []
        self.groups = [f"w{i}" for i in range(3)]
        self.next_group = 3
        self.uncharged = 0

    # -- jobs ---------------------------------------------------------------------------------
    def submit(self, *, elastic: bool, c: nbtrain.Cluster | None = None, priority: int = 0,
               world_size: int = 2, steps: int = 10**6, checkpoint: int | None = 4,
               name: str = "job") -> Run:
        out = self.root / f"out-{len(self.runs)}"
        out.mkdir()
        job = (c or self.c).submit(
            ElasticRegression(out_dir=str(out), n=N, batch=BATCH, step_sleep=0.02),
            world_size=world_size, min_size=1 if elastic else None, steps=steps,
            checkpoint=checkpoint, max_restarts=1000, priority=priority,
            name=f"{name}-{len(self.runs)}")
        run = Run(job, out, elastic)
        self.runs.append(run)
        return run

    def trained(self, run: Run, steps: int = 8) -> None:
        """Until the job runs and has done ``steps`` steps since now."""
        job = run.job
        _wait(lambda: job.status is JobState.RUNNING, TIMEOUT_S, f"{job.name} running")
        start = job.step
        _wait(lambda: job.step >= start + steps and job.status is JobState.RUNNING,
              TIMEOUT_S, f"{job.name} training on from step {start}")

    def finish(self, run: Run) -> None:
        job = run.job
        if run.final is None:  # an open-ended job: stop it and compare at the step it stopped
            job.stop()
            run.ok = job.wait(TIMEOUT_S) is JobState.CANCELLED
            with contextlib.suppress(ValueError):
                run.final = int(job.reason.rsplit(" ", 1)[1])
        else:
            run.ok = job.wait(TIMEOUT_S) is JobState.SUCCEEDED
        if not run.ok:
            print(f"  {job.name} ended {job.status.value}: {job.reason}", flush=True)
            self.explain(job)

    def explain(self, job: nbtrain.JobHandle) -> None:
        """What a job that did not end as expected was doing: its step (still training?),
        its newest events and its ranks' call stacks, for the record of a failed run."""
        step = job.step
        time.sleep(1.0)
        print(f"  step {step}, {job.step} a second later; generation {job.generation}",
              flush=True)
        for e in job.events[-12:]:
            print(f"  event {json.dumps(e, default=str)[:300]}", flush=True)
        with contextlib.suppress(Exception):
            for worker, tasks in self.c.client.call_stack().items():
                for key, frames in tasks.items():
                    print(f"  stack of {key} on {worker}:\n    "
                          + "\n    ".join("".join(frames).splitlines()[-24:]), flush=True)

    # -- faults -------------------------------------------------------------------------------
    def pids(self, job: nbtrain.JobHandle) -> dict[int, int]:
        gen = job.generation
        return {int(e["rank"]): int(e["pid"]) for e in job.events
                if e.get("kind") == "rank_started" and e.get("generation") == gen}

    def committed(self, job: nbtrain.JobHandle) -> int:
        for _ in range(20):  # a listing that races a prune: read again
            with contextlib.suppress(Exception):
                return max(CheckpointStore(job.checkpoint_dir).committed(), default=0)
            time.sleep(0.01)
        raise RuntimeError(f"cannot list the checkpoints of {job.name}")

    def shoot(self, run: Run, kind: str) -> None:
        job = run.job
        self.trained(run)
        gen = job.generation
        shot = Shot(kind, job.id, 0.0, self.committed(job))
        pids = self.pids(job)
        rank = self.rng.choice(sorted(pids))
        if kind == "kill":
            time.sleep(self.rng.uniform(0.0, 0.5))
            shot.committed, shot.time = self.committed(job), time.time()
            _kill(pids[rank])
        elif kind == "kill_in_commit":
            ckdir = Path(job.checkpoint_dir)
            landed = _until(lambda: any(d.name.startswith("step-")
                                        and not (d / "manifest.json").exists()
                                        for d in ckdir.glob("step-*")), 5.0)
            shot.committed, shot.time = self.committed(job), time.time()
            shot.note = "in a commit" if landed else "no commit seen in 5 s"
            _kill(pids[0])
        elif kind == "kill_in_grace":
            high = self.submit(elastic=False, priority=5, world_size=4 - job.size, steps=24,
                               checkpoint=None, name="high")
            _wait(lambda: job.status is JobState.STOPPING, TIMEOUT_S, f"{job.name} preempted")
            time.sleep(self.rng.uniform(0.0, 0.3))
            shot.committed, shot.time = self.committed(job), time.time()
            _kill(pids[rank])
            high.final = 24
            self.finish(high)
        elif kind == "kill_in_resize":
            job.resize(1 if job.size == 2 else 2)
            time.sleep(self.rng.uniform(0.0, 0.3))
            shot.committed, shot.time = self.committed(job), time.time()
            _kill(pids[rank])
        elif kind in ("raise", "hang"):
            shot.committed, shot.time = self.committed(job), time.time()
            job.inject(kind, rank, step=job.step + 10)
        elif kind == "worker_gone":
            addr = job.slots[rank]
            group = self.group_of(addr)
            shot.committed, shot.time = self.committed(job), time.time()
            self.cc.remove_workers(group)
            self.groups.remove(group)
            self.add_group()
        elif kind == "scheduler":
            shot.committed, shot.time = self.committed(job), time.time()
            self.cc.kill_scheduler()
        run.shots.append(shot)
        # The fault ended the generation (a restart, a resize, a resumed preemption).
        _wait(lambda: job.generation > gen, TIMEOUT_S, f"{job.name} past generation {gen}")
        self.trained(run, steps=4)

    def disk_faults(self, run: Run, mount: Path) -> None:
        """Fill the job's checkpoint tmpfs while it trains, then while it is preempted."""
        job = run.job
        self.trained(run)
        shot = Shot("disk_full", job.id, time.time(), self.committed(job))
        failed = len(_failed_checkpoints(job))
        with _filled(mount):
            _wait(lambda: len(_failed_checkpoints(job)) > failed, TIMEOUT_S,
                  "a checkpoint failing on the full disk")
            self.trained(run, steps=8)  # training goes on without checkpoints
        before = self.committed(job)
        _wait(lambda: self.committed(job) > before, TIMEOUT_S, "a checkpoint after freeing")
        run.shots.append(shot)
        self.trained(run)
        restarts = job.restarts
        # The preemption's checkpoint must be the only write on the full disk: a checkpoint
        # still in flight when it fills would free space after it (its commit prunes an
        # older one; a failed one is discarded) and the preemption's could then commit.
        # So step checkpoints stop first, and those already taken end.
        job.set(checkpoint_every=0)
        _wait(lambda: _checkpoints_settled(job), TIMEOUT_S, "the checkpoints in flight to end")
        shot = Shot("full_in_preempt", job.id, time.time(), self.committed(job))
        with _filled(mount):
            job.preempt()
            _wait(lambda: job.status is JobState.PREEMPTED, TIMEOUT_S, "preempted")
        lost = [e for e in job.events if e.get("kind") == "uncommitted"]
        shot.note = lost[-1]["reason"] if lost else "the preemption's checkpoint committed"
        if lost and job.restarts == restarts:
            self.uncharged += 1
        job.resume()
        run.shots.append(shot)
        self.trained(run)
        job.set(checkpoint_every=2)

    def group_of(self, address: str) -> str:
        info = self.c.client.scheduler_info()["workers"]
        name = str(info[address]["name"])  # "<group>-<i>" for dask worker --name <group>
        return name.rsplit("-", 1)[0] if name.rsplit("-", 1)[0] in self.groups else name

    def add_group(self) -> None:
        name = f"w{self.next_group}"
        self.next_group += 1
        self.cc.add_workers(1, name=name, env={"NBTRAIN_WORKER_HOST": f"node-{name}"})
        self.groups.append(name)

    # -- figures ------------------------------------------------------------------------------
    def judge(self) -> dict[str, Any]:
        equal, exact, lost, partial, recovery = [], [], 0, 0, []
        for run in self.runs:
            job = run.job
            started = [e for e in job.events if e.get("kind") == "rank_started"]
            by_gen: dict[int, list[dict[str, Any]]] = {}
            for e in started:
                by_gen.setdefault(int(e["generation"]), []).append(e)
            partial += sum(1 for evs in by_gen.values()
                           if len({int(e["start_step"]) for e in evs}) > 1)
            for shot in run.shots:
                after = sorted((min(float(e["time"]) for e in evs), int(evs[0]["start_step"]))
                               for evs in by_gen.values()
                               if min(float(e["time"]) for e in evs) > shot.time)
                if after:
                    lost += max(0, shot.committed - after[0][1])
                rows = job.metrics
                later = rows[(rows["rank"] == 0) & (rows["time"] > shot.time + 0.5)]
                if len(later) and shot.kind not in ("raise", "hang", *DISK_KINDS):
                    recovery.append(float(later["time"].min()) - shot.time)
            if not run.ok or run.final is None:
                print(f"  {job.name}: ended {job.status.value} ({job.reason}), final step "
                      f"{run.final}", flush=True)
                equal.append(False)
                exact.append(False)
                continue
            last = max(by_gen) if by_gen else 0
            ranks = sorted(int(e["rank"]) for e in by_gen.get(last, []))
            equal.append(_params_equal(run.out, run.final, ranks))
            ledger = account(run.out, run.final, n=N, global_batch_size=BATCH)
            exact.append(ledger.exactly_once)
            if not (equal[-1] and exact[-1]):
                print(f"  {job.name}: final step {run.final}, ranks {ranks} of generation "
                      f"{last}, params equal {equal[-1]}; {ledger}; faults "
                      f"{[s.kind for s in run.shots]}; {job.reason}", flush=True)
        shots = [s for r in self.runs for s in r.shots]
        return {
            "faults": len(shots),
            "by_kind": dict(sorted(Counter(s.kind for s in shots).items())),
            "jobs": len(self.runs),
            "succeeded": sum(r.ok for r in self.runs),
            "committed_steps_lost": lost,
            "partial_loads": partial,
            "params_equal": round(sum(equal) / len(equal), 3),
            "samples_exact": round(sum(exact) / len(exact), 3),
            "uncharged_preemptions": self.uncharged,
            "recovery_s": round(statistics.median(recovery), 2) if recovery else None,
            "kills_in_commit": sum(1 for s in shots if s.note == "in a commit"),
        }


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _until(cond: Callable[[], object], timeout: float, poll_s: float = 0.002) -> bool:
    """Whether ``cond`` came true within ``timeout`` seconds (asked every ``poll_s``)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def _checkpoints_settled(job: nbtrain.JobHandle) -> bool:
    """Every checkpoint a rank of the current generation snapshotted has ended there:
    committed, failed or skipped on the committer (rank 0, which prunes before it reports
    the commit), also persisted on the others."""
    open_: set[tuple[Any, Any]] = set()
    gen = job.generation
    for e in job.events:
        if e.get("kind") != "checkpoint" or e.get("generation") != gen:
            continue
        key = (e.get("rank"), e.get("step"))
        phase = e.get("phase")
        if phase == "snapshot":
            open_.add(key)
        elif phase in ("committed", "failed", "skipped") or (
                phase == "persisted" and key[0] != 0):
            open_.discard(key)
    return not open_


def _failed_checkpoints(job: nbtrain.JobHandle) -> list[dict[str, Any]]:
    return [e for e in job.events if e.get("kind") == "checkpoint" and e.get("phase") == "failed"]


@contextlib.contextmanager
def _filled(mount: Path) -> Any:
    """The tmpfs at ``mount`` full (a filler file takes all its free space)."""
    filler = mount / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12, 1 << 9, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
    try:
        yield
    finally:
        filler.unlink()


def _params_equal(out: Path, steps: int, ranks: list[int]) -> bool:
    expected = single_process_params(steps, batch=BATCH, n=N)
    for rank in ranks or [0]:
        got = torch.load(out / f"rank{rank}.pt")
        for name, value in expected.items():
            if not torch.allclose(got[name], value, rtol=0, atol=1e-6):
                return False
    return True


def mount_tmpfs(path: Path, size: str) -> str:
    """Mount a small tmpfs at ``path``; "" if done, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs for the full-disk faults"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return "" if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


def random_plan(jobs: int, per_job: int, rng: random.Random) -> list[list[str]]:
    """Each job's fault kinds: every kind at least once, the rest at random."""
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(jobs * per_job - len(KINDS))]
    rng.shuffle(kinds)
    return [kinds[j * per_job:(j + 1) * per_job] for j in range(jobs)]


def campaign(root: Path, mount: Path, disk_skipped: str, plan: list[list[str]],
             rng: random.Random) -> dict[str, Any]:
    """Run the jobs of ``plan`` (one list of fault kinds per job), then the full-disk job
    unless ``disk_skipped`` says why not; the figures."""
    settings = Settings.load(token_file="", checkpoint_root=str(root / "checkpoints"),
                             hang_floor_s=3.0, peer_release_s=0.3)
    with standalone_cluster(0, logs=root / "logs", scheduler_env=SCHEDULER_ENV,
                            supervise=True) as cc:
        for i in range(3):
            cc.add_workers(1, name=f"w{i}", env={"NBTRAIN_WORKER_HOST": f"node-w{i}"})
        with nbtrain.connect(cc.address, settings=settings) as c:
            _wait(lambda: len(c.free_slots) == 3, TIMEOUT_S, "three free slots")
            chaos = Campaign(cc, c, root, rng)
            for j, kinds in enumerate(plan):
                run = chaos.submit(elastic=j % 2 == 1)
                for kind in kinds:
                    chaos.shoot(run, "kill" if kind == "kill_in_resize" and not run.elastic
                                else kind)
                    _say(run)
                chaos.finish(run)
            if not disk_skipped:
                disk = Settings.load(token_file="", checkpoint_root=str(mount),
                                     hang_floor_s=3.0, peer_release_s=0.3)
                with nbtrain.connect(cc.address, settings=disk) as cd:
                    run = chaos.submit(elastic=False, c=cd, checkpoint=2, name="disk")
                    chaos.disk_faults(run, mount)
                    _say(run)
                    chaos.finish(run)
            return chaos.judge()


def _say(run: Run) -> None:
    for shot in run.shots[-2:] if run.shots[-1].kind in DISK_KINDS else run.shots[-1:]:
        print(f"{time.strftime('%H:%M:%S')} {run.job.name:10} {shot.kind:15} "
              f"{shot.note[:60]:60} committed {shot.committed:4} restarts {run.job.restarts}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="30+ faults (else 100+)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs with random faults")
    parser.add_argument("--faults-per-job", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    jobs = args.jobs or (5 if args.quick else 17)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nbtrain-chaos-") as tmp:
        root = Path(tmp)
        mount = root / "small-disk"
        disk_skipped = mount_tmpfs(mount, "4m")
        try:
            plan = random_plan(jobs, args.faults_per_job, rng)
            figures = campaign(root, mount, disk_skipped, plan, rng)
        finally:
            if not disk_skipped:
                subprocess.run(["umount", "-l", str(mount)], check=False)
    figures["disk_faults"] = "ran" if not disk_skipped else f"skipped: {disk_skipped}"
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    for key in ("faults", "jobs", "succeeded", "committed_steps_lost", "partial_loads",
                "params_equal", "samples_exact", "uncharged_preemptions", "recovery_s"):
        print(f"{key:24}{figures[key]!s:>8}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
