"""The detector on step timings recorded live on this project's 2-core machine (no cluster).

``tests/data/stragglers/`` holds two 2-rank ``DigitsMLP(hidden=512, layers=3)`` runs recorded
with ``benchmarks/_straggler_live.py``, as per-step phase times of both ranks:

- ``busy-2rank.npz``: a healthy job while a CPU-bound process ran unpinned beside it, so the
  kernel put it on one rank's core and then the other's. The previous detector (suspect for
  30 steps = confirmed) confirmed 8 stragglers in its 1,500 steps.
- ``hog-rank1.npz``: ranks pinned one per core on a machine busy with other tests, then a
  CPU hog pinned to rank 1's core from ``onset_step``: rank 1's compute takes about 1.8x.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nbtrain.core.records import Phase, StepFrame
from nbtrain.core.straggler import Diagnosis, StragglerDetector, Verdict

DATA = Path(__file__).parent / "data" / "stragglers"


def replay(name: str) -> tuple[list[Diagnosis], dict[str, Any]]:
    with np.load(DATA / name) as z:
        steps, step_s, phases = z["steps"], z["step_s"], z["phases"]
        meta = json.loads(str(z["meta"]))
    det = StragglerDetector(phases.shape[2], start_step=int(steps[0]))
    events: list[Diagnosis] = []
    for k, step in enumerate(steps):
        events += det.observe_frame(StepFrame(step=int(step), step_s=step_s[k],
                                              phases=phases[k]))
    meta["steps"] = len(steps)
    return events, meta


def test_a_healthy_job_on_a_busy_machine_confirms_nothing() -> None:
    events, meta = replay("busy-2rank.npz")
    assert meta["steps"] == 1500 and meta["hog_rank"] is None
    assert [e for e in events if e.state is Verdict.CONFIRMED] == []
    # the early signal still fires: these are the slowdowns that passed
    assert len([e for e in events if e.state is Verdict.SUSPECT]) > 10


def test_a_cpu_hog_on_one_ranks_core_is_confirmed_on_that_rank_and_phase() -> None:
    events, meta = replay("hog-rank1.npz")
    onset = meta["onset_step"]
    confirmed = [e for e in events if e.state is Verdict.CONFIRMED]
    assert confirmed, [e.summary() for e in events]
    assert all(e.step >= onset and e.rank == 1 for e in confirmed)
    first = confirmed[0]
    assert (first.rank, first.phase) == (1, Phase.COMPUTE)
    assert first.step - onset <= 50  # the target for live_hog_latency_steps
    assert 1.5 < first.ratio < 2.5 and first.step_share > 0.15
