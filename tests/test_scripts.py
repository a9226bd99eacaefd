"""Unmodified torchrun-style scripts: ``cluster.submit_script`` and ``nbtrain run SCRIPT``.

The script below is what a torchrun user has: argparse, ``init_process_group("gloo")`` with
the env:// defaults, DDP, its own snapshot file every few steps that it resumes from, and a
SIGTERM handler that snapshots and exits. Nothing in it knows nbtrain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nbtrain
from tests.conftest import wait_for

SCRIPT = textwrap.dedent('''
    import argparse, os, signal, sys, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def main():
        p = argparse.ArgumentParser()
        p.add_argument("--steps", type=int, default=12)
        p.add_argument("--every", type=int, default=3)
        p.add_argument("--snapshot", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--sleep", type=float, default=0.0)
        a = p.parse_args()
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        step = 0

        def save():
            if rank == 0:
                tmp = a.snapshot + ".tmp"
                torch.save({"step": step, "model": model.state_dict(),
                            "opt": opt.state_dict()}, tmp)
                os.replace(tmp, a.snapshot)

        if os.path.exists(a.snapshot):
            snap = torch.load(a.snapshot)
            model.load_state_dict(snap["model"]); opt.load_state_dict(snap["opt"])
            step = snap["step"]
            print(f"rank {rank} resumed at step {step}", flush=True)
        term = []
        signal.signal(signal.SIGTERM, lambda *_: term.append(1))
        print(f"rank {rank} of {world} starts at step {step} "
              f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
        while step < a.steps:
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad(); loss.backward(); opt.step()
            step += 1
            if a.sleep:
                time.sleep(a.sleep)
            flag = torch.tensor([len(term)])
            dist.all_reduce(flag)  # every rank stops at the same step
            if flag.item():
                save()
                print(f"rank {rank} got SIGTERM, snapshot at step {step}", flush=True)
                dist.destroy_process_group()
                sys.exit(0)
            if step % a.every == 0:
                save()
        if rank == 0:
            torch.save(model.module.state_dict(), a.out)
        print(f"rank {rank} done at step {step}", flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
''')


def _script(tmp: Path) -> Path:
    path = tmp / "train.py"
    path.write_text(SCRIPT)
    return path


STEPS = 12


@pytest.fixture(scope="module")
def reference(cluster: nbtrain.Cluster, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[nbtrain.JobHandle, dict[str, torch.Tensor]]:
    """One uninterrupted run of the script (12 steps): the job, and its final parameters,
    which the killed and the preempted runs must equal."""
    ref = tmp_path_factory.mktemp("script-ref")
    job = cluster.submit_script(_script(ref), world_size=2, name="script-ref", args=[
        "--steps", str(STEPS), "--snapshot", str(ref / "snap.pt"), "--out",
        str(ref / "final.pt")])
    assert job.wait(120) is nbtrain.JobState.SUCCEEDED, job.error
    return job, dict(torch.load(ref / "final.pt"))


def _child_pid(job: nbtrain.JobHandle, rank: int, generation: int) -> int:
    for ev in job.events:
        if (ev.get("kind") == "rank_started" and ev.get("rank") == rank
                and ev.get("generation", ev.get("gen")) == generation):
            return int(ev["pid"])
    return 0


def test_a_script_runs_with_its_output_and_one_step_row_per_optimizer_step(
        reference: tuple[nbtrain.JobHandle, dict[str, torch.Tensor]]) -> None:
    job, _ = reference
    logs = job.logs()
    assert "[rank 0 g0] rank 0 of 2 starts at step 0 restart 0" in logs
    assert f"[rank 1 g0] rank 1 done at step {STEPS}" in logs
    m = job.metrics
    assert sorted(m.groupby("rank").size().to_dict().items()) == [(0, STEPS), (1, STEPS)]
    assert sorted(m[m["rank"] == 1]["step"].tolist()) == list(range(1, STEPS + 1))
    assert (m["step_s"] > 0).all() and (m["opt_s"] > 0).all()


def test_a_killed_rank_recovers_from_the_scripts_own_snapshot_exactly(
        free_cluster: nbtrain.Cluster, tmp_path: Path,
        reference: tuple[nbtrain.JobHandle, dict[str, torch.Tensor]]) -> None:
    steps, expected = STEPS, reference[1]
    snap = tmp_path / "snap.pt"
    job = free_cluster.submit_script(_script(tmp_path), world_size=2, name="script-kill", args=[
        "--steps", str(steps), "--every", "3", "--snapshot", str(snap),
        "--out", str(tmp_path / "final.pt"), "--sleep", "0.1"])
    wait_for(lambda: snap.exists() and _child_pid(job, 1, 0), 120, "a snapshot and rank 1")
    os.kill(_child_pid(job, 1, 0), signal.SIGKILL)
    assert job.wait(180) is nbtrain.JobState.SUCCEEDED, job.error
    failed = [e for e in job.events if e.get("kind") == "rank_failed"]
    assert any("killed by signal 9 (SIGKILL)" in str(e.get("error")) for e in failed), failed
    assert any("resumed at step" in line for line in job.logs(rank=0))
    got = torch.load(tmp_path / "final.pt")
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_a_preempted_script_snapshots_on_sigterm_and_resumes(
        free_cluster: nbtrain.Cluster, tmp_path: Path,
        reference: tuple[nbtrain.JobHandle, dict[str, torch.Tensor]]) -> None:
    steps, expected = STEPS, reference[1]
    snap = tmp_path / "snap.pt"
    job = free_cluster.submit_script(_script(tmp_path), world_size=2, name="script-preempt",
                                     args=["--steps", str(steps), "--every", "100",
                                           "--snapshot", str(snap),
                                           "--out", str(tmp_path / "final.pt"),
                                           "--sleep", "0.1"])
    wait_for(lambda: len(job.metrics) >= 4, 120, "a few steps")
    job.preempt()
    wait_for(lambda: job.status is nbtrain.JobState.PREEMPTED, 120, "PREEMPTED")
    assert snap.exists()  # written by the SIGTERM handler (--every 100 never fires)
    assert any("got SIGTERM, snapshot at step" in line for line in job.logs(rank=0))
    job.resume()
    assert job.wait(180) is nbtrain.JobState.SUCCEEDED, job.error
    assert any("resumed at step" in line for line in job.logs(rank=1))
    got = torch.load(tmp_path / "final.pt")
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_nbtrain_run_runs_a_script_with_its_arguments(tmp_path: Path) -> None:
    _script(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "nbtrain", "run", "train.py", "--world-size", "2",
         "--report", "", "--", "--steps", "4", "--snapshot", "s.pt", "--out", "f.pt"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "[rank 1 g0] rank 1 done at step 4" in out.stdout
    assert (tmp_path / "f.pt").exists()  # relative paths: the client's directory
