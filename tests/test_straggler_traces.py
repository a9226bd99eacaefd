"""The detector on step timings recorded live on this project's 2-core machine (no cluster).

``tests/data/stragglers/`` holds two 2-rank ``DigitsMLP(hidden=512, layers=3)`` runs recorded
with ``benchmarks/_straggler_live.py``, as per-step phase times of both ranks:

- ``busy-2rank.npz``: a healthy job while a CPU-bound process ran unpinned beside it, so the
  kernel put it on one rank's core and then the other's. The previous detector (suspect for
  30 steps = confirmed) confirmed 8 stragglers in its 1,500 steps.
- ``hog-rank1.npz``: ranks pinned one per core on a machine busy with other tests, then a
  CPU hog pinned to rank 1's core from ``onset_step``: rank 1's compute takes about 1.8x.

Recorded for issue 31 (float16 seconds) on the same machine while two other engineers' test
suites and benchmarks ran on it (load average 5-9 on 2 cores):

- ``busy-heavy.npz`` (60 ms steps), ``busy-mlp.npz`` (17 ms) and ``clean-mlp.npz`` (8 ms):
  healthy 2,500-step jobs, the first two beside an unpinned CPU hog.
- ``pinned-hog-r1-a.npz``, ``pinned-hog-r1-b.npz``, ``pinned-hog-r0.npz``: ranks pinned one
  per core, a CPU hog pinned to one rank's core from step ~560 for 1,200-1,800 steps. The
  hogged rank's compute is 1.5-2.5x its peer's on about two steps of three: the previous
  rule (slow on 70% of 32 steps, cleared by 6 fast steps of 8) confirmed the first never and
  flapped between suspect and cleared on all three, 11-14 times each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nbtrain.core.records import PHASES, Phase, StepFrame
from nbtrain.core.straggler import Diagnosis, StragglerDetector, StragglerSettings, Verdict

DATA = Path(__file__).parent / "data" / "stragglers"


def replay(name: str) -> tuple[list[Diagnosis], dict[str, Any]]:
    with np.load(DATA / name) as z:
        steps = z["steps"].astype(np.int64)
        step_s, phases = z["step_s"].astype(np.float64), z["phases"].astype(np.float64)
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
    # 26 steps under the previous rule, 53 now: this hog's run of slow steps began at step
    # 178, before the onset, and is judged against the noise measured then (the benchmark's
    # live_hog_latency_steps is the median over trials, target <= 50)
    assert first.step - onset <= 60
    assert 1.5 < first.ratio < 2.5 and first.step_share > 0.15


HEALTHY = ["busy-heavy.npz", "busy-mlp.npz", "clean-mlp.npz"]
PINNED = ["pinned-hog-r1-a.npz", "pinned-hog-r1-b.npz", "pinned-hog-r0.npz"]


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_jobs_on_a_loaded_machine_confirm_nothing(name: str) -> None:
    events, meta = replay(name)
    assert meta["hog_rank"] is None and meta["steps"] == 2500
    assert [e.summary() for e in events if e.state is Verdict.CONFIRMED] == []


@pytest.mark.parametrize("name", PINNED)
def test_a_pinned_hog_is_confirmed_and_stays_confirmed_while_it_costs(name: str) -> None:
    events, meta = replay(name)
    onset, hog = meta["onset_step"], meta["hog_rank"]
    pair = [e for e in events if (e.rank, e.phase) == (hog, Phase.COMPUTE) and e.step >= onset]
    after = [e for e in events if e.step >= onset and e.state is Verdict.CONFIRMED]
    assert after, [e.summary() for e in pair]
    assert {e.rank for e in after} == {hog}
    first = after[0]
    assert first.phase is Phase.COMPUTE
    # on this loaded machine (its noise 10-15% of a step) within 120 steps; the benchmark
    # measures how quickly on a quiet one
    assert first.step - onset <= 120
    assert first.step_share >= StragglerSettings().confirm_share
    # no flapping: it stays confirmed for hundreds of steps, and a clearing comes only once
    # the cost is gone (the peer then slowed as much, by the other processes on its core)
    cleared = [e for e in pair if e.state is Verdict.CLEARED and e.step > first.step]
    assert not cleared or cleared[0].step - first.step >= 250
    if cleared:
        assert cleared[0].step_share < StragglerSettings().clear_share * 2


def test_the_hogged_rank_is_slow_on_too_few_steps_for_a_vote_and_is_confirmed_anyway() -> None:
    # the cause of issue 31's flapping: the rank alternates fast and slow steps
    with np.load(DATA / "pinned-hog-r1-a.npz") as z:
        phases = z["phases"].astype(np.float64)
        onset = json.loads(str(z["meta"]))["onset_step"] - int(z["steps"][0])
    compute = phases[onset:, PHASES.index(Phase.COMPUTE)]
    slow = compute[:, 1] >= StragglerSettings().ratio * compute[:, 0]
    assert 0.5 < slow.mean() < 0.7  # the previous rule asked for 70% of 32 steps
    events, _ = replay("pinned-hog-r1-a.npz")
    assert any(e.state is Verdict.CONFIRMED and e.rank == 1 for e in events)


# Recorded 2026-12-02 (issue 31): ranks pinned one per core beside a background CPU hog at
# nice 19, then a hog pinned to one rank's core from ``onset_step`` for ~390 steps; the
# hogged rank's compute ~19 ms against its peer's ~10 ms on ~30 ms steps. Live, the 32-step
# rule never confirmed either: the noise when the slowdown began (its compute wandered ~2
# ms) put the bar at ~8.5 ms, above the 4-7 ms the rank cost in its weakest block.
LOADED = ["loaded-hog-r0.npz", "loaded-hog-r1.npz"]


@pytest.mark.parametrize("name", LOADED)
def test_a_hog_on_a_busy_machine_is_confirmed_once_its_cost_lasts(name: str) -> None:
    events, meta = replay(name)
    onset, hog = meta["onset_step"], meta["hog_rank"]
    confirmed = [e for e in events if e.state is Verdict.CONFIRMED]
    assert confirmed, [e.summary() for e in events]
    assert all(e.step >= onset and e.rank == hog for e in confirmed)
    first = confirmed[0]
    assert first.phase is Phase.COMPUTE and first.step_share >= 0.1
    assert first.step - onset <= 120
    # the lasting path is what confirms it: without it the trace stays suspect
    with np.load(DATA / name) as z:
        steps, step_s, phases = z["steps"], z["step_s"], z["phases"]
    det = StragglerDetector(2, StragglerSettings(sustain_steps=0), start_step=int(steps[0]))
    off = [d for k, step in enumerate(steps)
           for d in det.observe_frame(StepFrame(step=int(step), step_s=step_s[k].astype(float),
                                                phases=phases[k].astype(float)))]
    assert not [d for d in off if d.state is Verdict.CONFIRMED]
