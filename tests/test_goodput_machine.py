"""Goodput sizing through the job machine (pure, hand clock): the spec's validation, the
request the scheduler gets, and rank 0's step rows reaching the job's goodput model."""

from __future__ import annotations

import pytest

from nbtrain.core.job import JobSpec
from tests.test_lifecycle import Harness


def _model_sizes(h: Harness, job_id: str) -> tuple[int, ...]:
    assert h.m.sched is not None
    model = h.m.sched.goodput_model(job_id)
    return () if model is None else model.sizes


def test_a_goodput_job_spec_is_validated_with_the_fix() -> None:
    with pytest.raises(ValueError, match="sizing must be one of"):
        JobSpec(job_id="a", name="a", world_size=2, steps=10, sizing="fast")
    with pytest.raises(ValueError, match="set min_size below world_size=2 or max_size"):
        JobSpec(job_id="a", name="a", world_size=2, steps=10, sizing="goodput")
    ok = JobSpec(job_id="a", name="a", world_size=2, steps=10, max_size=4, sizing="goodput")
    assert ok.describe()["sizing"] == "goodput"


def test_rank_zero_step_rows_of_a_goodput_job_feed_its_model() -> None:
    h = Harness(workers=4)
    h.submit("g", 2, min_size=1, sizing="goodput")
    h.submit("f", 2, min_size=1)
    for job_id in ("g", "f"):
        h.steps(job_id, h.launches(job_id)[-1].generation, 5, step_s=0.02)
        assert h.state(job_id) == "RUNNING"
    assert _model_sizes(h, "g") == (2,)
    assert _model_sizes(h, "f") == ()  # a fixed job has no model


def test_the_goodput_interval_is_a_setting_with_the_schedulers_default() -> None:
    from nbtrain.config import Settings
    from nbtrain.core.sched_types import SchedulerConfig

    assert Settings.load().goodput_interval_s == SchedulerConfig().goodput_interval_s
    assert Settings.load(goodput_interval_s=60).goodput_interval_s == 60.0
    with pytest.raises(ValueError, match="goodput_interval_s must be > 0"):
        Settings.load(goodput_interval_s=-1)


def test_a_goodput_jobs_status_carries_its_curve_and_a_fixed_jobs_does_not() -> None:
    h = Harness(workers=4)
    h.submit("g", 2, min_size=1, max_size=4, sizing="goodput")
    h.submit("f", 2, min_size=1)
    for job_id in ("g", "f"):
        h.steps(job_id, h.launches(job_id)[-1].generation, 5, step_s=0.02)
    points = h.m.status("g").speedup
    assert [p["size"] for p in points] == [1.0, 2.0, 3.0, 4.0]
    [measured] = [p for p in points if "step_s" in p]
    assert measured["size"] == 2.0 and measured["step_s"] == pytest.approx(0.02)
    assert measured["steps"] >= 1 and measured["speedup"] == pytest.approx(1.0)
    # one size measured with its phase split (compute 80% of the step, no all-reduce): the
    # compute shrinks with more ranks, the rest stays; half trusted where it was measured
    assert [p["speedup"] for p in points] == pytest.approx([0.02 / 0.036, 1.0, 0.02 / (
        0.004 + 0.032 / 3), 0.02 / 0.012])
    assert [p["confidence"] for p in points] == pytest.approx([0.25, 0.5, 0.5 * 2 ** -0.585,
                                                              0.25], rel=1e-2)
    assert h.m.status("f").speedup == ()
    assert h.m.status("g").to_dict()["speedup"][1]["size"] == 2.0


def test_rank_zeros_noise_scale_reaches_the_status_and_the_model() -> None:
    from nbtrain.core.machine_events import UnknownKind, rank_from_wire

    h = Harness(workers=4)
    h.submit("g", 2, min_size=1, max_size=4, sizing="goodput")
    gen = h.launches("g")[-1].generation
    h.steps("g", gen, 5, step_s=0.02)
    assert h.m.status("g").noise_scale is None
    for rank, value in ((0, 12.5), (1, 999.0)):  # rank 1's comes last and is ignored
        h.feed(rank_from_wire, "g", {"kind": "gradnoise", "rank": rank, "generation": gen,
                                     "step": 5, "noise_scale": value})
    h.steps("g", gen, 10, step_s=0.02)
    assert h.m.status("g").noise_scale == 12.5
    assert h.m.sched is not None
    model = h.m.sched.goodput_model("g")
    assert model is not None and model.noise_scale == 12.5
    assert h.events("g", "gradnoise") == []  # not in the job's log
    for bad in (-1.0, float("nan"), "big", True):
        with pytest.raises(ValueError, match="noise_scale as a finite number >= 0"):
            rank_from_wire(0.0, 0.0, "g", {"kind": "gradnoise", "rank": 0, "generation": gen,
                                           "noise_scale": bad})
    with pytest.raises(UnknownKind):
        rank_from_wire(0.0, 0.0, "g", {"kind": "gradnoisy", "rank": 0, "generation": gen})


def test_a_generations_first_steps_are_not_timed_for_its_curve() -> None:
    from nbtrain.core.progress import WARMUP_STEPS

    h = Harness(workers=4)
    h.submit("g", 2, min_size=1, max_size=4, sizing="goodput")
    gen = h.launches("g")[-1].generation
    h.steps("g", gen, WARMUP_STEPS, step_s=1.5)  # warm-up: slow, and not timed
    assert _model_sizes(h, "g") == ()
    h.steps("g", gen, WARMUP_STEPS + 4, step_s=0.02)
    [measured] = [p for p in h.m.status("g").speedup if "step_s" in p]
    assert measured["step_s"] == pytest.approx(0.02) and measured["steps"] == 4


def test_step_times_that_are_not_finite_stay_out_of_the_curve() -> None:
    import math

    from nbtrain.core.machine_events import rank_from_wire

    h = Harness(workers=4)
    h.submit("g", 2, min_size=1, max_size=4, sizing="goodput")
    gen = h.launches("g")[-1].generation
    h.steps("g", gen, 4, step_s=0.02)
    rows = [[s, 1e9 + h.t, t, 0.0, 0.0, 0.0, 0.0]
            for s, t in ((5, math.inf), (6, math.nan), (7, 0.02))]
    h.feed(rank_from_wire, "g", {"kind": "steps", "rank": 0, "generation": gen, "rows": rows})
    assert h.state("g") == "RUNNING"
    [measured] = [p for p in h.m.status("g").speedup if "step_s" in p]
    assert measured["step_s"] == pytest.approx(0.02) and measured["steps"] == 3


def test_rank_zeros_step_rows_tell_the_scheduler_how_long_the_job_has_left() -> None:
    h = Harness(workers=4)
    h.submit("g", 2, min_size=1, max_size=4, sizing="goodput")  # steps=1000
    assert h.m.sched is not None and h.m.sched.goodput_left_s("g") is None
    h.steps("g", h.launches("g")[-1].generation, 10, step_s=0.02)
    # 990 steps left at 0.02 s each (the warm-up rows are not timed, but they count as done)
    assert h.m.sched.goodput_left_s("g") == pytest.approx(990 * 0.02)
    h.submit("f", 2, min_size=1)
    h.steps("f", h.launches("f")[-1].generation, 10, step_s=0.02)
    assert h.m.sched.goodput_left_s("f") is None  # not goodput-sized
