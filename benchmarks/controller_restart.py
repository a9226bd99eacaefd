"""Kill the scheduler (and with it nbtrain's controller) at random moments: does every job
come back, exactly, and how fast?

Cluster: a supervised standalone one (``dask scheduler --preload nbtrain.engine.preload`` on a
state directory, ``dask worker`` with 2 worker processes; the supervisor starts whichever
process exits again, as ``nbtrain cluster`` does). Each round SIGKILLs the scheduler while the
jobs are in one of these states (the moment drawn at random within it):

- ``training``: a 2-rank float64 job checkpointing every 10 steps;
- ``committing``: the same checkpointing every step (the kill lands in a commit or next to one);
- ``preempting``: a low-priority job in its preemption grace (a priority-5 job was just
  submitted; its ranks are checkpointing to release their slots);
- ``resizing``: an elastic job just asked to shrink from 2 ranks to 1;
- ``queued``: one job running and three queued behind the full cluster.

Figures (medians over kills where named so):

- ``jobs_lost``: jobs that did not end SUCCEEDED (or did not start in their queue order);
- ``committed_steps_lost``: checkpoints committed on disk at the kill that the resumed job
  did not resume from (newest committed step minus the step it resumed at, when positive);
- ``params_equal``: fraction of jobs whose final float64 parameters equal (1e-6) an
  uninterrupted single-process twin over the same global batches;
- ``workers_back_s``: kill to both slots online again in the new controller;
- ``resume_s``: workers back to the first step of the resumed job (rank 0's row);
- ``client_notice_s``: kill to the job's handle saying the controller is unreachable
  (median over the kills it noticed; ``client_unnoticed`` counts restarts faster than a
  follow call, which a handle may not see: it sees a controller only through its calls);
- ``restart_replay_s``: a scheduler started on a state directory holding 10,000 ended jobs
  (``--replay-jobs``): process start to its controller answering, and
  ``restart_replay_ratio`` against the same start on an empty directory (the peer);
  ``restore_s`` is the controller's own reading of the journal.

Usage: ``python benchmarks/controller_restart.py [--quick] [--rounds N]``; the last stdout line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain import JobState, Settings  # noqa: E402
from nbtrain.engine.remote import NOTICE_WITHIN_S  # noqa: E402
from nbtrain.engine.standalone import StandaloneCluster, standalone_cluster  # noqa: E402
from tests import recipes  # noqa: E402
from tests.recipes import Regression, single_process_params  # noqa: E402

cloudpickle.register_pickle_by_value(recipes)  # the workers cannot import tests/

SCENARIOS = ("training", "committing", "preempting", "resizing", "queued")


def _wait(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def _equal(out: Path, steps: int, ranks: int) -> bool:
    expected = single_process_params(steps)
    for rank in range(ranks):
        got = torch.load(out / f"rank{rank}.pt")
        for name, value in expected.items():
            if not torch.allclose(got[name], value, rtol=0, atol=1e-6):
                return False
    return True


def _committed(job: nbtrain.JobHandle) -> int:
    from nbtrain.runtime.storage import CheckpointStore

    return max(CheckpointStore(job.checkpoint_dir).committed(), default=0)


def _slots_online(c: nbtrain.Cluster) -> int:
    try:
        snap = c.snapshot()
    except Exception:
        return -1
    return sum(1 for s in snap["slots"] if s["state"] in ("free", "held"))


def _kill(cc: StandaloneCluster, c: nbtrain.Cluster, job: nbtrain.JobHandle
          ) -> dict[str, Any]:
    """SIGKILL the scheduler; measure the handle's notice and the workers' return."""
    gen, committed = job.generation, _committed(job)
    killed = time.time()
    cc.kill_scheduler()
    # A restart faster than a follow call may pass unnoticed by the handle (no call failed):
    # then notice_s is None, once the controller answers again after that window.
    _wait(lambda: job.unreachable_since is not None or (
        time.time() - killed > 2 * NOTICE_WITHIN_S and _slots_online(c) >= 0),
        60, "the handle to notice")
    notice = time.time() - killed if job.unreachable_since is not None else None
    _wait(lambda: _slots_online(c) == 2, 180, "both slots back")
    back = time.time()
    return {"killed": killed, "gen": gen, "committed": committed, "notice_s": notice,
            "back": back, "workers_back_s": back - killed}


def _resumed(job: nbtrain.JobHandle, kill: dict[str, Any]) -> dict[str, Any]:
    """After the job ended: when its first step after the restart ran, what it resumed from."""
    m = job.metrics
    after = m[(m["generation"] > kill["gen"]) & (m["rank"] == 0)]
    if not len(after):
        print(f"  (job {job.name}: no step after the restart in {len(m)} rows; generations "
              f"{sorted(set(m['generation']))}, killed in {kill['gen']})", flush=True)
        return {"resume_s": None, "lost": 0}
    first = after.sort_values("time").iloc[0]
    return {"resume_s": float(first["time"]) - kill["back"],
            "lost": max(0, kill["committed"] - (int(first["step"]) - 1))}


def round_training(cc: StandaloneCluster, c: nbtrain.Cluster, rng: random.Random,
                   root: Path, every: int) -> dict[str, Any]:
    out = root / f"out-{time.monotonic_ns()}"
    out.mkdir()
    steps = 150
    job = c.submit(Regression(out_dir=str(out), step_sleep=0.02), world_size=2, steps=steps,
                   checkpoint=every, name=f"train-{every}")
    at = rng.randint(25, 90)
    _wait(lambda: job.step >= at, 180, f"step {at}")
    kill = _kill(cc, c, job)
    ok = job.wait(300) is JobState.SUCCEEDED
    res = _resumed(job, kill)
    return {**kill, **res, "jobs": 1, "jobs_lost": 0 if ok else 1,
            "equal": [ok and _equal(out, steps, 2)], "at": f"step {at}"}


def round_preempting(cc: StandaloneCluster, c: nbtrain.Cluster, rng: random.Random,
                     root: Path) -> dict[str, Any]:
    out = root / f"out-{time.monotonic_ns()}"
    out.mkdir()
    steps = 60
    low = c.submit(Regression(out_dir=str(out), step_sleep=0.2), world_size=2, steps=steps,
                   checkpoint=None, name="low")
    _wait(lambda: low.step >= 10, 180, "the low job training")
    high = c.submit(Regression(), world_size=2, steps=20, checkpoint=None, priority=5,
                    name="high")
    delay = rng.uniform(0.0, 0.3)
    time.sleep(delay)  # the kill lands inside the grace period (the ranks checkpointing)
    kill = _kill(cc, c, low)
    ok = [j.wait(300) is JobState.SUCCEEDED for j in (high, low)]
    res = _resumed(low, kill)
    return {**kill, **res, "jobs": 2, "jobs_lost": ok.count(False),
            "equal": [all(ok) and _equal(out, steps, 2)], "at": f"grace +{delay:.2f} s"}


def round_resizing(cc: StandaloneCluster, c: nbtrain.Cluster, rng: random.Random,
                   root: Path) -> dict[str, Any]:
    out = root / f"out-{time.monotonic_ns()}"
    out.mkdir()
    steps = 150
    job = c.submit(Regression(out_dir=str(out), step_sleep=0.02), world_size=2, min_size=1,
                   steps=steps, checkpoint=10, name="elastic")
    _wait(lambda: job.step >= 30, 180, "the elastic job training")
    job.resize(1)
    delay = rng.uniform(0.0, 0.3)
    time.sleep(delay)
    kill = _kill(cc, c, job)
    ok = job.wait(300) is JobState.SUCCEEDED
    res = _resumed(job, kill)
    return {**kill, **res, "jobs": 1, "jobs_lost": 0 if ok else 1,
            "equal": [ok and _equal(out, steps, 1)],
            "at": f"resize +{delay:.2f} s"}


def round_queued(cc: StandaloneCluster, c: nbtrain.Cluster, rng: random.Random,
                 root: Path) -> dict[str, Any]:
    outs = [root / f"out-{time.monotonic_ns()}-{i}" for i in range(4)]
    for o in outs:
        o.mkdir()
    running = c.submit(Regression(out_dir=str(outs[0]), step_sleep=0.02), world_size=2,
                       steps=100, checkpoint=10, name="running")
    queued = [c.submit(Regression(out_dir=str(outs[i + 1])), world_size=2, steps=20,
                       checkpoint=None, name=f"queued-{i}") for i in range(3)]
    at = rng.randint(20, 70)
    _wait(lambda: running.step >= at, 180, f"step {at}")
    kill = _kill(cc, c, running)
    ok = [j.wait(300) is JobState.SUCCEEDED for j in (running, *queued)]
    starts = [j.started_at or 0.0 for j in queued]
    in_order = starts == sorted(starts)
    res = _resumed(running, kill)
    equal = [ok[0] and _equal(outs[0], 100, 2)] + [
        ok[i + 1] and _equal(outs[i + 1], 20, 2) for i in range(3)]
    return {**kill, **res, "jobs": 4, "jobs_lost": ok.count(False) + (0 if in_order else 1),
            "equal": equal, "at": f"step {at}"}


def replay(n_jobs: int, root: Path) -> dict[str, float]:
    """A scheduler on a state directory of ``n_jobs`` ended jobs vs on an empty one."""
    from nbtrain.core.job import JobSpec
    from nbtrain.core.lifecycle_types import JobSubmission
    from nbtrain.engine.standalone import start
    from nbtrain.engine.store import ControllerStore
    from nbtrain.engine.wire import submission_to_wire

    full = root / "replay-full"
    store = ControllerStore(full)
    t0 = time.perf_counter()
    for i in range(n_jobs):
        jid = f"{i:08x}"
        spec = JobSpec(job_id=jid, name=f"old-{i % 50}", world_size=2, steps=100)
        status = {"job_id": jid, "name": spec.name, "state": "SUCCEEDED", "reason": "done",
                  "step": 100, "ended": 1e9 + i, "owner": "bench"}
        store.add_job(job_id=jid, name=spec.name,
                      submission=submission_to_wire(JobSubmission(spec=spec)),
                      recipe=b"r" * 200, settings={}, checkpoint_url=f"/tmp/ck/{jid}",
                      restore=None, token_hash="0" * 64, trackers=None, status=status)
        store.put_status(jid, status, None)
        store.add_history("events", jid, 0, [{"kind": "state", "state": "SUCCEEDED",
                                              "time": 1e9 + i}] * 3)
        store.add_history("rows", jid, 0, [[0, 0, s, 1e9 + s, 0.01, 0, 0.01, 0, 0]
                                           for s in range(10)])
    store.close(120)
    written = time.perf_counter() - t0
    out: dict[str, float] = {"replay_write_s": written}
    for label, state in (("empty", root / "replay-empty"), ("full", full)):
        t1 = time.monotonic()
        cluster = start(0, logs=root / f"logs-{label}", state_dir=state)
        try:
            with nbtrain.connect(cluster.address, settings=Settings.load(token_file="")) as c:
                c.jobs  # noqa: B018 - the controller answers
                ready = time.monotonic() - t1
                log = c.snapshot()["log"]
                restored = [e for e in log if e.get("kind") == "restored"]
        finally:
            cluster.stop()
        out[f"{label}_ready_s"] = ready
        if restored:
            out["restore_s"] = float(restored[-1]["seconds"])
            out["restored_jobs"] = float(restored[-1]["jobs"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one kill per scenario")
    parser.add_argument("--rounds", type=int, default=None, help="kills per scenario")
    parser.add_argument("--replay-jobs", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    rng = random.Random(args.seed)
    tmp = tempfile.TemporaryDirectory(prefix="nbtrain-restart-")
    root = Path(tmp.name)
    settings = Settings.load(token_file="", checkpoint_root=str(root / "checkpoints"))
    results: list[dict[str, Any]] = []
    with tmp, standalone_cluster(2, logs=root / "logs", supervise=True) as cc, \
            nbtrain.connect(cc.address, settings=settings) as c:
        plan = [s for _ in range(rounds) for s in SCENARIOS]
        for scenario in plan:
            if scenario == "training":
                r = round_training(cc, c, rng, root, 10)
            elif scenario == "committing":
                r = round_training(cc, c, rng, root, 1)
            elif scenario == "preempting":
                r = round_preempting(cc, c, rng, root)
            elif scenario == "resizing":
                r = round_resizing(cc, c, rng, root)
            else:
                r = round_queued(cc, c, rng, root)
            r["scenario"] = scenario
            results.append(r)
            noticed = "unseen" if r["notice_s"] is None else f"{r['notice_s']:.2f} s"
            print(f"{scenario:11} kill at {r['at']:16} notice {noticed:>7}  "
                  f"workers back {r['workers_back_s']:5.2f} s  resume "
                  f"{r['resume_s'] if r['resume_s'] is None else round(r['resume_s'], 2)} s  "
                  f"lost jobs {r['jobs_lost']}  lost committed steps {r['lost']}  "
                  f"equal {r['equal']}", flush=True)
        rep = replay(args.replay_jobs, root)
    equal = [e for r in results for e in r["equal"]]
    resume = [r["resume_s"] for r in results if r["resume_s"] is not None]
    notices = [r["notice_s"] for r in results if r["notice_s"] is not None]
    figures = {
        "kills": len(results),
        "jobs": sum(r["jobs"] for r in results),
        "jobs_lost": sum(r["jobs_lost"] for r in results),
        "committed_steps_lost": sum(r["lost"] for r in results),
        "params_equal": round(sum(equal) / len(equal), 3),
        "workers_back_s": round(statistics.median(r["workers_back_s"] for r in results), 2),
        "resume_s": round(statistics.median(resume), 2) if resume else None,
        "client_notice_s": round(statistics.median(notices), 2) if notices else None,
        "client_unnoticed": len(results) - len(notices),
        "restart_replay_s": round(rep["full_ready_s"], 2),
        "restart_replay_empty_s": round(rep["empty_ready_s"], 2),
        "restart_replay_ratio": round(rep["full_ready_s"] / rep["empty_ready_s"], 2),
        "restore_s": round(rep.get("restore_s", float("nan")), 3),
        "replay_jobs": args.replay_jobs,
        "per_kill": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                      if k in ("scenario", "at", "notice_s", "workers_back_s", "resume_s",
                               "lost", "jobs_lost")} for r in results],
    }
    print(f"\n{'kills':24}{figures['kills']:>8}")
    print(f"{'jobs_lost':24}{figures['jobs_lost']:>8}   target 0")
    print(f"{'committed_steps_lost':24}{figures['committed_steps_lost']:>8}   target 0")
    print(f"{'params_equal':24}{figures['params_equal']:>8}   target 1.0")
    print(f"{'workers_back_s':24}{figures['workers_back_s']:>8}")
    print(f"{'resume_s':24}{figures['resume_s']!s:>8}   target <= 10")
    print(f"{'client_notice_s':24}{figures['client_notice_s']!s:>8}   target <= 5 "
          f"({figures['client_unnoticed']} restarts too quick to notice)")
    print(f"{'restart_replay_s':24}{figures['restart_replay_s']:>8}   target <= 5 "
          f"({args.replay_jobs} ended jobs; empty directory "
          f"{figures['restart_replay_empty_s']} s)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
