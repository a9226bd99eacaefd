"""The short version of ``benchmarks/chaos.py``: every fault kind once on a real supervised
cluster (rank kills at random moments, in a commit, in a preemption's grace and in a resize,
an exception, a hang, a worker that never returns, a scheduler kill, a full disk while
training and during a preemption), each job compared with its uninterrupted twin."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import load_file_module

ROOT = Path(__file__).resolve().parent.parent

# Ten faults, each with its recovery, on a supervised cluster: 230 s here beside the browser
# test; pytest-timeout's default 300 s cut a loaded CI run short. A hang guard, no more.
pytestmark = pytest.mark.timeout(600)


def _chaos() -> ModuleType:
    return load_file_module(ROOT / "benchmarks" / "chaos.py", "nbtrain_chaos_bench")


def test_every_fault_kind_once_loses_and_corrupts_nothing(tmp_path: Path) -> None:
    chaos = _chaos()
    plan = [["kill_in_commit", "kill_in_grace", "worker_gone", "scheduler"],
            ["kill_in_resize", "kill", "raise", "hang"]]
    assert {k for kinds in plan for k in kinds} == set(chaos.KINDS)
    mount = tmp_path / "small-disk"
    skipped = chaos.mount_tmpfs(mount, "4m")
    try:
        figures = chaos.campaign(tmp_path, mount, skipped, plan, random.Random(0))
    finally:
        if not skipped:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    disk = 0 if skipped else 2
    print(figures, f"(full-disk faults: {skipped or 'ran'})")
    assert figures["faults"] == 8 + disk
    assert figures["succeeded"] == figures["jobs"]
    assert figures["committed_steps_lost"] == 0
    assert figures["partial_loads"] == 0
    assert figures["params_equal"] == 1.0 and figures["samples_exact"] == 1.0
    if not skipped:
        # The preemption whose checkpoint could not commit resumed uncharged.
        assert figures["uncharged_preemptions"] == 1
