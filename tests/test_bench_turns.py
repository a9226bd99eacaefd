"""benchmarks/_turns.py: the schedule two benchmark members share, and the rates read from it.

Pure (no processes, no clock): times are given, so each test is exact."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import load_file_module

turns_mod = load_file_module(Path(__file__).resolve().parent.parent / "benchmarks" / "_turns.py",
                             "_turns")
Turns = turns_mod.Turns
SCHEDULE = Turns(t0=100.0, turn_s=2.0, members=2, turns=3)  # turns 0..5 over [100, 112)


def test_members_own_alternate_turns_and_nothing_outside_the_schedule() -> None:
    a, b = SCHEDULE.member(0), SCHEDULE.member(1)
    assert [a.mine(t) for t in (99.9, 100.0, 101.9, 102.0, 104.5, 111.9, 112.0)] == [
        False, True, True, False, True, False, False]
    assert [b.mine(t) for t in (99.9, 100.0, 102.0, 103.9, 106.0, 111.9, 112.0)] == [
        False, False, True, True, True, True, False]


def test_next_start_is_the_members_next_turn_and_none_after_its_last() -> None:
    a, b = SCHEDULE.member(0), SCHEDULE.member(1)
    assert a.next_start(50.0) == 100.0  # before the schedule: its first turn
    assert b.next_start(50.0) == 102.0
    assert a.next_start(101.0) == 104.0  # inside its own turn: the one after the other's
    assert a.next_start(103.0) == 104.0
    assert b.next_start(103.0) == 106.0
    assert a.next_start(108.5) is None  # its last turn (8-10) has begun
    assert b.next_start(108.5) == 110.0
    assert b.next_start(110.5) is None
    # Two ranks that disagree at a turn's edge (one just before, one just after) agree on
    # where they resume.
    assert a.next_start(101.999) == a.next_start(102.001) == 104.0


def test_rates_skip_each_turns_start_and_leave_out_short_turns() -> None:
    a = SCHEDULE.member(0)
    # Turn 0 (100-102): a step every 0.1 s from 100.05; turn 2 (104-106): every 0.2 s;
    # turn 4 (108-110): only two steps after the skip. Steps in member 1's turns are ignored.
    times = ([100.05 + 0.1 * i for i in range(19)] + [103.0, 103.5]
             + [104.1 + 0.2 * i for i in range(9)] + [108.0, 109.5, 109.9])
    rates = a.rates(times, skip_s=0.3)
    assert set(rates) == {0, 1}
    assert abs(rates[0] - 10.0) < 1e-9  # 100.35 .. 101.85
    assert abs(rates[1] - 5.0) < 1e-9  # 104.5 .. 105.7


def test_pair_figures_use_cycles_after_the_first_and_after_both_were_ready() -> None:
    ours = {0: 10.0, 1: 9.0, 2: 9.5, 3: 8.0}
    peer = {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}
    schedule = Turns(t0=0.0, turn_s=1.0, members=2, turns=4)
    f = turns_mod.pair_figures("x", ours, peer, ready=0.0, turns=schedule)
    assert f["x_cycles"] == 3  # cycle 0 is warm-up
    assert f["x_ratio"] == 0.9  # median of 0.9, 0.95, 0.8
    assert f["x_pooled_ratio"] == round(((9.0 + 9.5 + 8.0) / 3) / 10.0, 4)
    late = turns_mod.pair_figures("x", ours, peer, ready=3.5, turns=schedule)  # cycle 2 at 4.0
    assert late["x_cycles"] == 2 and late["x_ratio"] == round((0.95 + 0.8) / 2, 4)
    none = turns_mod.pair_figures("x", {}, peer, ready=0.0, turns=schedule)
    assert none["x_ratio"] is None and none["x_cycles"] == 0
