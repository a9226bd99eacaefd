"""The hang and startup watchdog's settings and its per-generation state (pure, fast)."""

from __future__ import annotations

import pytest

from nbtrain.core.lifecycle_types import JobPolicy
from nbtrain.core.watchdog import GenerationWatch, Hang, Slow, WatchdogSettings


def test_every_bound_is_named_with_the_values_it_always_had() -> None:
    s = WatchdogSettings()
    assert (s.dispatch_s, s.answer_timeout_s, s.give_up_factor) == (30.0, 30.0, 10.0)
    assert (s.confirm_min_s, s.confirm_max_s, s.confirm_share) == (2.0, 60.0, 0.5)
    assert (s.longest_step_factor, s.median_window) == (2.0, 64)
    assert s.bound("rendezvous") == JobPolicy().rendezvous_timeout_s + 30.0
    assert s.bound("first step") == s.bound("setup") == JobPolicy().setup_timeout_s
    assert [s.confirm_s(x) for x in (1.0, 10.0, 500.0)] == [2.0, 5.0, 60.0]


def test_bad_settings_name_every_problem_and_the_fix() -> None:
    with pytest.raises(ValueError) as err:
        WatchdogSettings(hang_factor=0, setup_timeout_s=-1, give_up_factor=0.5,
                         confirm_min_s=5.0, confirm_max_s=1.0, median_window=0)
    text = str(err.value)
    for name in ("hang_factor", "setup_timeout_s", "give_up_factor", "confirm_max_s",
                 "median_window"):
        assert name in text
    assert "longer than loading the data" in text
    with pytest.raises(ValueError, match="restore_timeout_s must be > 0 seconds"):
        JobPolicy(restore_timeout_s=0.0)


def test_a_silent_generation_is_looked_at_twice_then_declared_hung() -> None:
    watch = GenerationWatch(WatchdogSettings(), started=0.0)
    watch.progressed(10.0)
    assert watch.record_steps([0.5, 0.01, 0.01]) == 0.01  # the first step warms up
    assert not watch.look(12.9, longest_step=0.01)  # limit: the 3 s floor
    assert watch.look(13.5, longest_step=0.01)  # the first look
    assert watch.probe is not None and watch.probe.limit_s == 3.0
    assert watch.diagnosed(13.6, 1e9, (1,), {0: "a", 1: "b"}, size=2) is None
    assert not watch.look(14.0, longest_step=0.01)  # the second look waits 2 s
    assert watch.look(15.7, longest_step=0.01)
    hang = watch.diagnosed(15.8, 1e9, (1,), {0: "a2", 1: "b"}, size=2)
    assert isinstance(hang, Hang) and hang.culprits == (1,) and watch.declared
    assert "rank 1's call stack did not change in 2.2 s" in hang.evidence


def test_moving_stacks_are_slow_not_hung_said_once() -> None:
    watch = GenerationWatch(WatchdogSettings(), started=0.0)
    assert watch.look(4.0, longest_step=0.0)
    watch.diagnosed(4.1, 1e9, (0,), {0: "a"}, size=1)
    slow = watch.diagnosed(6.2, 1e9, (0,), {0: "b"}, size=1)
    assert isinstance(slow, Slow) and slow.limit_s == 3.0
    assert watch.diagnosed(8.3, 1e9, (0,), {0: "c"}, size=1) is None  # said once per look
    watch.progressed(9.0)
    assert not watch.look(9.5, longest_step=0.0) and watch.probe is None


def test_a_rank_late_in_its_startup_phase_is_the_culprit() -> None:
    watch = GenerationWatch(WatchdogSettings(setup_timeout_s=30.0), started=0.0)
    watch.entered(0, "first step", 1.0)
    watch.entered(1, "setup", 1.0)
    assert not watch.check_startup(31.0, 1e9, (0, 1))
    assert watch.check_startup(31.5, 1e9, (0, 1))
    assert watch.hang is not None and watch.hang.culprits == (1,) and not watch.declared
    assert watch.hang.phase == "setup"  # the earliest phase a late rank is in
    found = watch.diagnosed(32.0, 1e9, (), {}, size=2)
    assert found is watch.hang and watch.declared
