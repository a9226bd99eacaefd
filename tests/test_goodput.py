from __future__ import annotations

import json

import pytest

from nbtrain.core import goodput
from nbtrain.core.goodput import GoodputLedger


def _trained(last: int, seconds: float = 1.0, *, commit: int = 0) -> GoodputLedger:
    """A ledger training from 0 s: steps 1..``last`` of ``seconds`` each, ``commit`` committed."""
    g = GoodputLedger(now=0.0)
    g.enter("training", 0.0)
    for step in range(1, last + 1):
        g.step(step, seconds)
    if commit:
        g.committed(commit)
    return g


def test_breakdown_adds_up_with_rollback_and_checkpoints() -> None:
    g = GoodputLedger(now=0.0)
    g.enter("startup", 2.0)          # queued 2 s
    g.enter("training", 5.0)         # startup 3 s
    for step in range(1, 11):        # 10 steps of 0.5 s: 5.0 .. 10.0
        g.step(step, 0.5)
    g.checkpoint_blocked(0.2)
    g.committed(6)
    g.enter("recovery", 10.0)        # fault at 10 s: steps 7..10 are lost on resume from 6
    assert g.rollback(6) == 4
    g.enter("training", 13.0)        # recovery 3 s
    g.enter("ended", 15.0)
    b = g.snapshot(now=20.0)         # ended time is not wall time of the job
    assert b.wall_s == pytest.approx(15.0)
    assert b.queued_s == pytest.approx(2.0)
    assert b.startup_s == pytest.approx(3.0)
    assert b.recovery_s == pytest.approx(3.0)
    assert b.lost_s == pytest.approx(2.0) and b.lost_steps == 4
    assert b.checkpoint_s == pytest.approx(0.2)
    # training 5 + 2 = 7 s, minus 0.2 blocking, minus 2 lost
    assert b.productive_s == pytest.approx(4.8)
    parts = b.productive_s + b.queued_s + b.startup_s + b.recovery_s + b.lost_s + b.checkpoint_s
    assert parts == pytest.approx(b.wall_s)
    assert b.fraction == pytest.approx(4.8 / 15.0)


def test_committed_steps_cannot_be_lost() -> None:
    g = _trained(4, commit=4)
    assert g.rollback(4) == 0
    assert g.rollback(0) == 0  # older checkpoint requested: committed steps stay counted


def test_a_resume_past_the_rollback_gives_the_steps_up_to_it_back() -> None:
    """The controller rolled back to step 4, but a checkpoint of step 6 had committed
    unheard: the ranks restore 6, so only steps 7 and 8 were lost."""
    g = _trained(8, commit=4)
    assert g.rollback(4) == 4
    assert g.resumed_at(6) == 2
    b = g.snapshot(now=8.0)
    assert b.lost_steps == 2 and b.lost_s == pytest.approx(2.0)
    assert g.resumed_at(6) == 0  # said once per rollback: a second start changes nothing
    assert g.snapshot(now=8.0).lost_steps == 2
    g.step(6, 1.0)  # a stale row of a restored step is committed work, not at risk
    assert g.rollback(6) == 0


def test_a_restore_older_than_the_newest_commit_loses_the_steps_after_it() -> None:
    """Checkpoints of steps 4 and 8 committed; a fault at step 12 rolls back to 8, but 8 is
    unreadable and the ranks restore 4: steps 5-12 are computed again."""
    g = GoodputLedger(now=0.0)
    g.enter("training", 0.0)
    for step in range(1, 13):
        g.step(step, 0.5)
        if step in (4, 8):
            g.committed(step)
    assert g.rollback(8) == 4
    assert g.resumed_at(4) == 8
    b = g.snapshot(now=6.0)
    assert b.lost_steps == 8 and b.lost_s == pytest.approx(4.0)
    for step in range(5, 9):  # the new generation trains them again, and commits 8 again
        g.step(step, 0.5)
    g.committed(8)
    assert g.rollback(8) == 0 and g.snapshot(now=8.0).lost_steps == 8


def test_committed_step_times_kept_are_bounded() -> None:
    g = GoodputLedger(now=0.0)
    g.enter("training", 0.0)
    steps = goodput.RECENT_STEPS + 100
    for step in range(1, steps + 1):
        g.step(step, 1.0)
        g.committed(step)
    g.rollback(steps)
    # The ranks fall back to step 0: every step is computed again; the newest RECENT_STEPS
    # count at their own times, the older ones at the mean committed step time.
    assert len(g._recent) == goodput.RECENT_STEPS
    assert g.resumed_at(0) == steps
    assert g.snapshot(now=float(steps)).lost_s == pytest.approx(float(steps))


