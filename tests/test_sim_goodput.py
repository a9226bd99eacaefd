"""The simulator's speedup curves and the goodput policy: traces keep their other columns,
curves have the shapes their docstring claims, the goodput replay is deterministic and
finishes every job, and where jobs scale poorly at the size asked for it finishes them sooner."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from nbtrain.core.topology import Topology
from nbtrain.sim.cli import main as sim_main
from nbtrain.sim.gang import simulate_gang
from nbtrain.sim.speedups import WORKLOADS, with_speedups
from nbtrain.sim.trace import TraceJob, generate, load_csv, save_csv

TOPO = Topology.declare(16, 8, hosts_per_leaf=4, leaves_per_pod=2)


def test_curves_are_seeded_and_leave_the_other_columns_alone() -> None:
    base = generate(200, TOPO.n_slots, load=1.4, seed=3, max_size=32)
    a = with_speedups(base, seed=3)
    assert a == with_speedups(base, seed=3) and a != with_speedups(base, seed=4)
    strip = {"serial": None, "sync": None, "sync_per_rank": None, "max_size": None}
    assert [dataclasses.replace(j, **strip) for j in a] == base  # type: ignore[arg-type]
    assert all(j.has_curve for j in a)
    assert all(j.max_size == 2 * j.size for j in a if j.min_size is not None)
    el = with_speedups(base, seed=3, elastic_fraction=1.0, max_size=32)
    assert all(j.min_size == j.tp * j.pp for j in el if j.size >= 2 * j.tp * j.pp)
    assert all(j.max_size is not None and j.max_size <= 32 for j in el if j.min_size)


@pytest.mark.parametrize(("name", "at8", "at64"), [
    ("cnn-imagenet", (6.5, 8.0), (25.0, 45.0)),
    ("transformer-finetune", (5.0, 6.5), (9.0, 16.0)),
    ("detection-speech", (5.0, 6.8), (11.0, 20.0)),
    ("small-model", (3.0, 4.5), (2.5, 6.0)),
])
def test_each_workload_class_scales_as_documented(name: str, at8: tuple[float, float],
                                                  at64: tuple[float, float]) -> None:
    _, serial, sync, per_rank = WORKLOADS[name]
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, c, d = (float(rng.uniform(lo, hi)) for lo, hi in (serial, sync, per_rank))
        job = TraceJob(job_id="x", submit_s=0.0, size=1, duration_s=1.0, serial=a, sync=c,
                       sync_per_rank=d)
        for n, (lo, hi) in ((8, at8), (64, at64)):
            assert lo <= job.step_s(1) / job.step_s(n) <= hi


def test_a_trace_with_curves_round_trips_through_csv(tmp_path: Path) -> None:
    jobs = with_speedups(generate(30, 64, seed=2, max_size=16), seed=2)
    save_csv(jobs, tmp_path / "t.csv")
    assert load_csv(tmp_path / "t.csv") == jobs
    with pytest.raises(ValueError, match="set together or not at all"):
        TraceJob(job_id="x", submit_s=0.0, size=1, duration_s=1.0, serial=0.1)


def _poor_scalers(n: int, seed: int) -> list[TraceJob]:
    """Jobs that ask for 32 ranks and gain little past 8 (the small-model class)."""
    rng = np.random.default_rng(seed)
    dur = rng.lognormal(np.log(3600.0), 0.5, size=n)
    gaps = rng.exponential(float(dur.mean()) * 32 / (1.4 * TOPO.n_slots), size=n)
    return [TraceJob(job_id=f"p{i:03d}", submit_s=round(float(t), 3), size=32,
                     duration_s=round(float(d), 3), min_size=2, max_size=64,
                     est_duration_s=round(float(d) * 1.5, 3), serial=0.04, sync=0.1,
                     sync_per_rank=0.001)
            for i, (t, d) in enumerate(zip(np.cumsum(gaps), dur, strict=True))]


def test_goodput_sizing_finishes_poorly_scaling_jobs_sooner_and_replays_exactly() -> None:
    trace = _poor_scalers(80, seed=5)
    base = simulate_gang(TOPO, trace, "nbtrain", seed=5)
    gp = simulate_gang(TOPO, trace, "goodput", seed=5)
    assert gp.schedule_hash == simulate_gang(TOPO, trace, "goodput", seed=5).schedule_hash
    assert gp.schedule_hash != base.schedule_hash
    assert gp.metrics["finished"] == base.metrics["finished"] == len(trace)
    assert gp.metrics["jct_mean_h"] < 0.9 * base.metrics["jct_mean_h"]
    assert gp.metrics["resizes"] > 0


def test_the_goodput_policy_leaves_jobs_without_curves_as_nbtrain_runs_them() -> None:
    trace = generate(150, TOPO.n_slots, load=1.2, seed=6, max_size=32, elastic_fraction=0.0)
    assert (simulate_gang(TOPO, trace, "goodput", seed=6).schedule_hash
            == simulate_gang(TOPO, trace, "nbtrain", seed=6).schedule_hash)


def test_cli_replays_the_goodput_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["--hosts", "8", "--jobs", "120", "--load", "1.4", "--policy",
                     "nbtrain,goodput", "--progress", "0"]) == 0
    out = capsys.readouterr().out
    assert "with speedup curves" in out
    assert any(line.split()[:1] == ["goodput"] for line in out.splitlines())
