"""Checkpoint policy (pure): step, time, on-demand and Young/Daly triggers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbtrain.core.checkpoint_policy import (
    CheckpointPolicy,
    CheckpointPolicyConfig,
    parse_checkpoint_setting,
    young_daly_interval,
)


def run(policy: CheckpointPolicy, steps: range, dt: float = 1.0, cost: float = 0.0) -> list[int]:
    """Drive the policy one step at a time; return the steps at which it checkpointed."""
    taken = []
    for s in steps:
        now = s * dt
        if policy.due(s, now):
            policy.record(s, now, cost)
            taken.append(s)
    return taken


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_steps": 0}, "every_steps must be a positive integer"),
        ({"every_steps": -3}, "every_steps must be a positive integer"),
        ({"every_steps": True}, "every_steps must be a positive integer"),
        ({"every_steps": 2.5}, "every_steps must be a positive integer"),
        ({"every_seconds": 0}, "every_seconds must be finite and > 0"),
        ({"every_seconds": math.inf}, "every_seconds must be finite and > 0"),
        ({"every_seconds": math.nan}, "every_seconds must be finite and > 0"),
        ({"every_seconds": "10"}, "every_seconds must be a number"),
        ({"mtbf_s": -1.0}, "mtbf_s must be finite and > 0"),
        ({"smoothing": 0.0}, "smoothing must be in"),
        ({"smoothing": 1.5}, "smoothing must be in"),
        ({"min_interval_s": 10.0, "max_interval_s": 5.0}, "min_interval_s=10.0 is above"),
        ({"probe_after_steps": 0}, "probe_after_steps must be a positive integer"),
    ],
)
def test_config_validation_names_the_value(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckpointPolicyConfig(**kwargs)  # type: ignore[arg-type]


def test_every_n_steps_aligned_to_multiples() -> None:
    p = CheckpointPolicy(CheckpointPolicyConfig(every_steps=10), now=0.0)
    assert run(p, range(1, 45)) == [10, 20, 30, 40]


def test_every_n_steps_after_resume_keeps_the_same_grid() -> None:
    # A run resumed at step 15 checkpoints at 20, 30 like the uninterrupted run.
    p = CheckpointPolicy(CheckpointPolicyConfig(every_steps=10), now=0.0, step=15)
    assert run(p, range(16, 35)) == [20, 30]


def test_skipped_boundaries_still_trigger() -> None:
    # If the loop asks only every few steps, a passed multiple is not lost.
    p = CheckpointPolicy(CheckpointPolicyConfig(every_steps=10), now=0.0)
    assert not p.due(9, 0.0)
    assert p.due(13, 0.0)


def test_never_twice_for_the_same_step() -> None:
    p = CheckpointPolicy(CheckpointPolicyConfig(every_steps=1), now=0.0)
    assert p.due(1, 0.0)
    p.record(1, 0.0)
    assert not p.due(1, 0.0)
    p.request()
    assert not p.due(1, 0.0)  # a checkpoint of step 1 exists already
    assert p.due(2, 0.0)


def test_every_seconds_uses_the_callers_clock() -> None:
    p = CheckpointPolicy(CheckpointPolicyConfig(every_seconds=30.0), now=100.0)
    assert not p.due(1, 129.9)
    assert p.due(1, 130.0)
    p.record(1, 130.0)
    assert not p.due(2, 159.0)
    assert p.due(3, 160.0)
    assert p.interval_s == 30.0


def test_on_demand_request_is_cleared_by_record() -> None:
    p = CheckpointPolicy(CheckpointPolicyConfig(), now=0.0)
    assert not p.due(5, 1e9)  # no trigger configured: only on demand
    p.request()
    assert p.due(5, 0.0)
    p.record(5, 0.0)
    assert not p.due(6, 0.0)
    assert p.interval_s is None


def test_auto_probes_first_then_uses_young_daly() -> None:
    cfg = CheckpointPolicyConfig(auto=True, mtbf_s=3600.0, probe_after_steps=2, smoothing=1.0)
    p = CheckpointPolicy(cfg, now=0.0)
    assert p.interval_s is None and p.cost_s is None
    assert not p.due(1, 0.0)
    assert p.due(2, 0.0)  # measure C first
    p.record(2, 10.0, cost_s=0.5)
    expected = math.sqrt(2 * 0.5 * 3600.0)  # 60 s
    assert p.interval_s == pytest.approx(expected)
    assert not p.due(3, 10.0 + expected - 0.01)
    assert p.due(3, 10.0 + expected)


def test_auto_interval_follows_the_smoothed_cost() -> None:
    cfg = CheckpointPolicyConfig(auto=True, mtbf_s=1000.0, smoothing=0.5)
    p = CheckpointPolicy(cfg, now=0.0)
    p.record(1, 0.0, cost_s=2.0)
    first = p.interval_s
    p.record(2, 0.0, cost_s=8.0)
    assert p.cost_s == pytest.approx(5.0)  # 0.5 * 8 + 0.5 * 2
    assert p.interval_s == pytest.approx(young_daly_interval(5.0, 1000.0))
    assert first is not None and p.interval_s is not None and p.interval_s > first
    p.set_mtbf(250.0)
    assert p.interval_s == pytest.approx(young_daly_interval(5.0, 250.0))


def test_auto_interval_is_clamped() -> None:
    cfg = CheckpointPolicyConfig(auto=True, mtbf_s=100.0, min_interval_s=5.0, max_interval_s=50.0)
    p = CheckpointPolicy(cfg, now=0.0)
    p.record(1, 0.0, cost_s=0.0001)
    assert p.interval_s == 5.0
    p2 = CheckpointPolicy(cfg, now=0.0)
    p2.record(1, 0.0, cost_s=1000.0)
    assert p2.interval_s == 50.0


def test_auto_with_every_seconds_takes_the_shorter() -> None:
    cfg = CheckpointPolicyConfig(auto=True, every_seconds=10.0, mtbf_s=3600.0, smoothing=1.0)
    p = CheckpointPolicy(cfg, now=0.0)
    p.record(1, 0.0, cost_s=1.0)  # Young/Daly says ~85 s
    assert p.due(2, 10.0)


def test_bad_runtime_inputs() -> None:
    p = CheckpointPolicy(CheckpointPolicyConfig(auto=True), now=0.0)
    with pytest.raises(ValueError, match="cost_s must be a finite number >= 0"):
        p.record(1, 0.0, cost_s=-1.0)
    with pytest.raises(ValueError, match="mtbf_s must be finite"):
        p.set_mtbf(0.0)
    with pytest.raises(ValueError, match="MTBF"):
        young_daly_interval(1.0, 0.0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, CheckpointPolicyConfig()),
        ("off", CheckpointPolicyConfig()),
        (100, CheckpointPolicyConfig(every_steps=100)),
        ("auto", CheckpointPolicyConfig(auto=True)),
        ("AUTO", CheckpointPolicyConfig(auto=True)),
        ("90s", CheckpointPolicyConfig(every_seconds=90.0)),
        ("10m", CheckpointPolicyConfig(every_seconds=600.0)),
        ("1.5h", CheckpointPolicyConfig(every_seconds=5400.0)),
    ],
)
def test_parse_setting(value: object, expected: CheckpointPolicyConfig) -> None:
    assert parse_checkpoint_setting(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, "sometimes", "10 minutes", 0, "-5s", 2.5])
def test_parse_setting_rejects_with_a_fix(value: object) -> None:
    with pytest.raises(ValueError, match=r"checkpoint|every"):
        parse_checkpoint_setting(value)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 50),
    start=st.integers(0, 200),
    length=st.integers(1, 300),
    requests=st.sets(st.integers(0, 500), max_size=10),
)
def test_step_policy_property(n: int, start: int, length: int, requests: set[int]) -> None:
    """Every multiple of N after the start is covered, no step twice, on-demand served."""
    p = CheckpointPolicy(CheckpointPolicyConfig(every_steps=n), now=0.0, step=start)
    taken = []
    for s in range(start + 1, start + length + 1):
        if s in requests:
            p.request()
        if p.due(s, 0.0):
            p.record(s, 0.0)
            taken.append(s)
    assert len(taken) == len(set(taken))
    multiples = {s for s in range(start + 1, start + length + 1) if s % n == 0}
    assert multiples <= set(taken)
    asked = {s for s in requests if start < s <= start + length}
    assert asked <= set(taken)
    assert set(taken) <= multiples | asked


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=20), mtbf=st.floats(1.0, 1e6))
def test_auto_interval_within_bounds(costs: list[float], mtbf: float) -> None:
    cfg = CheckpointPolicyConfig(auto=True, mtbf_s=mtbf)
    p = CheckpointPolicy(cfg, now=0.0)
    for i, c in enumerate(costs, start=1):
        p.record(i, float(i), cost_s=c)
        assert p.interval_s is not None
        assert cfg.min_interval_s <= p.interval_s <= cfg.max_interval_s
        assert p.cost_s is not None and min(costs[:i]) - 1e-9 <= p.cost_s <= max(costs[:i]) + 1e-9


def test_the_time_part_leaves_a_live_interval_change_on_its_grid() -> None:
    # Checkpoints every 10 until 20, then the interval becomes 25 at step 26: the multiple
    # of 25 already passed (25) is overdue for due(), but the part one rank offers to the
    # others (time_due) leaves it to the deterministic grid, so the next checkpoint is 50.
    p = CheckpointPolicy(CheckpointPolicyConfig(every_steps=10), now=0.0)
    p.record(20, 0.0)
    p.set_every_steps(25)
    assert p.due(29, 0.0)
    assert not any(p.time_due(s, 0.0) for s in range(21, 60))
    p.request()
    assert p.time_due(29, 0.0)  # an on-demand request is still offered


def test_the_time_part_is_the_time_interval() -> None:
    p = CheckpointPolicy(CheckpointPolicyConfig(every_seconds=60.0), now=0.0)
    assert not p.time_due(5, 59.0)
    assert p.time_due(5, 60.0)