def test_steps_at_risk_are_kept_bounded_and_still_counted() -> None:
    """No checkpoint for 3 * RECENT_STEPS steps of 1 s: the ledger keeps the newest
    RECENT_STEPS one by one and the older ones as one run; a commit inside that run, a
    rollback and a newer restore still count every step."""
    n = 3 * goodput.RECENT_STEPS
    g = _trained(n)
    assert len(g._uncommitted.each) == goodput.RECENT_STEPS
    assert g._uncommitted.count() == n
    g.committed(1000)  # inside the folded run
    assert g.rollback(1000) == n - 1000
    assert g.resumed_at(2000) == n - 2000  # a newer restore gives steps 1001-2000 back
    b = g.snapshot(now=float(n))
    assert b.lost_steps == n - 2000 and b.lost_s == pytest.approx(n - 2000)
    assert b.productive_s == pytest.approx(2000)
    assert g._committed_n == 2000  # the steps given back count as committed


def test_a_fall_back_counts_the_committed_steps_the_ledger_does_not_hold_one_by_one() -> None:
    """Steps a fall-back computes again count also when their times are not kept one by one:
    given back by an earlier restore, or committed out of a folded run."""
    g = _trained(150, commit=100)
    assert g.rollback(100) == 50
    assert g.resumed_at(150) == 0  # 101-150 had committed after all
    for step in range(151, 201):
        g.step(step, 1.0)
    g.committed(200)
    assert g.rollback(200) == 0
    assert g.resumed_at(120) == 80  # 121-200 computed again
    b = g.snapshot(now=200.0)
    assert b.lost_steps == 80 and b.lost_s == pytest.approx(80.0)

    g = GoodputLedger(now=0.0)
    g.enter("training", 0.0)
    for step in range(1, 101):
        g.step(step, 1.0)
        g.committed(step)
    for step in range(101, 101 + goodput.RECENT_STEPS + 100):  # 101-200 fold
        g.step(step, 1.0)
    g.committed(150)  # inside the folded run
    assert g.rollback(150) == goodput.RECENT_STEPS + 50
    assert g.resumed_at(120) == goodput.RECENT_STEPS + 50 + 30


def test_a_pending_rollback_is_carried_and_a_newer_restore_still_gives_it_back() -> None:
    """A rank failed at step 150 (commit 100 known: 50 lost) and the controller died before
    the relaunch; the ranks then restore 150, which had committed unheard."""
    g = _trained(150, commit=100)
    g.enter("recovery", 150.0)
    assert g.rollback(100) == 50
    c = GoodputLedger.continued(json.loads(json.dumps(g.carry(now=151.0))), now=0.0,
                                down_s=2.0)
    assert c.snapshot(now=0.0).lost_steps == 50  # counted once
    assert c.resumed_at(150) == 0
    b = c.snapshot(now=0.0)
    assert b.lost_steps == 0 and b.lost_s == pytest.approx(0.0)
    assert b.recovery_s == pytest.approx(3.0)


def test_a_carried_ledger_continues_after_a_controller_restart() -> None:
    """Journaled 7 s in (queued 1 s, startup 1 s, 10 steps of 0.5 s, step 6 committed); the
    controller is back 5 s later: the totals go on, the 5 s down count as recovery, steps
    7-10 are lost, and the carry is plain JSON."""
    g = GoodputLedger(now=0.0)
    g.enter("startup", 1.0)
    g.enter("training", 2.0)
    for step in range(1, 11):
        g.step(step, 0.5)
    g.checkpoint_blocked(0.2)
    g.committed(6)
    carried = json.loads(json.dumps(g.carry(now=7.0)))
    c = GoodputLedger.continued(carried, now=1000.0, down_s=5.0)
    c.enter("recovery", 1000.0)          # what the restored job does at once
    b = c.snapshot(now=1003.0)           # 3 s more of recovery
    assert b.wall_s == pytest.approx(15.0)
    assert b.queued_s == pytest.approx(1.0) and b.startup_s == pytest.approx(1.0)
    assert b.recovery_s == pytest.approx(8.0) and b.checkpoint_s == pytest.approx(0.2)
    assert b.lost_steps == 4 and b.lost_s == pytest.approx(2.0)
    # training 5 s, minus 0.2 blocking, minus 2 lost
    assert b.productive_s == pytest.approx(2.8)
    # The ranks restore step 8 (committed after the journal's last write): 7 and 8 come
    # back at the mean time of the steps at risk.
    assert c.resumed_at(8) == 2
    assert c.snapshot(now=1003.0).lost_s == pytest.approx(1.0)
    assert c.rollback(8) == 0 and c.snapshot(now=1003.0).lost_steps == 2


def test_a_carried_queued_ledger_stays_queued_for_the_time_down() -> None:
    g = GoodputLedger(now=0.0)
    c = GoodputLedger.continued(g.carry(now=4.0), now=50.0, down_s=6.0)
    b = c.snapshot(now=51.0)
    assert b.queued_s == pytest.approx(11.0) and b.wall_s == pytest.approx(11.0)
    assert b.recovery_s == 0.0 and b.lost_steps == 0


def test_unknown_phase_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown goodput phase 'lunch'"):
        GoodputLedger(now=0.0).enter("lunch", 1.0)
