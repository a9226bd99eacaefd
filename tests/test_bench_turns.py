"""benchmarks/_turns.py: the schedule two benchmark members share, and the rates and per-step
means read from it; benchmarks/_schedtrace.py: a scheduler trace split by role.

Pure (no processes, no clock, no perf): times and trace lines are given, so each test is
exact."""

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


def test_median_interval_takes_the_order_statistics_of_the_binomial_tail() -> None:
    # n = 9: P(Bin(9, 1/2) <= 1) = 10/512 <= 0.025 < P(<= 2) = 46/512: the 2nd and 8th.
    assert turns_mod.median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5]) == (2, 8)
    # n = 24: P(<= 6) = 0.0113, P(<= 7) = 0.032: the 7th and the 18th (coverage 97.7%).
    assert turns_mod.median_interval(list(range(24))) == (6, 17)
    assert turns_mod.median_interval([1.0] * 5) is None  # P(<= 0) = 1/32 > 0.025
    assert turns_mod.median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)


def test_pair_figures_give_an_interval_for_the_median_ratio() -> None:
    schedule = Turns(t0=0.0, turn_s=1.0, members=2, turns=12)
    ours = {c: 9.0 + 0.1 * c for c in range(12)}
    peer = dict.fromkeys(range(12), 10.0)
    f = turns_mod.pair_figures("x", ours, peer, ready=0.0, turns=schedule)
    # cycles 1..11: ratios 0.91 .. 1.01; n = 11: P(<= 1) = 12/2048 <= 0.025 < P(<= 2)
    assert f["x_cycles"] == 11 and f["x_ratio_ci95"] == [0.92, 1.0]
    few = turns_mod.pair_figures("x", {0: 1.0, 1: 1.0, 2: 1.0}, {0: 1.0, 1: 1.0, 2: 1.0},
                                 ready=0.0, turns=Turns(t0=0.0, turn_s=1.0, members=2, turns=3))
    assert few["x_ratio_ci95"] is None


def test_per_step_means_come_from_each_turns_first_and_last_sample() -> None:
    a = SCHEDULE.member(0)
    # Turn 0 (100-102): a step every 0.1 s from 100.05, each 6 ms of CPU, one involuntary
    # switch every other step, 3 voluntary ones each. Samples in member 1's turn are ignored.
    samples = [[100.05 + 0.1 * i, 0.006 * i, 3.0 * i, float(i // 2)] for i in range(19)]
    samples.append([103.0, 5.0, 1000.0, 1000.0])
    rows = a.per_step(samples, skip_s=0.3)
    assert set(rows) == {0}
    wall_ms, cpu_ms, vol, invol = rows[0]  # samples 3 (100.35) .. 18 (101.85): 15 steps
    assert abs(wall_ms - 100.0) < 1e-9 and abs(cpu_ms - 6.0) < 1e-9
    assert vol == 3.0 and invol == (9 - 1) / 15


sched = load_file_module(Path(__file__).resolve().parent.parent / "benchmarks" / "_schedtrace.py",
                         "_schedtrace")

TIMEHIST = """\
           time    cpu  task name                       wait time  sch delay   run time
                        [tid/pid]                          (msec)     (msec)     (msec)
--------------- ------  ------------------------------  ---------  ---------  ---------
   10.000100 [0000]  python[8606]                        0.000      0.015      0.400
   10.000200 [0001]  <idle>                              0.000      0.000      1.096
   10.500000 [0001]  python[8621/8600]                   0.029      0.022      2.000
   10.600000 [0000]  gloo_tcp_loop[8646/8606]            0.000      0.010      0.600
   11.500000 [0000]  kworker/0:1-mm[28672]               0.000      0.000      1.000
   12.500000 [0001]  python[8606]                        0.000      0.000      9.000
"""


def test_timehist_lines_become_slices_of_their_process() -> None:
    slices = sched.parse_timehist(TIMEHIST)
    assert [(s.comm, s.tid, s.pid, s.run_ms) for s in slices] == [
        ("python", 8606, 8606, 0.4), ("python", 8621, 8600, 2.0),
        ("gloo_tcp_loop", 8646, 8606, 0.6), ("kworker/0:1-mm", 28672, 28672, 1.0),
        ("python", 8606, 8606, 9.0)]  # the idle task and the headers are not slices
    assert slices[0].end == 10.0001 and slices[1].cpu == 1


def test_cpu_by_role_counts_slices_that_end_inside_the_windows() -> None:
    slices = sched.parse_timehist(TIMEHIST)
    # Windows [11.0, 11.6) and [10.0, 10.65), out of order; the slice ending at 12.5 is out.
    got = sched.cpu_by_role(slices, [(11.0, 11.6), (10.0, 10.65)], {8606: "rank", 8600: "ctl"},
                            cores=2)
    seconds = 0.6 + 0.65
    assert got["rank"] == round((0.4 + 0.6) / seconds, 1)
    assert got["ctl"] == round(2.0 / seconds, 1)
    assert got["other"] == round(1.0 / seconds, 1)
    assert got["idle"] == round(2000 - 4.0 / seconds, 1)
    assert sched.cpu_by_role(slices, [], {}, cores=2) == {}


def _switch(t: float, cpu: int, prev: str, tid: int, state: str, nxt: str, by: int) -> str:
    """One ``perf script`` line of a ``sched_switch``, as perf prints it."""
    return (f"{prev:>16} {tid:5d} [{cpu:03d}] {t:12.6f}:       sched:sched_switch: "
            f"prev_comm={prev} prev_pid={tid} prev_prio=120 prev_state={state} ==> "
            f"next_comm={nxt} next_pid={by} next_prio=120")


SCRIPT = "\n".join([
    _switch(10.1, 0, "python", 8606, "R", "python", 8621),
    _switch(10.2, 0, "python", 8621, "S", "python", 8606),
    _switch(10.3, 1, "gloo_tcp_loop", 8646, "R+", "kworker/0:1-mm", 28672),
    _switch(10.4, 1, "swapper/1", 0, "R", "python", 8606),
    "          python  8606 [000]    10.500000:     sched:sched_wakeup: comm=python "
    "pid=8621 prio=120 target_cpu=000",
    _switch(11.9, 0, "python", 8606, "R", "python", 8621)])


def test_preemptions_are_switches_away_from_a_runnable_thread() -> None:
    got = sched.parse_preemptions(SCRIPT)
    # Sleeping (S) is no preemption, the idle task is not preempted, wake-ups are skipped.
    assert [(p.time, p.cpu, p.tid, p.comm, p.by_tid, p.by_comm) for p in got] == [
        (10.1, 0, 8606, "python", 8621, "python"),
        (10.3, 1, 8646, "gloo_tcp_loop", 28672, "kworker/0:1-mm"),
        (11.9, 0, 8606, "python", 8621, "python")]


def test_preemptors_count_who_took_the_victims_cores_inside_the_windows() -> None:
    found = sched.parse_preemptions(SCRIPT)
    pid_of = {8606: 8606, 8646: 8606, 8621: 8600, 28672: 28672}
    got = sched.preemptors(found, [(10.0, 10.5)], [8606], pid_of,
                           {8606: "rank", 8600: "ctl"})
    # Two in the half-second window (the one at 11.9 is outside), per second.
    assert got == {"python <- ctl: python": 2.0, "gloo_tcp_loop <- other: kworker/0:1-mm": 2.0}
    assert sched.preemptors(found, [(10.0, 10.5)], [8600], pid_of, {}) == {}
    assert sched.preemptors(found, [], [8606], pid_of, {}) == {}
