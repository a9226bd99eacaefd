"""The running step time that spaces the ranks' control agreements (``StepPace``): one long
step (a save, an evaluation, a pause) no longer makes the ranks agree at every step after
it, and a lasting change of the step time still comes through."""

from __future__ import annotations

import pytest

from nbtrain.runtime.control import MAX_INTERVAL_STEPS
from nbtrain.runtime.stepper import StepPace

STEP_S, INTERVAL_S = 0.025, 0.2  # steps of 25 ms; Settings.control_interval_s's default


def _steady(steps: int = 50) -> StepPace:
    pace = StepPace()
    for _ in range(steps):
        pace.add(STEP_S)
    return pace


def test_first_step_sets_the_mean_and_later_ones_move_it_by_the_weight() -> None:
    pace = StepPace()
    assert pace.steps_between(INTERVAL_S) == 1  # no step yet: agree at the next one
    pace.add(0.04)
    assert pace.mean_s == 0.04
    pace.add(0.05)  # within the clamp: the plain running mean
    assert pace.mean_s == pytest.approx(0.9 * 0.04 + 0.1 * 0.05)


def test_one_long_step_does_not_make_the_ranks_agree_at_every_step() -> None:
    pace = _steady()
    assert pace.steps_between(INTERVAL_S) == int(INTERVAL_S / STEP_S)
    pace.add(2.0)  # a 2 s pause inside one step
    wishes = []
    for _ in range(20):
        wishes.append(pace.steps_between(INTERVAL_S))
        pace.add(STEP_S)
    # An unclamped mean would be 0.2225 s after the pause: a wish of 0 steps (agree at every
    # step) for the next ten steps.
    steady = int(INTERVAL_S / STEP_S)
    assert min(wishes) >= steady - 2, wishes  # 6 right after the pause, 7 and 8 later
    assert wishes[-1] >= steady - 1


def test_a_lasting_slowdown_comes_through() -> None:
    pace = _steady()
    for _ in range(8):
        pace.add(8 * STEP_S)
    assert pace.mean_s > 4 * STEP_S  # halfway within 8 steps
    for _ in range(40):
        pace.add(8 * STEP_S)
    assert pace.mean_s == pytest.approx(8 * STEP_S, rel=0.02)
    assert pace.steps_between(INTERVAL_S) == 1  # steps longer than the interval


def test_very_short_steps_wish_for_more_than_the_channel_allows() -> None:
    pace = StepPace()
    pace.add(1e-4)
    assert pace.steps_between(INTERVAL_S) > MAX_INTERVAL_STEPS  # offer() clamps it
